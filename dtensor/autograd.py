"""``dt.autograd``: reverse-mode automatic differentiation (PyTorch's names and semantics).

The engine is :mod:`dtensor.local.grad_engine`; the backward formulas are in the op records
(``backward=`` in the family modules of :mod:`dtensor.ops`). Tensors and DTensors have ``requires_grad``,
``requires_grad_()``, ``grad``, ``grad_fn``, ``is_leaf`` and ``backward()``; factories
take ``requires_grad=``.

Choices where PyTorch has no DTensor answer (or a different one):

- a DTensor leaf's ``.grad`` is laid out like the leaf (the gradient is redistributed to
  the leaf's placements; a Partial placement becomes Replicate), so that an update
  ``p -= lr * p.grad`` needs no communication;
- the gradient of ``redistribute`` goes back to the input's placements (Partial as
  Replicate); ``to_local(grad_placements=)`` and ``from_local(..., grad_placements=)`` say
  how a local gradient is laid out;
- ``create_graph=True`` (``backward`` and ``grad``) runs the formulas as recorded ops, so
  gradients can be differentiated again (higher-order gradients; a gradient penalty
  ``g = grad(loss, x, create_graph=True); (g * g).sum().backward()``), on Tensors and
  DTensors alike (every formula is written with table ops). Not twice-differentiable: the
  value an in-place op reads of its own input (saved as a copy without history).
- ``getitem`` differentiates basic and advanced indices on Tensors and DTensors; an index
  with several integer arrays that names one element twice is refused (one array along
  one dim, as ``x[[0, 2, 0]]``, is not).

As in PyTorch, a node keeps only what its formula reads (declared with the formula), so a
training step's activations are freed as soon as the program and the graph let them go.

Custom functions: a subclass of :class:`Function` with static ``forward(ctx, *args)`` and
``backward(ctx, *grad_outputs)`` (or ``forward(*args)`` and ``setup_context(ctx, inputs,
output)``), called as ``Exp.apply(x)``, as PyTorch's ``torch.autograd.Function``. On
DTensors the user's ``backward`` returns DTensors (any placements: a leaf's gradient is
then laid out as the leaf, as for every gradient). Not supported: ``ctx.mark_dirty``
(in-place forwards), forward-mode (``jvp``) and ``vmap``. Activation checkpointing is
:func:`dtensor.utils.checkpoint`.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable

from placements.errors import AutogradError, SignatureError
from placements.meta import dtype_kind

from .dispatch.tape import sum_to
from .distributed.dtensor import DTensor
from .distributed.factory import FACTORIES
from .local import grad_engine as _ag
from .local.grad_engine import (
    backward,
    enable_grad,
    grad,
    is_grad_enabled,
    no_grad,
    set_grad_enabled,
)
from .local.tensor import Tensor

__all__ = [
    "Function",
    "FunctionCtx",
    "backward",
    "enable_grad",
    "grad",
    "is_grad_enabled",
    "no_grad",
    "once_differentiable",
    "set_grad_enabled",
]


def _kind(x: object) -> type | None:
    """DTensor or Tensor for a tensor (a DTensor first: its subclasses are DTensors), else
    None."""
    if isinstance(x, DTensor):
        return DTensor
    return Tensor if isinstance(x, Tensor) else None


class FunctionCtx:
    """The ``ctx`` a custom :class:`Function`'s ``forward`` and ``backward`` receive
    (PyTorch's ``torch.autograd.function.FunctionCtx``). **Local**.

    It holds whatever attributes ``forward`` sets on it, plus ``needs_input_grad`` (one
    bool per ``forward`` input: whether its gradient is needed) and ``materialize_grads``.
    """

    def __init__(self) -> None:
        self.needs_input_grad: tuple[bool, ...] = ()
        self.materialize_grads = True
        self.to_save: tuple = ()
        self.non_differentiable: tuple = ()
        self._saved: list | None = None  # (tensor, output index or -1), once recorded
        self._node: weakref.ref | None = None

    def save_for_backward(self, *tensors: object) -> None:
        """Keep ``tensors`` (or None) for ``backward`` (``ctx.saved_tensors``): an in-place
        change of one of them before ``backward`` makes ``backward`` raise. **Local**.
        Call it at most once, in ``forward`` (or ``setup_context``).

        Raises
        ------
        SignatureError
            An argument that is neither a tensor nor None.
        """
        for i, t in enumerate(tensors):
            if t is not None and _kind(t) is None:
                raise SignatureError(
                    f"save_for_backward can only save variables, but argument {i} is of type "
                    f"{type(t).__name__}"
                )
        self.to_save = tensors

    @property
    def saved_tensors(self) -> tuple:
        """The tensors given to :meth:`save_for_backward`, in ``backward``. A saved output
        of ``forward`` has its history again while ``backward`` records
        (``create_graph=True``). **Local**.

        Raises
        ------
        AutogradError
            After a backward pass freed them (without ``retain_graph=True``).
        """
        if self._saved is None:
            return self.to_save
        node = self._node()
        if node is None or node.released:
            raise AutogradError(
                "Trying to backward through the graph a second time (or directly access saved "
                "tensors after they have already been freed). Saved intermediate values of the "
                "graph are freed when you call .backward() or autograd.grad(). Specify "
                "retain_graph=True if you need to backward through the graph a second time or "
                "if you need to access saved tensors after calling backward."
            )
        if not is_grad_enabled():
            return tuple(t for t, _ in self._saved)
        out = []
        for t, nr in self._saved:
            if nr >= 0:  # an output: with this node's history, for the recorded backward
                t = t.detach()
                t._ag = _ag.AutogradMeta(True, node, nr)
            out.append(t)
        return tuple(out)

    def mark_non_differentiable(self, *args: object) -> None:
        """Mark outputs of ``forward`` as not differentiable: they do not require grad, and
        their gradient in ``backward`` is zeros (or None without materialization).
        **Local**."""
        self.non_differentiable = args

    def set_materialize_grads(self, value: bool) -> None:
        """Whether ``backward`` gets zeros (True, the default) or None for the gradients of
        outputs that received none. **Local**."""
        self.materialize_grads = bool(value)


class Function:
    """Base of custom differentiable functions (PyTorch's ``torch.autograd.Function``).

    Subclass it with static methods ``forward(ctx, *args, **kwargs)`` and ``backward(ctx,
    *grad_outputs)``, and call ``MyFunction.apply(*args)``; ``forward`` may instead take
    the inputs alone, with ``setup_context(ctx, inputs, output)`` filling ``ctx``.
    ``forward`` runs with grad mode off; its floating tensor outputs (a tensor or a tuple)
    get one node whose backward calls ``backward`` with one gradient per output, which
    returns one gradient per ``forward`` input (None for a non-tensor or where no gradient
    is needed; more trailing Nones are allowed). A gradient of another shape that the
    input's shape broadcasts to is summed down to it, and one of another dtype is cast.
    Tensors and DTensors alike: a DTensor input's gradient is the DTensor ``backward``
    returns.

    Example
    -------
    >>> class Exp(dt.autograd.Function):
    ...     @staticmethod
    ...     def forward(ctx, x):
    ...         y = x.exp()
    ...         ctx.save_for_backward(y)
    ...         return y
    ...     @staticmethod
    ...     def backward(ctx, g):
    ...         (y,) = ctx.saved_tensors
    ...         return g * y
    >>> Exp.apply(x).sum().backward()
    """

    @staticmethod
    def forward(ctx: FunctionCtx, *args: object, **kwargs: object) -> object:
        """The computation (grad mode off). To be overridden."""
        raise NotImplementedError(
            "You must implement the forward function for custom autograd.Function."
        )

    @staticmethod
    def setup_context(ctx: FunctionCtx, inputs: tuple, output: object) -> object:
        """Fill ``ctx`` from the inputs and the output of a ``forward`` without ``ctx``.
        Optional."""
        raise NotImplementedError("setup_context is not implemented.")

    @staticmethod
    def backward(ctx: FunctionCtx, *grad_outputs: object) -> object:
        """The gradients of the inputs from those of the outputs. To be overridden."""
        raise NotImplementedError(
            "You must implement either the backward or vjp method for your custom "
            "autograd.Function to use it with backward mode AD."
        )

    @classmethod
    def apply(cls, *args: object, **kwargs: object) -> object:
        """Run ``forward`` on ``args`` and record its node when an input requires grad
        (and grad mode is on). **Local**, unless ``forward`` or ``backward`` communicate
        (then **Collective**, as the ops they run).

        Keyword arguments are bound to ``forward``'s parameters (defaults filled in), which
        then all count as inputs (one gradient each).
        """
        separate = cls.setup_context is not Function.setup_context
        if kwargs or separate:
            sig = inspect.signature(cls.forward)
            bound = sig.bind(*args, **kwargs) if separate else sig.bind(None, *args, **kwargs)
            bound.apply_defaults()
            args = bound.args if separate else bound.args[1:]
        ctx = FunctionCtx()
        edges = tuple(_ag.edge_of(a) for a in args)
        recording = is_grad_enabled() and any(e is not None for e in edges)
        ctx.needs_input_grad = tuple(recording and e is not None for e in edges)
        with no_grad():
            if separate:
                out = cls.forward(*args)
                cls.setup_context(ctx, args, out)
            else:
                out = cls.forward(ctx, *args)
        if not recording:
            return out
        return _record(cls, ctx, args, edges, out)


def _record(cls: type, ctx: FunctionCtx, args: tuple, edges: tuple, out: object) -> object:
    """The outputs of ``cls.apply`` once its node is made (an output that is an input, or a
    tensor with a history such as a leaf, becomes a new handle on it, so that the tensor
    keeps its own)."""
    outs = out if isinstance(out, tuple) else (out,)
    inputs = {id(a) for a in args if _kind(a) is not None}
    plain = {id(t) for t in ctx.non_differentiable}
    results = list(outs)
    graph = []
    layouts = []
    for i, o in enumerate(outs):
        if _kind(o) is None:
            graph.append(None)
            layouts.append(None)
            continue
        if id(o) in inputs or o._ag is not None:  # an input, or a tensor with a history
            o = results[i] = o.detach()
        layouts.append(_layout(o))
        graph.append(None if id(outs[i]) in plain or dtype_kind(o.dtype) not in "fc" else o)
    if all(o is None for o in graph):
        return out
    saved = []
    entries = []
    where = {id(o): i for i, o in enumerate(outs)}
    for j, t in enumerate(ctx.to_save):
        nr = -1 if t is None or id(t) in inputs else where.get(id(t), -1)
        if nr >= 0:  # an output, without its history (no cycle through the node); it
            t = results[nr].detach()  # gets it back in a recorded backward (when it has one)
            nr = -1 if graph[nr] is None else nr
        saved.append((t, nr))
        if t is not None:
            entries.append(_ag.save(t, f"saved tensor {j}"))
    metas = tuple(None if _kind(a) is None else (_kind(a), tuple(a.shape), a.dtype)
                  for a in args)
    node = _ag.record(cls.__name__, _function_backward, edges, graph,
                      (cls, ctx, tuple(layouts), metas), saved=entries,
                      node_type=_ag.FunctionNode)
    ctx._saved = saved
    ctx._node = weakref.ref(node)
    return tuple(results) if isinstance(out, tuple) else results[0]


def _layout(o: object) -> tuple:
    """``(shape, factory keywords)`` of zeros laid out as the tensor ``o``."""
    if isinstance(o, DTensor):
        return tuple(o.shape), {"dtype": o.dtype, "device_mesh": o.device_mesh,
                                "placements": o.placements}
    return tuple(o.shape), {"dtype": o.dtype, "device": o.device}


def _function_backward(node: _ag.Node, grads: list) -> list:
    """The formula of a :class:`Function`'s node: the user's ``backward``, its result
    checked and fitted to the inputs."""
    cls, ctx, layouts, metas = node.ctx
    if ctx.materialize_grads:
        grads = [FACTORIES["zeros"](lay[0], **lay[1]) if g is None and lay is not None else g
                 for g, lay in zip(grads, layouts)]
    res = cls.backward(ctx, *grads)
    res = res if isinstance(res, tuple) else (res,)
    n = len(metas)
    name = node.name()
    if len(res) > n and all(r is None for r in res[n:]):
        res = res[:n]
    if len(res) != n:
        raise AutogradError(
            f"function {name} returned an incorrect number of gradients (expected {n}, "
            f"got {len(res)})"
        )
    return [_fitted(name, i, r, m, e) for i, (r, m, e) in enumerate(zip(res, metas, node.edges))]


def _fitted(name: str, i: int, r: object, meta: tuple | None, edge: object) -> object:
    """The gradient ``r`` the user's backward returned for input ``i`` (``meta``: its kind,
    shape and dtype; None for a non-tensor), checked and fitted to the input."""
    if r is None:
        return None
    if meta is None:
        raise AutogradError(
            f"function {name} returned a gradient different than None at position {i + 1}, "
            "but the corresponding forward input was not a Variable"
        )
    if edge is None:
        return None
    kind, shape, dtype = meta
    if _kind(r) is not kind:
        raise AutogradError(
            f"function {name} returned a {type(r).__name__} gradient at index {i} for a "
            f"{kind.__name__} input"
        )
    got = tuple(r.shape)
    if got != shape:
        lead = len(got) - len(shape)
        if lead < 0 or any(s not in (1, d) for s, d in zip(shape, got[lead:])):
            raise AutogradError(
                f"Function {name} returned an invalid gradient at index {i} - got {list(got)} "
                f"but expected shape compatible with {list(shape)}"
            )
        r = sum_to(r, shape)
    return r if r.dtype == dtype else r.to(dtype)


def once_differentiable(fn: Callable) -> Callable:
    """Decorate a :class:`Function`'s ``backward`` that is not differentiable itself: it runs
    with grad mode off, and a backward through its result (``create_graph=True``, then a
    second backward) raises. **Local**."""

    @functools.wraps(fn)
    def wrapper(ctx: FunctionCtx, *args: object) -> object:
        with no_grad():
            outputs = fn(ctx, *args)
        edges = [e for e in map(_ag.edge_of, args) if e is not None]
        if not is_grad_enabled() or not edges:
            return outputs
        outs = outputs if isinstance(outputs, tuple) else (outputs,)
        given = {id(a) for a in args}
        results = [o.detach() if id(o) in given and _kind(o) is not None else o for o in outs]
        _ag.record("DelayedError", _delayed_error, edges,
                   [r if _kind(r) is not None else None for r in results])
        return tuple(results) if isinstance(outputs, tuple) else results[0]

    return wrapper


def _delayed_error(node: _ag.Node, grads: list) -> list:
    raise AutogradError(
        "trying to differentiate twice a function that was marked with @once_differentiable"
    )
