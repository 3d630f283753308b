"""Recording of table ops for autograd: the variants that record backward nodes.

Once autograd is active (the first tensor that requires grad), every variant of an op
reaches the recorder: the public functions and the compiled front's FastOps (DTensor
methods, operators and slots on the fast path) through their hook, :func:`call`; Tensor's
methods and operators, and DTensor's on the Python path, through their recording form,
:func:`recording` (a compiled guard, or its Python twin). When grad mode is on and a tensor
argument requires grad, :func:`record` runs the op with grad mode off and makes its node
(:mod:`dtensor.local.autograd`) from the op record's formula
(:class:`dtensor.ops.table.Backward`); otherwise the variant runs as it is. In-place
variants also bump the version counter of what they write, and refuse a leaf that requires
grad.

Until autograd is active nothing here runs: :mod:`dtensor.dispatch.install` installs the
recording forms and the hook only then. After, the no-grad path pays one check per call (a
pointer test per argument in compiled code). A call that records falls back from the
compiled front to this Python recorder, which runs the op through the front with grad mode
off.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

import fastpath as _fp
from placements.errors import AutogradError

from ..distributed.dtensor import DTensor, _PendingDTensor, record_redistribute
from ..local import autograd as _ag
from ..local.rng import get_rng_state
from ..local.tensor import Tensor, _wrap
from ..ops import OpInfo
from .dispatcher import binder_of

__all__ = [
    "call",
    "record",
    "recording",
    "recording_redistribute",
    "recording_setitem",
    "recording_view_property",
    "sum_to",
]

_MODE = _ag.MODE


def _wants_grad(args: Sequence[object], kwargs: Mapping[str, object] | None) -> bool:
    """Whether a tensor among the arguments (also inside list/tuple arguments) requires
    grad."""
    for a in args:
        t = type(a)
        if t is Tensor or t is DTensor or t is _PendingDTensor:
            m = a._ag
            if m is not None and m.requires_grad:
                return True
        elif t is list or t is tuple:
            for e in a:
                te = type(e)
                if te is Tensor or te is DTensor or te is _PendingDTensor:
                    m = e._ag
                    if m is not None and m.requires_grad:
                        return True
    if kwargs:
        return _wants_grad(tuple(kwargs.values()), None)
    return False


def call(info: OpInfo, plain: Callable, args: tuple, kwargs: Mapping[str, object]) -> object:
    """Run ``plain(*args, **kwargs)`` (a variant of ``info`` with the op's argument order),
    recording it when it must (the public functions' hook once autograd is active)."""
    if _MODE.enabled and _wants_grad(args, kwargs):
        return record(info, plain, args, kwargs, None)
    out = plain(*args, **kwargs)
    if info.inplace:
        _ag.bump_version(args[0])
    return out


def _guarded(info: OpInfo, plain: Callable, args: tuple, kwargs: Mapping[str, object],
             order: tuple[int, ...] | None) -> object:
    """What a recording variant runs when its cheap check says it may record (or for an
    in-place op): :func:`record`, or ``plain`` (counting an in-place write)."""
    if _MODE.enabled and _wants_grad(args, kwargs):
        return record(info, plain, args, kwargs, order)
    out = plain(*args, **kwargs)
    if info.inplace:
        _ag.bump_version(args[0])
    return out


def recording(info: OpInfo, plain: Callable, order: tuple[int, ...] | None = None,
              compiled: bool = True) -> Callable:
    """The recording form of a method or operator ``plain`` of ``info`` (its arguments are
    the op's, reordered by ``order``: ``order[i]`` is where the op's argument ``i`` is):
    the compiled guard when the extension is used and ``compiled``, else its Python twin
    (DTensor's Python path stays Python)."""
    if compiled and _fp.ENABLED:
        variant = _fp.dispatch.make_recording(info, plain, order, _guarded)
    else:
        mode = _MODE
        inplace = info.inplace

        def variant(*args, **kwargs):
            if inplace or (mode.enabled and _wants_grad(args, kwargs)):
                return _guarded(info, plain, args, kwargs, order)
            return plain(*args, **kwargs)

    variant.__name__ = getattr(plain, "__name__", info.name)
    variant.__qualname__ = getattr(plain, "__qualname__", info.name)
    variant.__doc__ = getattr(plain, "__doc__", None)
    return variant


def recording_redistribute(plain: Callable) -> Callable:
    """The recording form of ``DTensor.redistribute`` (its backward moves the gradient back
    to the input's placements)."""
    mode = _MODE

    def redistribute(self, device_mesh=None, placements=None, *, async_op=False):
        out = plain(self, device_mesh, placements, async_op=async_op)
        if out is not self and mode.enabled:
            m = self._ag
            if m is not None and m.requires_grad:
                record_redistribute(self, out)
        return out

    redistribute.__doc__ = plain.__doc__
    return redistribute


def recording_view_property(plain: property, recorded: Callable) -> property:
    """The recording form of a view property of Tensor (``T``, ``mT``): ``recorded(x)``
    (the same view through recorded ops) when it must record, else the property's own."""
    mode = _MODE
    get = plain.fget

    def view(self):
        m = self._ag
        if m is not None and mode.enabled and m.requires_grad:
            return recorded(self)
        return get(self)

    return property(view, doc=plain.__doc__)


def recording_setitem(plain: Callable) -> Callable:
    """The recording form of ``Tensor.__setitem__`` (``x[idx] = value``, an in-place write:
    the gradient of the old ``x`` is zero at ``idx``, ``value``'s is the gradient there)."""
    mode = _MODE

    def __setitem__(self, idx, value) -> None:
        if mode.enabled and _wants_grad((self, value), None):
            m = self._ag
            if m is not None and m.requires_grad and m.grad_fn is None:
                raise AutogradError(
                    "__setitem__: a leaf Variable that requires grad is being used in an "
                    "in-place operation."
                )
            edges = [_ag.edge_of(self), _ag.edge_of(value)]
            vmeta = (tuple(value.shape), value.dtype) if _is_tensor(value) else None
            _unrecorded(plain, (self, idx, value), {})
            _ag.bump_version(self)
            _ag.record("setitem", _setitem_backward, edges, (self,), (idx, vmeta))
            return
        plain(self, idx, value)
        _ag.bump_version(self)

    __setitem__.__doc__ = plain.__doc__
    return __setitem__


def _setitem_backward(node: _ag.Node, grads: list) -> list:
    idx, vmeta = node.ctx
    g = grads[0]
    rest = g.clone()
    rest[idx] = 0
    if vmeta is None:
        return [rest, None]
    gv = g[idx]
    shape, dtype = vmeta
    gv = sum_to(gv, shape) if tuple(gv.shape) != shape else gv
    return [rest, gv if gv.dtype == dtype else gv.to(dtype)]


def _slots(binder, values: list) -> list:
    """The tensor-like arguments, a variadic parameter's one by one."""
    vi = binder.variadic_idx
    out = []
    for pi in binder.tensor_idx:
        if pi == vi:
            out.extend(values[pi])
        else:
            out.append(values[pi])
    return out


def _is_tensor(v: object) -> bool:
    t = type(v)
    return t is Tensor or t is DTensor or t is _PendingDTensor


def _detached(t: object) -> object:
    """A new handle on ``t``'s data without autograd state (what a node saves of its own
    output: no reference cycle through the output's grad_fn)."""
    if isinstance(t, DTensor):  # a pending one (async redistribute) waits here
        return DTensor._make(t._local, t._spec)
    return _wrap(t._arr, t._storage)


#: Stand-ins by layout (see :func:`_stand_in`): ``(shape, dtype)`` of a Tensor, a DTensor's spec.
_STAND_INS: dict = {}
_STAND_INS_MAX = 1024


def _stand_in(v: object) -> object:
    """What a node keeps of a float tensor argument its formula does not read: a tensor of
    ``v``'s shape and dtype (a DTensor: of its spec) over one zero (a read-only, zero-stride
    array), so that the formula can still ask for its layout and build zeros like it while
    ``v``'s memory goes when the program drops ``v``. Arrays off the host are kept as
    they are."""
    if type(v) is Tensor:
        arr = v._arr
        if type(arr) is not np.ndarray:
            return v
        key = (arr.shape, arr.dtype)
        s = _STAND_INS.get(key)
        if s is not None:
            return s
        s = _wrap(np.broadcast_to(np.zeros((), arr.dtype), arr.shape), None)
    else:
        key = v._spec
        s = _STAND_INS.get(key)
        if s is not None:
            return s
        local = _stand_in(v._local)  # (a pending DTensor waits here, as its op did)
        if local is v._local:
            return v
        s = DTensor._make(local, key)
    if len(_STAND_INS) >= _STAND_INS_MAX:
        _STAND_INS.clear()
    _STAND_INS[key] = s
    return s


def _unread(v: object) -> object:
    """``v``, or its stand-in when it is a float tensor (integer and bool tensors, the
    indices and masks that formulas read, are kept)."""
    t = type(v)
    if t is Tensor:
        return _stand_in(v) if v._arr.dtype.kind in "fc" else v
    if t is DTensor or t is _PendingDTensor:
        return _stand_in(v) if v._spec.dtype.kind in "fc" else v
    return v


def _unread_positions(info: OpInfo, binder) -> tuple[int, ...]:
    """The positions of ``info``'s tensor parameters that its formula does not read (not
    in ``backward.save``)."""
    save = info.backward.save
    return tuple(pi for pi, p in zip(binder.tensor_idx, info.tensor_params) if p not in save)


_UNREAD: dict = {}


def _unrecorded(plain: Callable, args: tuple, kwargs: Mapping[str, object]) -> object:
    """``plain(*args, **kwargs)`` with grad mode off (it was on: the call records)."""
    mode = _MODE
    mode.enabled = False
    try:
        return plain(*args, **kwargs)
    finally:
        mode.enabled = True


def record(info: OpInfo, plain: Callable, args: tuple, kwargs: Mapping[str, object],
           order: tuple[int, ...] | None) -> object:
    """Run one call of ``info`` with recording off and make its backward node. **Collective**
    when the op is (a DTensor op that redistributes)."""
    name = info.name
    binder = binder_of(info)
    values = binder.bind(args if order is None else [args[i] for i in order], kwargs)
    bw = info.backward  # an in-place op's is its out-of-place op's (see ops.table.declare)
    self = values[0] if info.inplace else None
    if self is not None:
        m = self._ag
        if m is not None and m.requires_grad and m.grad_fn is None:
            raise AutogradError(
                f"{name}: a leaf Variable that requires grad is being used in an in-place "
                "operation."
            )
    if bw is None:
        raise AutogradError(
            f"{name}: the derivative for '{name}' is not implemented (an input requires grad)"
        )
    if bw.fn is None:
        if self is not None and self._ag is not None:
            raise AutogradError(f"{name}: the in-place op is not differentiable")
        out = _unrecorded(plain, args, kwargs)
        if self is not None:
            _ag.bump_version(self)
        return out
    slots = ([values[pi] for pi in binder.tensor_idx] if binder.variadic_idx < 0
             else _slots(binder, values))
    edges = []
    for v in slots:
        t = type(v)
        m = v._ag if t is Tensor or t is DTensor or t is _PendingDTensor else None
        edges.append(m if m is not None and m.requires_grad else None)
    saved = []
    if bw.save:
        if self is not None and "input" in bw.save:
            # the formula reads the value before the op
            values[0] = _unrecorded(_detached(self).clone, (), {})
        for pname in bw.save:
            pi = binder.index[pname]
            for v in (values[pi] if pi == binder.variadic_idx else (values[pi],)):
                if _is_tensor(v):
                    saved.append(_ag.save(v, pname))
    state = get_rng_state() if bw.rng else None
    mode = _MODE
    mode.enabled = False  # (_unrecorded, inline: this is the recording hot path)
    try:
        out = plain(*args, **kwargs)
    finally:
        mode.enabled = True
    if self is not None:
        _ag.bump_version(self)
        outputs = (self,)
    elif _is_tensor(out):
        for v in slots:
            if v is out:  # the op returned its input (contiguous() of a contiguous tensor)
                return out
        outputs = (out,)
    else:
        outputs = tuple(out)
    saved_out = state
    if bw.out:
        saved_out = _detached(outputs[0])
        saved.append(_ag.save(saved_out, "result"))
    # the node keeps what the formula reads: the others as stand-ins of their layout
    unread = _UNREAD.get(info)
    if unread is None:
        unread = _UNREAD[info] = _unread_positions(info, binder)
    if unread:
        vi = binder.variadic_idx
        for pi in unread:
            v = values[pi]
            values[pi] = [_unread(e) for e in v] if pi == vi else _unread(v)
        slots = ([values[pi] for pi in binder.tensor_idx] if vi < 0
                 else _slots(binder, values))
    _ag.record(name, _apply, edges, outputs, (bw, values, slots), saved_out, saved)
    return out


def _apply(node: _ag.Node, grads: list) -> list:
    bw, values, slots = node.ctx
    need = [e is not None for e in node.edges]
    res = bw.fn(grads if bw.multi else grads[0], values, node.out, need)
    out = []
    for r, v, n in zip(res, slots, need):
        if r is None or not n:
            out.append(None)
            continue
        if tuple(r.shape) != tuple(v.shape):
            r = sum_to(r, tuple(v.shape))
        if r.dtype != v.dtype:
            r = r.to(v.dtype)
        out.append(r)
    return out


def sum_to(g: object, shape: tuple) -> object:
    """``g`` summed down to ``shape`` (the reverse of broadcasting ``shape`` to g's shape).
    **Collective** for a DTensor whose sum must communicate (it stays Partial: no)."""
    gs = tuple(g.shape)
    lead = len(gs) - len(shape)
    dims = tuple(range(lead)) + tuple(
        lead + i for i, s in enumerate(shape) if s == 1 and gs[lead + i] != 1
    )
    if dims:
        g = g.sum(dim=dims, keepdim=True)
    if lead or tuple(g.shape) != shape:
        g = g.reshape(shape)
    return g
