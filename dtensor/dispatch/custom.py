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
from placements.rules import OpSchema, RuleResult, register_rule

from ..ops import OPS, OpInfo, declare
from .dispatcher import clear_caches
from .entry_points import function

__all__ = ["register_op"]


def register_op(
    name: str,
    kernel: Callable[..., object] | None,
    rule: Callable[[OpSchema], RuleResult],
    *,
    tensor_params: Sequence[str] | None = None,
    static_params: Sequence[str] = (),
    replace: bool = False,
) -> Callable[..., object]:
    """Register ``kernel`` as op ``name`` with sharding rule ``rule``, or, with
    ``replace=True``, give an existing op (a built-in one too) the sharding rule ``rule``.
    **Local**.

    Call it the same way on every rank (at import time of the user's module). Replacing a
    rule clears every cached sharding decision (:func:`dtensor.clear_caches`); the op's
    kernel, signature and static parameters stay, and its in-place form ``name_`` (an op
    of its own) keeps its rule. To restore a built-in rule, keep
    ``placements.rules.get_rule(name)`` and register it back the same way.

    Parameters
    ----------
    name : str
        The op's name: its propagation-cache id and the name in messages. Must be new,
        unless ``replace`` is True.
    kernel : callable or None
        The local computation, called with local ``dt.Tensor`` objects in place of
        DTensors (python scalars passed through). Its positional parameters (no ``*args``
        or ``**kwargs``) define the op's signature and defaults. None when replacing the
        rule of an existing op (its kernel stays).
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
    replace : bool
        Replace the sharding rule of the existing op ``name``: ``rule`` then reads the
        op's own static parameters (``tensor_params`` and ``static_params`` must be left
        out).

    Returns
    -------
    callable
        The op: on local tensors it calls ``kernel``; with a DTensor among its arguments it
        dispatches (**Collective** when an input must be redistributed).

    Raises
    ------
    ArgumentError
        ``name`` is already an op (without ``replace``), ``replace`` names no op or comes
        with a kernel or parameters, or a named parameter is not one of the kernel's (a
        ValueError).
    DTypeError
        ``kernel`` has variadic parameters (a TypeError).
    """
    if replace:
        return _replace_rule(name, kernel, rule, tensor_params, static_params)
    if name in OPS:
        raise ArgumentError(
            f"register_op: {name!r} is already an op; choose another name (or pass "
            "replace=True to give it a new sharding rule)"
        )
    if kernel is None:
        raise ArgumentError(f"register_op({name!r}): a new op needs a kernel")
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
    return _dispatching(name, info, kernel)


def _dispatching(name: str, info: OpInfo, local: Callable) -> Callable[..., object]:
    """The public function of a registered op (the table's entry point, see
    :func:`dtensor.dispatch.entry_points.function`): ``local`` on local tensors, the
    dispatcher when a DTensor is among the arguments."""
    op = function(info, local)
    op.__name__ = op.__qualname__ = name
    op.__doc__ = (local.__doc__ or "") + (
        f"\n\nRegistered op {name!r}: accepts DTensors (**Collective** when an input must be "
        "redistributed for the chosen strategy, **Local** otherwise)."
    )
    return op


def _replace_rule(
    name: str,
    kernel: Callable | None,
    rule: Callable[[OpSchema], RuleResult],
    tensor_params: Sequence[str] | None,
    static_params: Sequence[str],
) -> Callable[..., object]:
    """``register_op(name, None, rule, replace=True)``: the op's new rule."""
    info = OPS.get(name)
    if info is None:
        raise ArgumentError(f"register_op({name!r}, replace=True): there is no op {name!r}")
    if kernel is not None or tensor_params is not None or tuple(static_params):
        raise ArgumentError(
            f"register_op({name!r}, replace=True) replaces the sharding rule only: pass "
            f"kernel=None and no tensor_params/static_params (the op keeps its kernel, "
            f"tensors {info.tensor_params} and statics {info.static_params})"
        )
    register_rule(name, static=info.static_params)(rule)
    clear_caches()
    return _dispatching(name, info, info.function or info.kernel)
