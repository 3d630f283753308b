"""Activation checkpointing: :func:`checkpoint` (PyTorch's ``torch.utils.checkpoint.checkpoint``;
the module wrapper is :func:`dtensor.nn.checkpoint_wrapper`).

A checkpointed call runs its function with grad mode off, so none of its intermediates is
kept: its node (``CheckpointBackward0``) holds the function and its arguments only. Its
backward runs the function again on the same inputs (detached, requiring grad as they did),
with recording on and the random generator at the state the first run started from
(``preserve_rng_state``: dropout draws the same masks), backpropagates through that
recomputed graph and hands the inputs' gradients on. The leaves the function read
(parameters) are found in that recomputation: they become edges of the node there, so that
``backward()`` accumulates into their ``.grad`` and ``dt.autograd.grad(loss, params)``
returns their gradients. Nested checkpoints recompute the inner one inside the outer one's
recomputation.

Choices (PyTorch's non-reentrant checkpoint finds them by recording the first run):

- the floating tensor outputs require grad whenever grad mode is on and autograd is active
  (the first run records nothing, so which leaves the function reads is known only when it
  is recomputed): with ``use_reentrant=True``, as in PyTorch, only when a tensor argument
  requires grad;
- tensors reach the function as arguments (also inside a list or tuple argument, or as
  keyword arguments) or as leaves; a non-leaf tensor that requires grad and that the function
  reads from outside (a closure) gets its gradient as with PyTorch's reentrant checkpoint, by
  a backward of its own history inside the recomputation: pass such tensors as arguments;
- an in-place change of an argument between the call and the backward raises (the
  recomputation would see other values), as for any saved tensor.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

from placements.errors import SignatureError

from ..distributed.dtensor import DTensor
from ..local import grad_engine as _ag
from ..local.grad_engine import enable_grad, no_grad
from ..local.rng import get_rng_state, set_rng_state
from ..local.tensor import Tensor

__all__ = ["checkpoint"]


def _map(args: tuple, kwargs: Mapping[str, Any], fn: Callable) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with every tensor ``t`` among them (also inside a list or a
    tuple) replaced by ``fn(t)``, in order."""

    def one(v: Any) -> Any:
        if isinstance(v, (Tensor, DTensor)):
            return fn(v)
        if type(v) in (list, tuple):
            return type(v)(fn(e) if isinstance(e, (Tensor, DTensor)) else e for e in v)
        return v

    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}


def checkpoint(function: Callable, *args: Any, use_reentrant: bool = False,
               preserve_rng_state: bool = True, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` without keeping its intermediates for backward: they
    are recomputed in backward (PyTorch's ``torch.utils.checkpoint.checkpoint``).

    **Local**, unless ``function`` communicates (then **Collective**, in forward and again
    in backward: every rank recomputes).

    Parameters
    ----------
    function : callable
        Returns a tensor, or a tuple or list of values (its floating tensors get
        gradients). It must compute the same thing when called again.
    *args, **kwargs
        Its arguments; keyword arguments only with ``use_reentrant=False``.
    use_reentrant : bool
        PyTorch's reentrant variant's rule for the outputs: they require grad only when a
        tensor argument does (with a warning otherwise). Both variants run the same way
        here (see the module notes).
    preserve_rng_state : bool
        Recompute with the random state of the first run (the same dropout masks).

    Raises
    ------
    SignatureError
        Keyword arguments with ``use_reentrant=True``.
    AutogradError
        In backward: an argument changed in place since the call.
    """
    if use_reentrant and kwargs:
        raise SignatureError(
            "checkpoint: Unexpected keyword arguments: " + ",".join(kwargs)
            + " (only with use_reentrant=False)"
        )
    if not (_ag.is_grad_enabled() and _ag.is_active()):
        return function(*args, **kwargs)
    inputs: list = []
    _map(args, kwargs, lambda t: inputs.append(t) or t)
    if use_reentrant and not any(t.requires_grad for t in inputs):
        warnings.warn("None of the inputs have requires_grad=True. Gradients will be None",
                      stacklevel=2)
        with no_grad():
            return function(*args, **kwargs)
    state = get_rng_state() if preserve_rng_state else None
    with no_grad():
        out = function(*args, **kwargs)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    given = {id(t) for t in inputs}
    # an output that is an input or has a history (a leaf returned): a new handle on it,
    # so that the tensor keeps its own
    results = [o.detach() if isinstance(o, (Tensor, DTensor)) and (
        id(o) in given or o._ag is not None) else o for o in outs]
    graph = [o if isinstance(o, (Tensor, DTensor)) else None for o in results]
    if all(o is None for o in graph):
        return out
    saved = [_ag.save(t, "checkpointed input") for t in inputs]
    _ag.record("checkpoint", _recompute, tuple(_ag.edge_of(t) for t in inputs), graph,
               (function, args, kwargs, state, inputs), saved=saved)
    if isinstance(out, (tuple, list)):
        return list(results) if type(out) is list else tuple(results)
    return results[0]


def _detached(t: Tensor | DTensor) -> Tensor | DTensor:
    """A new leaf on ``t``'s data, requiring grad as ``t`` does."""
    d = t.detach()
    return d.requires_grad_() if t.requires_grad else d


def _recompute(node: _ag.Node, grads: list) -> list:
    """The formula of a checkpoint's node: run the function again (recording, with the
    first run's random state) and backpropagate through it; the gradients of the inputs,
    then of the leaves it read, which become the node's further edges."""
    function, args, kwargs, state, inputs = node.ctx
    detached = [_detached(t) for t in inputs]
    it = iter(detached)
    args, kwargs = _map(args, kwargs, lambda t: next(it))
    with enable_grad():
        if state is None:
            out = function(*args, **kwargs)
        else:
            now = get_rng_state()
            set_rng_state(state)
            try:
                out = function(*args, **kwargs)
            finally:
                set_rng_state(now)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    roots, seeds = [], []
    for o, g in zip(outs, grads):
        if g is not None and isinstance(o, (Tensor, DTensor)) and o.requires_grad:
            roots.append(o)
            seeds.append(g)
    found: dict = {}
    if roots:  # (the graph of the recomputation goes with this call: no need to free it)
        _ag.run_backward(roots, seeds, True, op="checkpoint",
                         create_graph=_ag.is_grad_enabled(), leaves=found)
    res = []
    for d in detached:
        hit = found.pop(id(d._ag), None) if d._ag is not None else None
        res.append(None if hit is None else hit[1])
    n = len(inputs)
    node.edges = (*node.edges[:n], *(meta for meta, _ in found.values()))
    return res + [g for _, g in found.values()]
