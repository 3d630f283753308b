"""Recording of table ops for autograd: the variants that record backward nodes.

Once autograd is active (the first tensor that requires grad), every variant of an op
reaches the recorder: the public functions and the compiled front's FastOps (DTensor
methods, operators and slots on the fast path) through their hook, :func:`call`; Tensor's
methods and operators, and DTensor's on the Python path, through their recording form,
:func:`recording` (a compiled guard, or its Python twin). When grad mode is on and a tensor
argument requires grad, :func:`record` runs the op with grad mode off and makes its node
(:mod:`dtensor.local.grad_engine`) from the op record's formula
(:class:`dtensor.ops.table.Backward`), which receives the public dispatching functions
(:data:`FUNCTIONS`) as its ``fns``; otherwise the variant runs as it is. In-place
variants also bump the version counter of what they write, and refuse a leaf that requires
grad.

A view made by recorded view ops (:data:`dtensor.ops.view.VIEWS`, when its data is
its input's) remembers its base and how it derives from it (:class:`_View`). An in-place
op on such a view rewrites the base's history, as PyTorch's ``CopySlices``: the base gets
a node whose backward sends the view's part of the gradient through the in-place op's
formula and puts the result back in place, and the view becomes the view of the new base;
a view taken before an in-place write to its base (through it, another view or the base
itself) is brought up to date when an op uses it.

Until autograd is active nothing here runs: the recording forms that
:mod:`dtensor.dispatch.entry_points` installs at import read a flag per call (set once, by
:func:`set_active` and the compiled front's twin) and run their variant as it is. After,
the no-grad path pays one check per call (a pointer test per argument in compiled code).
On the compiled path, a call that records is first offered to the compiled recorder
(``fastpath.dispatch``, plugged in by :mod:`dtensor.dispatch.compiled` with this module's
parts), which records the common case as :func:`record` does: positional
arguments (of an op without a variadic parameter, out of place, whose formula reads no
random state) and no input that is a view of a recorded view op; it makes the node and the
outputs' autograd state from compiled classes (autograd's ``Node`` and ``AutogradMeta`` on
the compiled path). Any other call comes here, to :func:`record`, which runs the op
through the front with grad mode off.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from operator import itemgetter
from types import SimpleNamespace

import numpy as np

from placements.errors import AutogradError
from placements.types import Replicate

from ..distributed.abstract import AbstractDTensor
from ..distributed.dtensor import DTensor, PendingDTensor
from ..local import grad_engine as _ag
from ..local.rng import get_rng_state
from ..local.tensor import Tensor, wrap_array
from ..ops import OpInfo
from ..ops.view import VIEWS
from . import dispatcher as _dispatcher
from .dispatcher import MISSING, binder_of, lookup

__all__ = [
    "FUNCTIONS",
    "call",
    "record",
    "recording",
    "recording_setitem",
    "recording_view_property",
    "set_active",
    "sum_to",
    "use_functions",
]

_MODE = _ag.MODE

#: The public dispatching functions by op name (``FUNCTIONS.cat``, ``FUNCTIONS.zeros_like``...):
#: every backward formula receives them as its ``fns``. :mod:`dtensor.dispatch.install`, which
#: makes them, hands them over (:func:`use_functions`).
FUNCTIONS = SimpleNamespace()


def use_functions(functions: Mapping[str, Callable]) -> None:
    """Give the backward formulas the dispatching public ``functions`` (by name; replacing
    those of the same names). **Local**."""
    vars(FUNCTIONS).update(functions)


def _wants_grad(args: Sequence[object], kwargs: Mapping[str, object] | None) -> bool:
    """Whether a tensor among the arguments (also inside list/tuple arguments) requires
    grad."""
    for a in args:
        t = type(a)
        if t is Tensor or t is DTensor or t is PendingDTensor or t is AbstractDTensor:
            m = a._ag
            if m is not None and m.requires_grad:
                return True
        elif t is list or t is tuple:
            for e in a:
                te = type(e)
                if te is Tensor or te is DTensor or te is PendingDTensor or te is AbstractDTensor:
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
              make: Callable | None = None) -> Callable:
    """The recording form of a method or operator ``plain`` of ``info`` (its arguments are
    the op's, reordered by ``order``: ``order[i]`` is where the op's argument ``i`` is):
    ``make(info, plain, order, _guarded)`` (the compiled guard) when given, else its Python
    twin. Either runs ``plain`` itself until autograd is active (:func:`set_active`)."""
    if make is not None:
        return make(info, plain, order, _guarded)  # (it reports plain's name and doc)
    mode = _MODE
    inplace = info.inplace

    def variant(*args, **kwargs):
        if _ACTIVE and (inplace or (mode.enabled and _wants_grad(args, kwargs))):
            return _guarded(info, plain, args, kwargs, order)
        return plain(*args, **kwargs)

    variant.__name__ = getattr(plain, "__name__", info.name)
    variant.__qualname__ = getattr(plain, "__qualname__", info.name)
    variant.__doc__ = getattr(plain, "__doc__", None)
    return variant


def set_active() -> None:
    """Turn the Python recording forms on (autograd became active). **Local**."""
    global _ACTIVE
    _ACTIVE = True


#: Whether autograd is active: the Python recording forms read it per call.
_ACTIVE = False


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
        if not _ACTIVE:
            plain(self, idx, value)
            return
        if mode.enabled and _wants_grad((self, value), None):
            view = _inplace_state(self, "__setitem__")
            edges = [_edge(self), _edge(value)]
            vmeta = (tuple(value.shape), value.dtype) if _is_tensor(value) else None
            _unrecorded(plain, (self, idx, value), {})
            _ag.bump_version(self)
            node = _ag.record("setitem", _setitem_backward, edges, (self,), (idx, vmeta))
            if view is not None:
                _rebase(self, view, node)
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
    return t is Tensor or t is DTensor or t is PendingDTensor or t is AbstractDTensor


def _detached(t: object) -> object:
    """A new handle on ``t``'s data without autograd state (what a node saves of its own
    output: no reference cycle through the output's grad_fn)."""
    if isinstance(t, DTensor):  # a pending one (async redistribute) waits here
        return t.__copy__()
    return wrap_array(t._arr, t._storage)


#: Stand-ins by layout (see :func:`_stand_in`): ``(shape, dtype)`` of a Tensor, a DTensor's spec.
_STAND_INS: dict = {}
_STAND_INS_MAX = 1024


def _stand_in(v: object) -> object:
    """What a node keeps of a tensor argument its formula does not read: a tensor of
    ``v``'s shape and dtype (a DTensor: of its spec) over one zero (a read-only, zero-stride
    array), so that the formula can still ask for its layout and build zeros like it while
    ``v``'s memory goes when the program drops ``v``. Arrays off the host are kept as
    they are. A metadata-only DTensor's stand-in is a handle of its spec over no block, so
    that the abstract memory model frees its bytes as the real one does."""
    if type(v) is Tensor:
        arr = v._arr
        if type(arr) is not np.ndarray:
            return v
        key = (arr.shape, arr.dtype.char)
        s = _STAND_INS.get(key)
        if s is not None:
            return s
        s = wrap_array(np.broadcast_to(np.zeros((), arr.dtype), arr.shape), None)
    elif type(v) is AbstractDTensor:  # its spec over no memory (the block goes with v)
        key = v._spec
        s = _STAND_INS.get(key)
        if s is not None:
            return s
        s = v.stand_in()
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
    """``v``, or its stand-in when it is an intermediate of the graph (a tensor with a
    ``grad_fn``). Leaves and tensors that require no grad are kept as they are: the
    program holds them (its parameters and inputs), and the index and mask tensors that
    formulas read are among them."""
    t = type(v)
    if t is Tensor or t is DTensor or t is PendingDTensor or t is AbstractDTensor:
        m = v._ag
        if m is not None and m.grad_fn is not None:
            return _stand_in(v)
    return v


class _Plan:
    """What :func:`record` needs of one op, computed once (:func:`_plan_of`): its binder;
    ``required`` the number of parameters up to the last without a default; ``quick`` the
    fewest positional arguments a call may pass for a bind that only fills the remaining
    defaults (no keyword, no packing; ``nparams + 1`` when the op has a variadic or
    size-packing parameter: every call binds in full); ``save`` the positions of the
    tensor parameters the formula reads; ``unread`` those of the others (a node keeps
    stand-ins of its intermediates); ``view`` whether the op is a view op."""

    __slots__ = ("binder", "quick", "required", "save", "unread", "view")

    def __init__(self, info: OpInfo) -> None:
        binder = self.binder = binder_of(info)
        fill = binder.fill
        n = binder.nparams
        while n and fill[n - 1] is not MISSING:
            n -= 1
        self.required = n
        self.quick = n if binder.pack_idx < 0 and binder.variadic_idx < 0 else binder.nparams + 1
        save = () if info.backward is None else info.backward.save
        self.save = tuple((binder.index[p], p) for p in save)
        self.unread = tuple(pi for pi, p in zip(binder.tensor_idx, info.tensor_params)
                            if p not in save)
        self.view = info.name in VIEWS


_PLANS: dict = {}


def _plan_of(info: OpInfo) -> _Plan:
    plan = _PLANS[info] = _Plan(info)
    return plan


def _compiled_plan_fields(info: OpInfo) -> tuple | None:
    """The fields of the compiled recorder's plan of ``info`` (made by
    :mod:`dtensor.dispatch.compiled`), or None for an op whose calls :func:`record` records
    (in place, no formula, random state, a variadic parameter)."""
    bw = info.backward
    if info.inplace or bw is None or bw.fn is None or bw.rng or info.variadic is not None:
        return None
    plan = _PLANS.get(info) or _plan_of(info)
    b = plan.binder
    needed = tuple(i for i, f in enumerate(b.fill) if f is MISSING)
    return (plan.required, b.nparams, list(b.fill), b.pack_idx, b.tensor_idx, plan.save,
            plan.unread, plan.view, info.name, bw, bw.out, dict(b.index), needed)


# -- views ---------------------------------------------------------------------------------------
class _View(tuple):
    """How a view derives from its base: the view op's call (``info``, its bound values,
    which output ``nr`` of ``n_out``) applied after ``parent`` (the view it was taken of,
    None when taken of the base itself); ``base`` a weak reference to the base tensor (the
    graph does not keep it alive: with the base gone, the view is written like any
    tensor), ``base_meta`` the base's autograd state the view's history starts from (when
    the base's changes, the view is stale). A tuple (made with :data:`_new_view`, a C call:
    every recorded view op makes one)."""

    __slots__ = ()

    base = property(itemgetter(0))
    base_meta = property(itemgetter(1))
    info = property(itemgetter(2))
    values = property(itemgetter(3))
    nr = property(itemgetter(4))
    n_out = property(itemgetter(5))
    parent = property(itemgetter(6))

    def on(self, base: weakref.ref, base_meta: object) -> _View:
        """The same view of ``base`` with the history ``base_meta``."""
        return _new_view(_View, (base, base_meta, *self[2:]))

    def of(self, t: object) -> object:
        """The view of ``t`` (a tensor shaped like the base: a gradient of it)."""
        if self.parent is not None:
            t = self.parent.of(t)
        info = self.info
        name = "__getitem__" if info.name == "getitem" else info.name
        out = getattr(t, name)(*self.values[1:])
        return out[self.nr] if info.backward.multi else out

    def back(self, g: object) -> object:
        """A gradient of the view as a gradient of the base (zeros outside the view)."""
        bw = self.info.backward
        if bw.multi:
            grads = [None] * self.n_out
            grads[self.nr] = g
            g = grads
        need = [True] + [False] * (len(self.info.tensor_params) - 1)
        g = bw.fn(g, self.values, None, need, FUNCTIONS)[0]
        return g if self.parent is None else self.parent.back(g)


_new_view = tuple.__new__


def _view_back(node: _ag.Node, grads: list) -> list:
    return [node.ctx.back(grads[0])]


def _view_meta(view: _View) -> _ag.AutogradMeta:
    """The autograd state of ``view.of(base)`` from the base's current history (one node
    for the whole chain of view ops)."""
    node = _ag.Node(view.info.name, _view_back, (view.base_meta,), view)
    meta = _ag.AutogradMeta(True, node, 0)
    meta.view = view
    return meta


def _current(t: object, m: _ag.AutogradMeta) -> _ag.AutogradMeta:
    """``t``'s autograd state, brought up to date when ``t`` is a view whose base was
    written in place since (``m`` is ``t._ag``)."""
    view = m.view
    base = view.base()
    if base is None:
        return m
    bm = base._ag
    if bm is view.base_meta:
        return m
    m = _view_meta(view.on(view.base, bm))
    t._ag = m
    return m


def _note_views(info: OpInfo, values: list, x: object, outputs: Sequence) -> None:
    """Mark the outputs of a recorded view op that share the data of its input ``x`` (on
    every recorded view op: the _View fields by index)."""
    owner = _ag.owner
    own = owner(x)
    xm = x._ag
    parent = None if xm is None else xm.view
    if parent is not None and parent[0]() is None:
        parent = None  # its base is gone: x is the base now
    if parent is None:
        base, bm = weakref.ref(x), xm
    else:
        base, bm = parent[0], parent[1]
    n = len(outputs)
    for i, o in enumerate(outputs):
        m = o._ag
        if m is not None and owner(o) is own:
            m.view = _new_view(_View, (base, bm, info, values, i, n, parent))


def _edge(v: object) -> _ag.AutogradMeta | None:
    """:func:`dtensor.local.grad_engine.edge_of`, a stale view brought up to date."""
    m = _ag.edge_of(v)
    return m if m is None or m.view is None else _current(v, m)


def _inplace_state(self: object, name: str) -> _View | None:
    """Before an in-place op on ``self`` records: refuse a leaf that requires grad or a
    view of one; the view ``self`` is (brought up to date), or None."""
    m = self._ag
    if m is None or not m.requires_grad:
        return None
    if m.grad_fn is None:
        raise AutogradError(
            f"{name}: a leaf Variable that requires grad is being used in an in-place "
            "operation."
        )
    if m.view is None or m.view.base() is None:
        return None
    m = _current(self, m)
    bm = m.view.base_meta
    if bm is not None and bm.requires_grad and bm.grad_fn is None:
        raise AutogradError(
            f"{name}: a view of a leaf Variable that requires grad is being used in an "
            "in-place operation."
        )
    return m.view


def _copy_slices(node: _ag.Node, grads: list) -> list:
    """The backward of a base written in place through a view: the view's part of the
    gradient goes through the in-place op's node, and its result for the view's old value
    replaces that part."""
    view, op_node = node.ctx
    g = grads[0]
    gv = view.of(g)
    res = op_node.apply([gv])
    d = -gv if res[0] is None else res[0] - gv
    return [g + view.back(d), *res[1:]]


def _rebase(self: object, view: _View, op_node: _ag.Node) -> None:
    """After an in-place op (``op_node``) on the view ``self``: the base's history gets
    the write (a CopySlices node), the view becomes the view of the new base."""
    base = view.base()
    if base is None:  # (gone since: the write stays the view's own)
        return
    edges = (view.base_meta, *op_node.edges[1:])
    cs = _ag.Node("copy_slices", _copy_slices, edges, (view, op_node))
    base._ag = bm = _ag.AutogradMeta(True, cs, 0)
    self._ag = _view_meta(view.on(view.base, bm))


def _saves_partial(plan: _Plan, values: list, vi: int) -> bool:
    """Whether a DTensor argument that the formula reads holds a Partial placement."""
    for pi, _ in plan.save:
        if pi != vi:
            v = values[pi]
            if (type(v) is DTensor or type(v) is AbstractDTensor) and v._spec.has_partial():
                return True
    return False


def _reduce_saved_partials(info: OpInfo, plan: _Plan, args: tuple,
                           kwargs: Mapping[str, object], values: list) -> tuple:
    """The call with each saved Partial argument that the op's strategy moves already
    moved (the gradient of the call still flows to the argument itself): the op then finds
    it in place, and its backward formula reads the reduced value the kernel read, not the
    pending sum, which it would reduce again (a layer norm's backward over a residual
    stream left ``P(sum)``: three all-reduces of the activation per call). **Collective**
    (the moves). Returns ``(args, kwargs, values)``."""
    entry, _, mesh = lookup(info, list(values))
    saved = {pi for pi, _ in plan.save}
    swap: dict[int, object] = {}
    for (pi, ei), move in zip(entry.slots, entry.moves):
        v = values[pi]
        if (move is None or ei >= 0 or pi not in saved
                or (type(v) is not DTensor and type(v) is not AbstractDTensor)
                or not v._spec.has_partial()):
            continue
        prev = _dispatcher._current_op
        _dispatcher._current_op = info.name  # (CommDebugMode names the op, as in dispatch)
        try:
            # recorded: a backward that records (create_graph) differentiates the formula's
            # reads of it back to v; the node's own edge stays v's
            moved = v.redistribute(mesh, move.dst.placements)
        finally:
            _dispatcher._current_op = prev
        swap[id(v)] = moved
        values[pi] = moved
    if swap:
        args = tuple([swap.get(id(a), a) for a in args])
        if kwargs:
            kwargs = {k: swap.get(id(a), a) for k, a in kwargs.items()}
    return args, kwargs, values


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
    plan = _PLANS.get(info) or _plan_of(info)
    binder = plan.binder
    n = len(args)
    if not kwargs and plan.quick <= n <= binder.nparams:
        values = list(args) if order is None else [args[i] for i in order]
        if n < binder.nparams:
            values += binder.fill[n:]
    else:
        values = binder.bind(args if order is None else [args[i] for i in order], kwargs)
    bw = info.backward  # an in-place op's is its out-of-place op's (see ops.table.declare)
    self = values[0] if info.inplace else None
    view = None if self is None else _inplace_state(self, name)
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
    vi = binder.variadic_idx
    slots = [values[pi] for pi in binder.tensor_idx] if vi < 0 else _slots(binder, values)
    edges = []
    for v in slots:
        t = type(v)
        if t is Tensor or t is DTensor or t is PendingDTensor or t is AbstractDTensor:
            m = v._ag
            if m is not None:
                if m.view is not None:
                    m = _current(v, m)
                if m.requires_grad:
                    edges.append(m)
                    continue
        edges.append(None)
    saved = []
    if plan.save:
        if self is None and _saves_partial(plan, values, vi):
            args, kwargs, values = _reduce_saved_partials(info, plan, args, kwargs, values)
        if self is not None and "input" in bw.save:
            # the formula reads the value before the op
            values[0] = _unrecorded(_detached(self).clone, (), {})
        save = _ag.save
        for pi, pname in plan.save:
            for v in (values[pi] if pi == vi else (values[pi],)):
                if _is_tensor(v):
                    saved.append(save(v, pname))
    state = get_rng_state() if bw.rng else None
    mode = _MODE
    mode.enabled = False  # (_unrecorded, inline: this is the recording hot path)
    try:
        out = plain(*args, **kwargs)
    except BaseException:
        _ag.unsave(saved)  # (no node will hold them)
        raise
    finally:
        mode.enabled = True
    if self is not None:
        _ag.bump_version(self)
        outputs = (self,)
    elif _is_tensor(out):
        for v in slots:
            if v is out:  # the op returned its input (contiguous() of a contiguous tensor)
                _ag.unsave(saved)
                return out
        outputs = (out,)
    else:
        outputs = tuple(out)
    saved_out = state
    if bw.out:
        saved_out = _detached(outputs[0])
        saved.append(_ag.save(saved_out, "result"))
    # the node keeps what the formula reads: the others as stand-ins of their layout
    first = slots[0] if slots else None
    changed = False
    for pi in plan.unread:
        v = values[pi]
        if pi == vi:
            values[pi] = [_unread(e) for e in v]
            changed = True
        else:
            t = type(v)
            if t is Tensor or t is DTensor or t is PendingDTensor or t is AbstractDTensor:
                m = v._ag
                if m is not None and m.grad_fn is not None:
                    values[pi] = _stand_in(v)
                    changed = True
    if changed:
        slots = [values[pi] for pi in binder.tensor_idx] if vi < 0 else _slots(binder, values)
    layouts = None  # a DTensor output's placements: its Partial gradient is reduced to them
    for o in outputs:
        if type(o) is DTensor or type(o) is AbstractDTensor:
            layouts = tuple([e._spec.placements if isinstance(e, DTensor) else None
                             for e in outputs])
            break
    node = _ag.record(name, _apply, edges, outputs, (bw, values, slots, layouts), saved_out,
                      saved)
    if view is not None:
        _rebase(self, view, node)
    elif plan.view:
        _note_views(info, values, first, outputs)
    return out


def _reduced_grads(grads: list, layouts: tuple) -> list:
    """The outputs' gradients with each Partial one reduced to its output's layout
    (Partial as Replicate) before the formula reads it. **Collective** when one is Partial.

    A gradient sum left pending would travel on through the formula (linear ops keep it
    Partial) and be reduced by whichever later op needs it whole, once per consumer: the
    gradient of a replicated activation that feeds column-parallel matmuls (their input
    gradients are Partial sums over the shards) would meet the row-parallel weights'
    gradient matmul as ``P(sum)`` and gather the other operand instead. Reduced here, once
    per output after its gradients are summed, it is Megatron's backward all-reduce."""
    out = list(grads)
    for i, (g, lay) in enumerate(zip(grads, layouts)):
        if lay is not None and isinstance(g, DTensor) and g._spec.has_partial():
            target = tuple([Replicate() if p.kind == "P" else p for p in lay])
            if g._spec.placements != target:
                out[i] = g.redistribute(g.device_mesh, target)
    return out


def _apply(node: _ag.Node, grads: list) -> list:
    bw, values, slots, layouts = node.ctx
    if layouts is not None:
        # (in place: a split backward runs the node twice on one list, reduced once)
        grads[:] = _reduced_grads(grads, layouts)
    need = _ag.needed(node)
    out = node.out
    if bw.out and _MODE.enabled:  # a backward that records (create_graph): the saved
        out = _detached(out)  # output with its history, which is this node's output
        out._ag = _ag.AutogradMeta(True, node, 0)
    res = bw.fn(grads if bw.multi else grads[0], values, out, need, FUNCTIONS)
    out = []
    for r, v, e in zip(res, slots, node.edges):
        # (a gradient the formula gave although not asked: kept while its input needs
        # one; a split backward's input half takes a cheap weight gradient so)
        if r is None or e is None:
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
