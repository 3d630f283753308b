"""The compiled front (``fastpath._dispatch``) as the dispatch layer sees it: the one module
of :mod:`dtensor.dispatch` that talks to ``fastpath``.

The front serves repeated calls of an op from compiled code (see its module docstring).
:func:`plug` hands it, in one :class:`Plug` (keywords whose names the front lists in
``PLUG_FIELDS``), DTensor, the dispatcher's hooks (``lookup``, ``dispatch``,
``run_entry``...), the recorder's parts and the FastOps behind DTensor's operator slots;
:func:`set_flags` sets the two flags its entry points read per call (autograd active, the
Python path); :func:`make_method`, :func:`make_operator`, :func:`make_function` and
:func:`make_recording` build the compiled entry points that
:mod:`dtensor.dispatch.entry_points` installs; :func:`fast_op` builds the compiled runner of one op record;
:func:`raw_form` decides, once per propagation-cache entry, whether a hit can run as a raw
ndarray call (a ufunc, numpy's reshape, a transpose...) that gives exactly what the op's
local kernel would.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import fields as dataclass_fields
from typing import NamedTuple

import numpy as np

import fastpath as _fp
from placements.meta import norm_dims
from placements.spec import DTensorSpec
from redistribute.execute import compiled_form as _compiled_form
from redistribute.execute import executor_plug

from ..distributed.abstract import AbstractDTensor
from ..distributed.dtensor import DTensor, PendingDTensor, normalize_placements, redistribute_target
from ..local import allocator as _allocator
from ..local import dtypes as _dtypes
from ..local import grad_engine as _ag
from ..local.kernels import linalg as _linalg
from ..local.kernels import nn as _nn
from ..local.kernels import pointwise as _pw
from ..local.kernels.base import INT_RANGES, QUIET, quiet_call
from ..local.tensor import Tensor, wrap_array
from ..ops import OPS
from ..ops.table import OpInfo
from . import tape as _tape
from .dispatcher import (
    MISSING,
    CacheEntry,
    attach_front,
    binder_of,
    dispatch,
    execute_move,
    lookup,
    run_entry,
    wrap_outputs,
)

__all__ = [
    "COMPILED_REDISTRIBUTE",
    "FRONT",
    "MOVE_LOCAL",
    "PY_REDISTRIBUTE",
    "Plug",
    "RawForm",
    "fast_op",
    "make_function",
    "make_method",
    "make_operator",
    "make_recording",
    "plug",
    "plug_executor",
    "raw_form",
    "redistribute_form",
    "set_flags",
    "slot_served",
    "why_off",
]

#: The compiled front (``fastpath._dispatch``), or None when the fast path is not enabled
#: (not built, or ``DTENSOR_FASTPATH=0`` at import).
FRONT = _fp.dispatch if _fp.ENABLED else None

#: Tensor's own view and copy methods (the kernels of view/reshape/t/getitem/clone/
#: contiguous), taken at import: once autograd is active the class holds their recording
#: forms, which raw_form must not compare against.
_OWN_TENSOR = {n: vars(Tensor)[n] for n in ("view", "reshape", "t", "__getitem__", "clone",
                                            "contiguous")}


class RawForm(NamedTuple):
    """How the compiled front runs an entry on raw ndarrays (see :func:`raw_form`)."""

    form: int  # one of the front's RAW_FORMS
    arg: object  # the ufunc, kernel, shape or index
    extra: tuple = ()  # (index, value) of other bound values that must be unchanged
    param: object = None  # what the form needs besides (see raw_form)
    quiet: bool = False  # run it with numpy's floating-point errors ignored
    out: object = None  # None (numpy allocates) or a callable returning the output array


def raw_form(info: OpInfo, entry: CacheEntry, values: list) -> RawForm | None:
    """How the compiled front may run ``entry`` on raw ndarrays, or None. **Local**.

    The record names its form (:attr:`dtensor.ops.table.OpInfo.raw`); each form is decided
    here once, by its entry of ``_DECIDERS``. A pointwise op whose operands take its local kernel's short path (same dtype of a kind
    the kernel takes as is, not 0-d) computes exactly ``ufunc(a, b)``, ``ufunc(a, scalar)``
    or ``kernel(a, out)`` on the local arrays; ``view``/``reshape`` of a standard (row-major)
    local tensor is numpy's reshape to the local output shape (``Tensor.view``'s own short
    path), and ``t`` of a 2-D tensor is the transposed array; ``sum``, ``amax``/``amin``,
    ``softmax``/``log_softmax`` (over the last dim) and ``matmul``/``mm`` of host arrays are
    the calls their kernels make (the compiled loops where the kernels use them); ``clone`` of a
    C-contiguous and ``contiguous`` of a non-C-contiguous host array are a C-order copy
    (checked per call: the layout is not in the spec). Everything here is fixed by the
    entry's specs and the key, so it is decided once. Returns a :class:`RawForm`: ``arg`` is
    the ufunc, kernel, shape or index, ``extra`` lists ``(index, value)`` pairs of other
    bound values that must be unchanged (``alpha=1``), ``param`` what the form needs besides
    (the reduce form's axes, dtype, keepdim and scale; a comparison with a python int on an
    integer dtype, the ``(min, max)`` of the ints it runs with, others going to the kernel),
    ``quiet`` whether numpy may report floating-point errors there (float arithmetic), which
    the front then ignores as the kernels do, and ``out`` the output: None below the
    allocator's pooling size (numpy allocates, as the kernel's short path lets it), else a
    callable returning a pooled array of the local output's shape and dtype (as the kernel's
    ``out_buffer``), so the front serves outputs of every size.
    """
    decide = _DECIDERS.get(info.raw)
    if decide is None or entry.direct is None or not values:
        return None
    a = values[0]
    if type(a) is not DTensor:
        return None
    return decide(info, entry, values, a._spec)


def _raw_view(info: OpInfo, entry: CacheEntry, values: list, spec: DTensorSpec) -> RawForm | None:
    """``view``/``reshape`` of a standard local tensor: numpy's reshape to the local output
    shape (``Tensor.view``'s own short path)."""
    if info.kernel is not _OWN_TENSOR[info.name]:
        return None
    shape = values[1]
    if type(shape) in (tuple, list) and all(type(s) is int for s in shape):
        out = entry.out_specs[0]
        return RawForm(_RAW["view"], out.local_shape(out.mesh._coord))
    return None


def _raw_t(info: OpInfo, entry: CacheEntry, values: list, spec: DTensorSpec) -> RawForm | None:
    """``t`` of a 2-D tensor: the transposed array."""
    if entry.kernel is _OWN_TENSOR["t"] and len(spec.shape) == 2:
        return RawForm(_RAW["t"], None)
    return None


def _raw_getitem(
    info: OpInfo, entry: CacheEntry, values: list, spec: DTensorSpec
) -> RawForm | None:
    """Basic indexing (ints, positive-step slices, one Ellipsis): numpy's view."""
    if entry.kernel is not _OWN_TENSOR["__getitem__"] or not spec.shape:
        return None
    index = _basic_index(values[1])
    return None if index is None else RawForm(_RAW["getitem"], index)


def _raw_copy(info: OpInfo, entry: CacheEntry, values: list, spec: DTensorSpec) -> RawForm | None:
    """``clone``/``contiguous``: a C-order copy (the layout is checked per call)."""
    if entry.kernel is not _OWN_TENSOR[info.name]:
        return None
    served, out = _out(entry)
    return RawForm(_RAW[info.name], None, out=out) if served else None


def _raw_mean(info: OpInfo, entry: CacheEntry, values: list, spec: DTensorSpec) -> RawForm | None:
    """``mean``: the sum's form times the kernel's ``scale`` (1 / the global count)."""
    return _raw_sum(entry, values, spec, getattr(entry.kernel, "scale", None))


def _own_kernel(decide):
    """``decide`` for an entry that runs the op's own kernel (no strategy-specific one)."""

    def decider(info: OpInfo, entry: CacheEntry, values: list, spec: DTensorSpec):
        if entry.kernel is not info.kernel:
            return None
        return decide(info, entry, values, spec)

    return decider


#: The size limit given to the short-path condition: the front serves every size (it
#: passes a pooled output from the pooling size on).
_ANY_SIZE = 1 << 62


def _out(entry: CacheEntry) -> tuple[bool, object]:
    """(served, out) for the output of ``entry``: ``out`` None when numpy may allocate it
    (below the pooling size), else a callable returning a pooled array; not served (False)
    for a pooled-size output off the host (the kernel allocates on its device)."""
    out = entry.out_specs[0]
    shape = out.local_shape(out.mesh._coord)
    if math.prod(shape) * out.dtype.itemsize < _allocator.POOL_MIN_BYTES:
        return True, None
    if out.mesh.device_type != "cpu":
        return False, None
    return True, _allocator.pooled_empty(shape, out.dtype)


class _Shard(NamedTuple):
    """What :func:`dtensor.local.kernels.pointwise.fast_path` reads of a local shard."""

    dtype: np.dtype
    ndim: int
    nbytes: int


def _raw_pointwise(
    info: OpInfo, entry: CacheEntry, values: list, spec: DTensorSpec
) -> RawForm | None:
    """The raw form of an elementwise op whose operands take its local function's short
    path (:func:`dtensor.local.kernels.pointwise.fast_path` on the local shards, any size)."""
    kspec = getattr(info.function, "spec", None)
    if kspec is None:
        return None
    served, out = _out(entry)
    if not served:
        return None
    dt = spec.dtype
    coord = spec.mesh._coord
    limit = _ANY_SIZE
    a = _Shard(dt, len(spec.shape), math.prod(spec.local_shape(coord)) * dt.itemsize)
    quiet = dt.kind in "fc" and kspec.kind not in _pw.FP_ERROR_FREE
    if isinstance(kspec, _pw.UnarySpec):
        if not _pw.fast_path(kspec.fast, limit, a):
            return None
        return RawForm(_RAW["unary"], kspec.kernel, quiet=quiet, out=out)
    uf = getattr(kspec.kernel, "ufunc", None)
    if uf is None or len(values) < 2:
        return None
    fill = binder_of(info).fill
    extra = tuple((i, fill[i]) for i in range(2, len(values)))
    if any(v is not values[i] for i, v in extra):
        return None
    b = values[1]
    if type(b) is DTensor:
        bs = b._spec
        if bs.dtype is not dt or not bs.shape:
            return None
        b_shard = _Shard(dt, len(bs.shape), math.prod(bs.local_shape(coord)) * dt.itemsize)
        if not _pw.fast_path(kspec.fast, limit, a, b_shard):
            return None
        return RawForm(_RAW["binary"], uf, extra, quiet=quiet, out=out)
    if _pw.fast_path(kspec.scalar_fast.get(type(b), _pw.NO_DTYPES), limit, a):
        bounds = INT_RANGES.get(dt) if kspec.kind == "compare" and type(b) is int else None
        if bounds is not None:
            # the local function's range check (an int the dtype cannot hold wraps, in its
            # slow path), within int64 (a larger uint64 value takes that path too)
            bounds = (bounds[0], min(bounds[1], _INT64_MAX))
        return RawForm(_RAW["scalar"], uf, extra, bounds, quiet, out)
    return None


_INT64_MAX = (1 << 63) - 1


#: The raw reduce forms' functions, called as ``ufunc.reduce`` is: with the compiled
#: kernels, sum and amax over the last or every axis of a contiguous float32 array run the
#: compiled loop that the local kernels run (the same bytes in both dispatch modes).
_REDUCE = {"sum": np.add.reduce, "amax": np.maximum.reduce, "amin": np.minimum.reduce}
if _fp.ENABLED:
    _REDUCE.update(
        (op, _fp.kernels.LastDimReduce(op, _REDUCE[op])) for op in ("sum", "amax")
    )


def _softmax_fallback(kernel, a, out):
    """The local kernel on an array the compiled loop does not serve (``out`` unused)."""
    return quiet_call(kernel, wrap_array(a), -1)._arr


#: The raw forms of softmax and log_softmax along the last dim: the compiled loop that the
#: local kernels' short path runs (their other arrays go to the kernel itself).
_SOFTMAX = {}
if _fp.ENABLED:
    _SOFTMAX.update(
        (name, _fp.kernels.LastDimSoftmax(name == "log_softmax",
                                          functools.partial(_softmax_fallback, kernel)))
        for name, kernel in (("softmax", _nn.softmax), ("log_softmax", _nn.log_softmax))
    )


def _raw_softmax(
    info: OpInfo, entry: CacheEntry, values: list, spec: DTensorSpec
) -> RawForm | None:
    """``softmax``/``log_softmax`` over the last dim of a float32/float64 host array, as
    the local kernel's short path computes it (into a pooled output from the pooling size
    on)."""
    _, dim, dtype = values
    nd = len(spec.shape)
    if dtype is not None or type(dim) is not int or spec.mesh.device_type != "cpu":
        return None
    if not nd or dim not in (-1, nd - 1) or spec.dtype not in _FLOATS:
        return None
    _, out = _out(entry)
    return RawForm(_RAW["unary"], _SOFTMAX[entry.name], out=out)


_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def _raw_sum(
    entry: CacheEntry, values: list, spec: DTensorSpec, scale: float | None = None
) -> RawForm | None:
    """``sum`` of a float32/float64 host array as ``_math.sum`` computes it:
    ``np.add.reduce`` (or the compiled loop, :data:`_REDUCE`) over the normalised dims, in
    the input dtype (into a pooled output from the pooling size on); for ``mean``, that sum
    times the kernel's ``scale`` (1 / the global count) in the dtype."""
    _, dim, keepdim, dtype = values
    dt = spec.dtype
    if dtype is not None or spec.mesh.device_type != "cpu":
        return None
    if dt not in (np.dtype(np.float32), np.dtype(np.float64)) or type(keepdim) is not bool:
        return None
    _, out = _out(entry)
    axes = norm_dims(entry.name, dim, len(spec.shape))
    param = (axes, dt, keepdim, None if scale is None else dt.type(scale))
    return RawForm(_RAW["reduce"], _REDUCE["sum"], (), param, quiet=True, out=out)


def _raw_extreme(
    info: OpInfo, entry: CacheEntry, values: list, spec: DTensorSpec
) -> RawForm | None:
    """``amax``/``amin`` of a host array as the kernel computes it: ``np.maximum.reduce``
    (``minimum``; or a compiled twin, :data:`_REDUCE`) over the normalised dims, in the input dtype, NaN propagating; only when
    no reduced dim of the local shard is empty (the kernel decides those)."""
    _, dim, keepdim = values
    if spec.mesh.device_type != "cpu" or type(keepdim) is not bool:
        return None
    axes = norm_dims(entry.name, dim, len(spec.shape))
    local = spec.local_shape(spec.mesh._coord)
    if any(local[d] == 0 for d in axes):
        return None
    _, out = _out(entry)
    return RawForm(_RAW["reduce"], _REDUCE[entry.name], (), (axes, None, keepdim, None), out=out)


def _raw_matmul(
    info: OpInfo, entry: CacheEntry, values: list, spec: DTensorSpec
) -> RawForm | None:
    """``matmul``/``mm`` of two host DTensors of one dtype, both at least 2-D:
    ``np.matmul(a, b)``, as the local kernel computes it (into a pooled output from the
    pooling size on); not for float16 and bfloat16, which the kernel computes in float32."""
    b = values[1]
    if type(b) is not DTensor or spec.mesh.device_type != "cpu":
        return None
    bs = b._spec
    if bs.dtype is not spec.dtype or len(spec.shape) < 2 or len(bs.shape) < 2:
        return None
    if spec.dtype not in _linalg.DIRECT_DTYPES:
        return None
    _, out = _out(entry)
    return RawForm(_RAW["binary"], np.matmul, quiet=spec.dtype.kind in "fc", out=out)


#: The deciders of the raw forms, by the form a record names (:attr:`OpInfo.raw`).
_DECIDERS = {
    "pointwise": _own_kernel(_raw_pointwise),
    "view": _raw_view,
    "t": _raw_t,
    "getitem": _raw_getitem,
    "copy": _raw_copy,
    "mean": _raw_mean,
    "sum": _own_kernel(lambda info, entry, values, spec: _raw_sum(entry, values, spec)),
    "extreme": _own_kernel(_raw_extreme),
    "softmax": _own_kernel(_raw_softmax),
    "matmul": _own_kernel(_raw_matmul),
}


def redistribute_form(d: DTensor, placements: object) -> tuple | None:
    """How the compiled ``redistribute`` may run ``d.redistribute(placements=...)``, or None
    (the Python method then runs). **Local**.

    A host DTensor whose plan to the target is one step that
    :func:`redistribute.execute.compiled_form` describes (a small all-gather, an
    all-reduce, a reduce-scatter or an all-to-all below the shared-memory size, a local
    chunk) runs that step's MPI call from the local array into a new output: numpy's below
    the allocator's pooling size, a pooled one from there on, as the Python method's
    ``allocator_for``. Returns ``(targets, target spec, kind, Comm, out callable or None,
    out shape, dtype, fields)`` (``kind`` and ``fields`` as ``compiled_form`` gives them).
    Invalid placements raise here as in the Python method.
    """
    spec = d._spec
    mesh = spec.mesh
    targets = normalize_placements(placements, mesh, "redistribute")
    if mesh.device_type != "cpu":
        return None
    dst, steps = redistribute_target(spec, targets)
    return _form(spec, dst, targets, steps)


def move_form(move: object) -> tuple | None:
    """How the compiled front may run an op's input move (a dispatcher ``Redist``) as
    :func:`redistribute_form` describes, or None (the executor then runs it). Its plan was
    made and checked with the op's strategy. **Local**."""
    spec = move.src
    if spec.mesh.device_type != "cpu":
        return None
    return _form(spec, move.dst, move.dst.placements, move.steps)


def _form(spec: object, dst: object, targets: tuple, steps: tuple) -> tuple | None:
    mesh = spec.mesh
    form = _compiled_form(steps, spec, mesh._coord, mesh._dim_comms) if steps else None
    if form is None:
        return None
    kind, comm, shape, fields = form
    dtype = spec.dtype
    if len(shape) > 32:
        return None
    nbytes = math.prod(shape) * dtype.itemsize
    make = None if nbytes < _allocator.POOL_MIN_BYTES else _allocator.pooled_empty(shape, dtype)
    return targets, dst, kind, comm, make, tuple(shape), dtype, fields


def _basic_index(idx: object) -> tuple | None:
    """``idx`` as a numpy index that always yields an array view (a trailing Ellipsis), when
    it holds only ints, slices of ints with positive steps and at most one Ellipsis."""
    parts = idx if type(idx) is tuple else (idx,)
    for p in parts:
        if type(p) is slice:
            if not all(v is None or type(v) is int for v in (p.start, p.stop, p.step)):
                return None
            if p.step is not None and p.step <= 0:
                return None
        elif type(p) is not int and p is not Ellipsis:
            return None
    if sum(p is Ellipsis for p in parts) > 1:
        return None
    return parts if Ellipsis in parts else (*parts, Ellipsis)


@dataclass(frozen=True)
class Plug:
    """Everything dtensor hands the compiled front, in one object (the keywords of
    ``fastpath.dispatch.plug``, whose ``PLUG_FIELDS`` they are): see :func:`plug`."""

    dtensor_cls: type
    dtypes_ns: dict
    lookup: Callable
    dispatch: Callable
    run_entry: Callable
    wrap_outputs: Callable
    raw_form: Callable
    missing: object
    quiet_ctx: object
    quiet_call: Callable
    call_hook: Callable
    grad_mode: object
    slot_ops: dict
    record_plan_of: Callable
    record_types: tuple
    record_node: type
    record_apply: Callable
    record_save: Callable
    record_stand_in: Callable
    record_stand_ins: dict
    record_detached: Callable
    record_note_views: Callable
    record_view: type
    redistribute_form: Callable
    py_redistribute: Callable
    move_form: Callable
    move_input: Callable


def _slot_ops() -> dict[str, object]:
    """The FastOps behind DTensor's operator slots (``+ - * / @`` and unary ``-``), by tag.
    They stay on DTensor in both modes (a FastOp runs the Python path when the front is
    off), so that switching paths never falls back to CPython's generic slot dispatch."""
    slots = {}
    for info in OPS.values():
        for op in info.operators:
            tag = op.dunder.strip("_")
            if tag in FRONT.SLOT_TAGS and op.form in ("binary", "unary"):
                slots[tag] = fast_op(info)
    return slots


def slot_served() -> frozenset[str]:
    """The dunders DTensor's compiled operator slots serve (``__add__``, ``__radd__``...;
    empty without the compiled front). **Local**."""
    if FRONT is None:
        return frozenset()
    served = set()
    for info in OPS.values():
        for op in info.operators:
            tag = op.dunder.strip("_")
            if tag in FRONT.SLOT_TAGS and op.form in ("binary", "unary"):
                served.add(op.dunder)
                if op.form == "binary":
                    served.add(f"__r{tag}__")
    return frozenset(served)


def _compiled_plan(info: OpInfo) -> object:
    """The compiled recorder's plan of ``info`` (``fastpath.dispatch.RecordPlan``), or None
    for an op whose calls :func:`dtensor.dispatch.tape.record` records (see
    :func:`dtensor.dispatch.tape._compiled_plan_fields`)."""
    fields = _tape._compiled_plan_fields(info)
    return None if fields is None else FRONT.RecordPlan(*fields)


def plug() -> Plug | None:
    """Connect the compiled front (``fastpath._dispatch``) to this dispatcher and recorder,
    in one :class:`Plug`. **Local**.

    Returns the plug, or None when the fast path is not enabled (not built, or
    ``DTENSOR_FASTPATH=0`` at import).
    """
    global _RAW
    if FRONT is None:
        return None
    _RAW = FRONT.RAW_FORMS
    fields = Plug(
        dtensor_cls=DTensor, dtypes_ns=vars(_dtypes), lookup=lookup, dispatch=dispatch,
        run_entry=run_entry, wrap_outputs=wrap_outputs, raw_form=raw_form, missing=MISSING,
        quiet_ctx=QUIET, quiet_call=quiet_call, call_hook=_tape.call, grad_mode=_ag.MODE,
        slot_ops=_slot_ops(), record_plan_of=_compiled_plan,
        record_types=(Tensor, DTensor, PendingDTensor, AbstractDTensor),
        record_node=_ag.Node, record_apply=_tape._apply, record_save=_ag.save,
        record_stand_in=_tape._stand_in, record_stand_ins=_tape._STAND_INS,
        record_detached=_tape._detached, record_note_views=_tape._note_views,
        record_view=_tape._View, redistribute_form=redistribute_form,
        py_redistribute=PY_REDISTRIBUTE, move_form=move_form, move_input=execute_move,
    )
    FRONT.plug(**{f.name: getattr(fields, f.name) for f in dataclass_fields(Plug)})
    plug_executor()
    attach_front(FRONT)
    return fields


def plug_executor() -> None:
    """Plug the compiled executor (``fastpath._redist``) with redistribute's hook state,
    ``MPI.BYTE`` and the MPI library's persistent-request functions
    (:func:`redistribute.execute.executor_plug`). redistribute and fastpath import nothing
    of each other; this module connects them. **Local**."""
    _fp.redist.install(*executor_plug())


def why_off() -> str:
    """Why the compiled front is not there (the extension built?, ``DTENSOR_FASTPATH=0``
    at import?). **Local**."""
    return (f"extension built: {_fp.AVAILABLE}; DTENSOR_FASTPATH=0 at import: "
            f"{_fp.AVAILABLE and not _fp.ENABLED}")


def set_flags(autograd: bool | None = None, python_path: bool | None = None) -> None:
    """Set the flags the compiled entry points read per call (see
    ``fastpath.dispatch.set_flags``; nothing without the front). **Local**."""
    if FRONT is not None:
        FRONT.set_flags(autograd, python_path)


def make_recording(info: OpInfo, plain: Callable, order: tuple[int, ...] | None,
                   recorder: Callable) -> Callable:
    """The compiled autograd guard of a Tensor variant ``plain`` of ``info`` (see
    ``fastpath.dispatch.make_recording``). **Local**."""
    return FRONT.make_recording(info, plain, order, recorder)


def make_method(info: OpInfo, name: str, doc: str) -> Callable:
    """The compiled DTensor method ``name`` of ``info`` (``self`` first). **Local**."""
    return FRONT.make_method(fast_op(info), name, doc)


def make_operator(info: OpInfo, name: str, doc: str, form: str) -> Callable:
    """The compiled DTensor operator of ``info`` (``form`` as the front's). **Local**."""
    return FRONT.make_operator(fast_op(info), name, doc, form)


def make_function(info: OpInfo, local: Callable) -> Callable:
    """The compiled public function of ``info`` (``local`` for Tensor-only calls). **Local**."""
    return FRONT.make_function(fast_op(info), local)


#: DTensor's Python ``redistribute`` (the compiled one falls back to it).
PY_REDISTRIBUTE = DTensor.redistribute
#: The compiled ``redistribute`` (None without the front).
COMPILED_REDISTRIBUTE = None if FRONT is None else FRONT.redistribute
#: The compiled front's move of an op's input (None without the front).
MOVE_LOCAL = None if FRONT is None else FRONT.move_local


def fast_op(info: OpInfo) -> object:
    """The compiled runner of ``info`` (built once per op). **Local**."""
    fop = _FAST_OPS.get(info.name)
    if fop is None or fop.info is not info:
        fop = _FAST_OPS[info.name] = FRONT.FastOp(info, binder_of(info))
    return fop


_FAST_OPS: dict[str, object] = {}
_RAW: dict[str, int] = {}
