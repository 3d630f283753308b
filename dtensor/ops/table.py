"""The op table: for every op, its local kernel, how its arguments bind, and its rule.

The dispatcher reads one :class:`OpInfo` per op to (1) bind a call's positional and keyword
arguments to parameter names, (2) tell tensor-like arguments (Tensor, DTensor, python
scalar) from static ones, (3) build the propagation-cache key from the input specs and the
*decision-relevant* static arguments only (``static_params``: dim, keepdim, a view's shape,
an einsum equation...; never a scalar's value), and (4) call the local kernel on the local
shards. Rules live in :mod:`placements.rules`, registered under ``OpInfo.rule``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

__all__ = ["OPS", "OpInfo", "get_op", "register_op"]


@dataclass(frozen=True, slots=True)
class OpInfo:
    """One op of the table.

    Attributes
    ----------
    name : str
        Public name (``"add"``, ``"sum"``, ``"matmul"``...); also the cache key's op id.
    kernel : callable
        The local kernel, called as ``kernel(*bound_values_in_params_order)`` with local
        Tensors in place of DTensors (python scalars passed through).
    params : tuple of str
        Parameter names in the kernel's positional order.
    tensor_params : tuple of str
        The parameters that may hold a tensor-like value (Tensor, DTensor, python scalar);
        they become ``OpSchema.args`` in this order. For a ``variadic`` parameter every
        element is one argument.
    static_params : tuple of str
        Decision-relevant non-tensor parameters (``OpSchema.static``, part of the cache key).
    defaults : mapping
        Default values of parameters that may be omitted.
    rule : str
        Name of the rule in :mod:`placements.rules` (defaults to ``name``).
    variadic : str or None
        Name of a parameter that holds a sequence of tensors (``cat``/``stack``'s tensors,
        ``einsum``'s operands).
    local_fn : callable or None
        For ops whose local computation depends on the chosen strategy or on global metadata
        (``mean`` over a sharded dim is a local sum times 1/N_global): called once per cache
        entry as ``local_fn(schema, strategy)`` and returns the kernel to use for it.
    inplace : bool
        The op writes its first tensor argument (validated before any write).
    """

    name: str
    kernel: Callable
    params: tuple[str, ...]
    tensor_params: tuple[str, ...]
    static_params: tuple[str, ...] = ()
    defaults: Mapping[str, object] = field(default_factory=dict)
    rule: str = ""
    variadic: str | None = None
    local_fn: Callable | None = None
    inplace: bool = False


OPS: dict[str, OpInfo] = {}


def register_op(info: OpInfo) -> OpInfo:
    """Add ``info`` to the table (``rule`` defaults to ``name``). **Local**."""
    if not info.rule:
        object.__setattr__(info, "rule", info.name)
    OPS[info.name] = info
    return info


def get_op(name: str) -> OpInfo:
    """The table entry of ``name``. **Local**."""
    return OPS[name]
