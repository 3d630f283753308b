"""Glue of the compiled front (``fastpath._dispatch``): plugging it into the dispatcher,
its per-op runners, and the *raw forms* it may use on a cache hit.

The front serves repeated calls of an op from compiled code (see its module docstring).
:func:`plug_fastpath` hands it the dispatcher's hooks (``lookup``, ``dispatch``,
``run_entry``...) and DTensor; :func:`fast_op` builds the compiled runner of one op record;
:func:`raw_form` decides, once per propagation-cache entry, whether a hit can run as a raw
ndarray call (a ufunc, numpy's reshape, a transpose...) that gives exactly what the op's
local kernel would.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np

import fastpath as _fp
from placements.meta import norm_dims
from placements.spec import DTensorSpec
from redistribute.execute import compiled_form as _compiled_form

from ..distributed.dtensor import DTensor, _normalize_placements, _target
from ..local import allocator as _allocator
from ..local import dtypes as _dtypes
from ..local.kernels import nn as _nn
from ..local.kernels import pointwise as _pw
from ..local.kernels.base import INT_RANGES, QUIET, quiet_call
from ..local.tensor import Tensor, _wrap
from ..ops.table import OpInfo
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

__all__ = ["RawForm", "fast_op", "plug_fastpath", "raw_form", "redistribute_form"]

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

    A pointwise op whose operands take its local kernel's short path (same dtype of a kind
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
    name = info.name
    if entry.direct is None or not values:
        return None
    a = values[0]
    if type(a) is not DTensor:
        return None
    spec = a._spec
    if name in ("view", "reshape") and info.kernel is _OWN_TENSOR[name]:
        shape = values[1]
        if type(shape) in (tuple, list) and all(type(s) is int for s in shape):
            out = entry.out_specs[0]
            return RawForm(_RAW["view"], out.local_shape(out.mesh._coord))
        return None
    if name == "t" and entry.kernel is _OWN_TENSOR["t"] and len(spec.shape) == 2:
        return RawForm(_RAW["t"], None)
    if name == "getitem" and entry.kernel is _OWN_TENSOR["__getitem__"] and spec.shape:
        index = _basic_index(values[1])
        return None if index is None else RawForm(_RAW["getitem"], index)
    if name in ("clone", "contiguous") and entry.kernel is _OWN_TENSOR[name]:
        served, out = _out(entry)
        return RawForm(_RAW[name], None, out=out) if served else None
    if name == "mean":
        return _raw_sum(entry, values, spec, getattr(entry.kernel, "scale", None))
    if entry.kernel is not info.kernel:
        return None
    if name == "sum":
        return _raw_sum(entry, values, spec)
    if name in ("amax", "amin"):
        return _raw_extreme(entry, values, spec)
    if name in _SOFTMAX:
        return _raw_softmax(entry, values, spec)
    if name in ("matmul", "mm"):
        return _raw_matmul(entry, values, spec)
    return _raw_pointwise(info, entry, values, spec)


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
    return quiet_call(kernel, _wrap(a), -1)._arr


#: The raw forms of softmax and log_softmax along the last dim: the compiled loop that the
#: local kernels' short path runs (their other arrays go to the kernel itself).
_SOFTMAX = {}
if _fp.ENABLED:
    _SOFTMAX.update(
        (name, _fp.kernels.LastDimSoftmax(name == "log_softmax",
                                          functools.partial(_softmax_fallback, kernel)))
        for name, kernel in (("softmax", _nn.softmax), ("log_softmax", _nn.log_softmax))
    )


def _raw_softmax(entry: CacheEntry, values: list, spec: DTensorSpec) -> RawForm | None:
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


def _raw_extreme(entry: CacheEntry, values: list, spec: DTensorSpec) -> RawForm | None:
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


def _raw_matmul(entry: CacheEntry, values: list, spec: DTensorSpec) -> RawForm | None:
    """``matmul``/``mm`` of two host DTensors of one dtype, both at least 2-D:
    ``np.matmul(a, b)``, as the local kernel computes it (into a pooled output from the
    pooling size on)."""
    b = values[1]
    if type(b) is not DTensor or spec.mesh.device_type != "cpu":
        return None
    bs = b._spec
    if bs.dtype is not spec.dtype or len(spec.shape) < 2 or len(bs.shape) < 2:
        return None
    _, out = _out(entry)
    return RawForm(_RAW["binary"], np.matmul, quiet=spec.dtype.kind in "fc", out=out)


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
    targets = _normalize_placements(placements, mesh, "redistribute")
    if mesh.device_type != "cpu":
        return None
    dst, steps = _target(spec, targets)
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


def plug_fastpath() -> object:
    """Connect the compiled front (``fastpath._dispatch``) to this dispatcher. **Local**.

    Returns the compiled module, or None when the fast path is not enabled (not built, or
    ``DTENSOR_FASTPATH=0`` at import).
    """
    global _RAW
    if not _fp.ENABLED:
        return None
    front = _fp.dispatch
    front.install(
        DTensor, vars(_dtypes), lookup, dispatch, run_entry, wrap_outputs, raw_form, MISSING
    )
    front.set_quiet(QUIET, quiet_call)
    _RAW = front.RAW_FORMS
    front.install_redistribute(redistribute_form, PY_REDISTRIBUTE, move_form, execute_move)
    attach_front(front)
    return front


#: DTensor's Python ``redistribute`` (the compiled one falls back to it; installed again
#: when the front is turned off).
PY_REDISTRIBUTE = DTensor.redistribute


def fast_op(info: OpInfo) -> object:
    """The compiled runner of ``info`` (built once per op). **Local**."""
    fop = _FAST_OPS.get(info.name)
    if fop is None or fop.info is not info:
        fop = _FAST_OPS[info.name] = _fp.dispatch.FastOp(info, binder_of(info))
    return fop


_FAST_OPS: dict[str, object] = {}
_RAW: dict[str, int] = {}
