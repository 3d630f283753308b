"""``dt.register_op``: make a user's function an op that works on DTensors.

This module owns the public way to add an op: the user gives the local kernel (a function
of local ``dt.Tensor`` arguments) and its sharding rule (a pure function of metadata, as
the built-in rules in :mod:`placements.rules`); :func:`register_op` declares both in the op
table (:func:`dtensor.ops.declare`, which registers the rule with its static parameters)
and returns a function that runs the kernel on local tensors and dispatches DTensor calls
(strategy choice, redistribution, propagation cache) like any built-in op.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

from placements.errors import ArgumentError, DTypeError
from placements.rules import OpSchema, RuleResult

from ..ops import OPS, declare
from .dispatcher import dispatch
from .install import has_dtensor

__all__ = ["register_op"]


def register_op(
    name: str,
    kernel: Callable[..., object],
    rule: Callable[[OpSchema], RuleResult],
    *,
    tensor_params: Sequence[str] | None = None,
    static_params: Sequence[str] = (),
) -> Callable[..., object]:
    """Register ``kernel`` as op ``name`` with sharding rule ``rule``. **Local**.

    Call it the same way on every rank (at import time of the user's module).

    Parameters
    ----------
    name : str
        The op's name: its propagation-cache id and the name in messages. Must be new.
    kernel : callable
        The local computation, called with local ``dt.Tensor`` objects in place of
        DTensors (python scalars passed through). Its positional parameters (no ``*args``
        or ``**kwargs``) define the op's signature and defaults.
    rule : callable
        ``rule(schema) -> RuleResult``: for ONE mesh dim, the output shapes and dtypes and
        the candidate strategies ``Candidate((*output_placements, *input_placements))``
        with one input placement per tensor parameter (see :mod:`placements.rules`). The
        N-D expansion, cost-based choice and redistribution are the dispatcher's.
    tensor_params : sequence of str, optional
        The parameters that take tensors (or python scalars); default: the parameters
        without a default value. They are ``schema.args`` in this order.
    static_params : sequence of str
        Non-tensor parameters whose value changes the sharding decision (a ``dim``); they
        are in ``schema.static`` and in the cache key. Other parameters (an ``eps``) are
        passed through and never cause a cache miss.

    Returns
    -------
    callable
        The op: on local tensors it calls ``kernel``; with a DTensor among its arguments it
        dispatches (**Collective** when an input must be redistributed).

    Raises
    ------
    ArgumentError
        ``name`` is already an op, or a named parameter is not one of the kernel's (a
        ValueError).
    DTypeError
        ``kernel`` has variadic parameters (a TypeError).
    """
    if name in OPS:
        raise ArgumentError(f"register_op: {name!r} is already an op; choose another name")
    params = inspect.signature(kernel).parameters
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params.values()):
        raise DTypeError(f"register_op({name!r}): the kernel may not take *args or **kwargs")
    names = tuple(params)
    if tensor_params is None:
        tensor_params = tuple(k for k, p in params.items() if p.default is p.empty)
    for group, given in (("tensor_params", tensor_params), ("static_params", static_params)):
        unknown = [p for p in given if p not in names]
        if unknown:
            raise ArgumentError(
                f"register_op({name!r}): {group} {unknown} are not parameters of the kernel {names}"
            )
    info = declare(name, kernel, tuple(tensor_params), rule=rule, static=tuple(static_params),
                   method=False)

    def op(*args: object, **kwargs: object) -> object:
        if has_dtensor(args, kwargs):
            return dispatch(info, args, kwargs)
        return kernel(*args, **kwargs)

    op.__name__ = op.__qualname__ = name
    op.__doc__ = (kernel.__doc__ or "") + (
        f"\n\nRegistered op {name!r}: accepts DTensors (**Collective** when an input must be "
        "redistributed for the chosen strategy, **Local** otherwise)."
    )
    return op
