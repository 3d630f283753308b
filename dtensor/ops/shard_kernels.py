"""Strategy-dependent local kernels: what an op computes on a shard when that differs from
what it computes on the whole tensor.

An op record's ``local_fn(schema, strategy)`` is called once per propagation-cache entry and
returns the kernel to run for the chosen strategy (it may read this rank's mesh coordinate
from ``strategy.output_specs[0].mesh``):

- ``mean`` (and ``mse_loss(reduction='mean')``): the local sum times ``1 / N_global``, so
  a ``P(sum)`` of it is exact on uneven and empty shards;
- ``amax``/``amin``/``max``/``min`` over a sharded dim: an empty local shard contributes
  the reduction's identity (-inf / +inf, or the dtype's extremes) instead of raising;
- ``view``/``reshape``/``unflatten``/``expand``/``expand_as``/``squeeze``: the local
  kernel receives the LOCAL output shape (or explicit squeeze dims);
- ``embedding`` with a row-sharded weight: indices outside the local rows are masked to
  zero and the others shifted (PyTorch's MaskPartial), giving a ``P(sum)`` output;
- ``softmax``/``log_softmax`` along a sharded dim and ``cross_entropy`` on logits sharded
  on the class dim (the vocab-parallel loss): the kernel all-reduces the per-row maximum
  and sums over the mesh dims that shard that dim (it communicates: its candidate says
  so, :attr:`placements.rules.Candidate.collective`);
- ``cross_entropy(reduction='mean')`` with its batch (or spatial) dims sharded: the block's
  summed loss over the whole batch's denominator, a ``P(sum)`` (class-index targets: the
  kernel all-reduces one number, the summed weights of the non-ignored targets);
- ``dropout`` on a sharded input: the mask is drawn for the global tensor's counters at
  the shard's global offsets, so the result equals the single-device one;
- ``scaled_dot_product_attention`` with a sharded output (batch/head dims, or the query's
  sequence dim): the kernel is told the block's global first query row (a causal mask is
  the global one) and the global offsets of its attention weights (dropout draws the
  global mask); ``scaled_dot_product_attention_backward`` likewise gets the block's first
  query row;
- ``gather``/``scatter``/``scatter_add``/``take_along_dim`` with the data sharded on a dim
  the op does not index: the (replicated) index is cut to this shard's rows of that dim;
- ``x[idx]`` with dims of its advanced entries (integer arrays, masks, ints among them)
  sharded: the result entries whose positions land in this shard's block on every sharded
  dim are picked and the others zeroed (``P(sum)`` output);
- ``x[idx] = value`` on a sharded dim: the global index becomes this shard's (ints and
  slices translated, a mask cut to the block, the entries of the index arrays that land
  in the block kept), and the value is cut to the part that lands here.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import numpy as np

from placements import Replicate
from placements.errors import ArgumentError
from placements.index_meta import (
    check_index_values,
    index_plan,
    index_put_index,
    masked_index_dims,
)
from placements.layout import local_offsets, local_shape, local_slices
from placements.meta import norm_dim, norm_dims, squeeze_dims
from placements.rules import OpSchema, OpStrategy

from ..local import kernels as _math
from ..local import rng as _random
from ..local.backend import array_module_of
from ..local.kernels import attention as _math_attention
from ..local.kernels import nn as _math_nn
from ..local.tensor import Tensor, wrap_array
from .ring import ring_backward_local, ring_local
from .table import OPS

R = Replicate()

__all__ = [
    "attention_backward_local",
    "attention_local",
    "class_sharded_local",
    "dropout_local",
    "embedding_local",
    "expand_as_local",
    "extreme_local",
    "getitem_local",
    "index_add_local",
    "index_local",
    "kernel_op",
    "mean_local",
    "mse_local",
    "shape_local",
    "squeeze_local",
    "write_index_local",
]


def _coord(strategy: OpStrategy) -> tuple[int, ...]:
    return strategy.output_specs[0].mesh.get_coordinate()


def _local_out_shape(strategy: OpStrategy) -> tuple[int, ...]:
    return strategy.output_specs[0].local_shape(_coord(strategy))


def _filled(like: Tensor, shape: tuple[int, ...], value: object, dtype: np.dtype) -> Tensor:
    """A new tensor of ``shape`` filled with ``value``, on ``like``'s array module."""
    return wrap_array(array_module_of(like._arr).full(shape, value, dtype))


def _scaled_sum(total: Callable, n_global: int, out_dtype: np.dtype) -> Callable:
    """A kernel returning ``total(*values) / n_global`` in ``out_dtype``; its ``scale``
    attribute is the factor (the compiled front computes ``mean`` from it)."""
    inv = 1.0 / n_global if n_global else math.nan

    def kernel(*values):
        arr = total(*values)._arr  # a fresh array (0-d for a full reduction): scaled in place
        arr *= inv
        return wrap_array(arr.astype(out_dtype, copy=False))

    kernel.scale = inv
    return kernel


def mean_local(schema: OpSchema, strategy: OpStrategy) -> Callable:
    """mean: the local sum divided by the GLOBAL count of reduced elements."""
    rt = strategy.output_specs[0].dtype
    acc = np.dtype(np.float32) if rt == np.float16 else rt
    shape = schema.args[0].shape
    axes = norm_dims("mean", schema.get("dim"), len(shape))

    def total(input, dim, keepdim, dtype):
        return _math.sum(input, dim, keepdim, dtype=acc)

    return _scaled_sum(total, math.prod(shape[d] for d in axes), rt)


def mse_local(schema: OpSchema, strategy: OpStrategy) -> Callable:
    """mse_loss(reduction='mean'): the local sum divided by the GLOBAL element count."""
    if schema.get("reduction", "mean") != "mean":
        return _math.mse_loss
    n = math.prod(np.broadcast_shapes(schema.args[0].shape, schema.args[1].shape))

    def total(input, target, reduction):
        return _math.mse_loss(input, target, "sum")

    return _scaled_sum(total, n, strategy.output_specs[0].dtype)


def _identity(kind: str, dtype: np.dtype) -> object:
    """The identity of a ``max`` (or ``min``) reduction in ``dtype``."""
    if dtype.kind == "b":
        return kind != "max"
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return info.min if kind == "max" else info.max
    return -np.inf if kind == "max" else np.inf


def extreme_local(schema: OpSchema, strategy: OpStrategy) -> Callable:
    """amax/amin/max/min over a sharded dim: an empty local block gives the identity."""
    kernel = OPS[schema.op].kernel
    shape = schema.args[0].shape
    dim = schema.get("dim")
    if schema.op in ("max", "min") and dim is not None:
        return kernel  # (values, indices) along an unsharded dim
    axes = norm_dims(schema.op, dim, len(shape))
    if not any(p.is_shard() and p.dim in axes for p in strategy.input_placements[0]):
        return kernel
    out_shape = _local_out_shape(strategy)
    dtype = strategy.output_specs[0].dtype
    fill = _identity("max" if schema.op in ("amax", "max") else "min", dtype)

    def local(input, *rest):
        if any(input.shape[d] == 0 for d in axes):
            return _filled(input, out_shape, fill, dtype)
        return kernel(input, *rest)

    return local


def shape_local(param: str) -> Callable:
    """local_fn of a view-like op whose ``param`` is the output shape: pass the local one."""

    def local_fn(schema: OpSchema, strategy: OpStrategy) -> Callable:
        kernel = OPS[schema.op].kernel
        if not strategy.output_specs[0].is_sharded():
            return kernel
        shape = _local_out_shape(strategy)
        if schema.op == "unflatten":  # the local sizes of the split dim
            d = norm_dim(schema.get("dim"), len(schema.args[0].shape), "unflatten")
            shape = shape[d : d + len(tuple(schema.get("sizes")))]
        idx = OPS[schema.op].params.index(param)

        def local(*values):
            values = list(values)
            values[idx] = shape
            return kernel(*values)

        return local

    return local_fn


def expand_as_local(schema: OpSchema, strategy: OpStrategy) -> Callable:
    """expand_as: expand to the local output shape (``other`` gives metadata only)."""
    shape = _local_out_shape(strategy)

    def local(input, other):
        return input.expand(shape)

    return local


def squeeze_local(schema: OpSchema, strategy: OpStrategy) -> Callable:
    """squeeze: drop the GLOBAL size-1 dims only (a shard may have other size-1 dims)."""
    dims = squeeze_dims(schema.args[0].shape, schema.get("dim"))

    def local(input, dim):
        return input.squeeze(dims)

    return local


def embedding_local(schema: OpSchema, strategy: OpStrategy) -> Callable:
    """Row-sharded weight: local rows only, other indices give zeros (``P(sum)`` output);
    an index outside the GLOBAL rows raises as the unsharded embedding does."""
    w = schema.args[1]
    target = strategy.input_placements[1]
    if not any(p.is_shard(0) for p in target):
        return _math.embedding
    coord = _coord(strategy)
    start = local_offsets(w.shape, schema.mesh_shape, target, coord)[0]
    rows = local_shape(w.shape, schema.mesh_shape, target, coord)[0]
    out_shape = _local_out_shape(strategy)

    def local(input, weight, padding_idx):
        idx = input._arr
        _math_nn.check_index_range(idx, w.shape[0])
        outside = (idx < start) | (idx >= start + rows)
        if rows == 0:
            return _filled(weight, out_shape, 0, weight.dtype)
        shifted = idx - start
        shifted[outside] = 0
        out = _math.embedding(wrap_array(shifted), weight)._arr
        out[outside] = 0
        return wrap_array(out)

    return local


#: Per thread, the op whose kernel runs a collective of its own right now (the all-reduces
#: of a vocab-parallel loss; ``op``, absent otherwise); the dispatcher reports it as the
#: current op (:func:`dtensor.dispatch.dispatcher.current_op`) so that CommDebugMode names
#: it. Per thread: the strategy validator runs one coordinate's kernels per thread.
_kernel_state = threading.local()


def kernel_op() -> str | None:
    """The op whose kernel is running one of its own collectives in this thread, or None.
    **Local**."""
    return getattr(_kernel_state, "op", None)


def _mesh_reduce(op: str, what: str, fixed: str | None, comms: list) -> Callable:
    """``reduce(array[, op])``: the array all-reduced in place over ``comms`` (one mesh
    dim's group each), reported as ``op``'s own collective (``fixed``: the reduction op,
    else the second argument). **Collective** over those groups."""

    def reduce(arr, red=None):
        prev = getattr(_kernel_state, "op", None)
        _kernel_state.op = op
        try:
            for comm in comms:
                comm.allreduce(arr, op=fixed or red, what=(op, what))
        finally:
            _kernel_state.op = prev
        return arr

    return reduce


def class_sharded_local(schema: OpSchema, strategy: OpStrategy) -> Callable:
    """``softmax``/``log_softmax`` along a sharded dim, ``cross_entropy`` with the class dim
    sharded: the block's result, the per-row maximum and sums all-reduced over the mesh
    dims that shard that dim (:class:`dtensor.local.kernels.nn.ClassShard`); a mean
    ``cross_entropy`` with its batch dims sharded: the block's sum over the whole batch's
    denominator (:class:`dtensor.local.kernels.nn.BatchShard`)."""
    kernel = OPS[schema.op].kernel
    shape = schema.args[0].shape
    if schema.op == "cross_entropy":
        d = 1 if len(shape) >= 2 else 0
    else:
        d = norm_dim(schema.get("dim"), len(shape), schema.op) if shape else 0
    pl = strategy.input_placements[0]
    dims = [m for m, p in enumerate(pl) if p.is_shard(d)]
    mesh = strategy.output_specs[0].mesh
    batch = None
    if schema.op == "cross_entropy" and schema.get("reduction", "mean") == "mean":
        batch_dims = [m for m, p in enumerate(pl) if p.is_shard() and not p.is_shard(d)]
        if batch_dims:
            batch = _math_nn.BatchShard(
                math.prod(shape[:d] + shape[d + 1:]),
                _mesh_reduce(schema.op, "batch shards", "sum",
                             [mesh.get_group(m) for m in batch_dims
                              if schema.mesh_shape[m] > 1]))
    if not dims and batch is None:
        return kernel
    shard = None
    if dims:
        start = local_offsets(shape, schema.mesh_shape, pl, _coord(strategy))[d]
        comms = [mesh.get_group(m) for m in dims if schema.mesh_shape[m] > 1]
        shard = _math_nn.ClassShard(start, shape[d], _mesh_reduce(schema.op, "class shards",
                                                                  None, comms))
    if schema.op == "cross_entropy":

        def loss(input, target, weight, ignore_index, reduction, label_smoothing):
            return _math_nn.sharded_cross_entropy(input, target, weight, ignore_index,
                                                  reduction, label_smoothing, shard, batch)

        return loss
    take_log = schema.op == "log_softmax"

    def local(input, dim, dtype):
        return _math_nn.sharded_softmax(input, dim, dtype, take_log, shard)

    return local


def dropout_local(schema: OpSchema, strategy: OpStrategy) -> Callable:
    """Sharded dropout: the mask of the global counters at this shard's global offsets."""
    spec = strategy.output_specs[0]
    if not schema.get("training", True) or not spec.is_sharded():
        return _math.dropout
    coord = _coord(strategy)
    starts = spec.local_offsets(coord)
    numel = spec.numel()

    def local(input, p, training, inplace):
        if not 0.0 <= p <= 1.0:
            raise ArgumentError(f"dropout probability has to be between 0 and 1, but got {p}")
        a = _math_nn._float_input("dropout", input)
        if p == 0:
            return input
        seed, offset = _random._reserve(numel)
        out = a if inplace else None
        r = _math_nn._dropout_apply(a, p, seed, offset, spec.shape, starts, out=out)
        return input if inplace else wrap_array(r)

    return local


def attention_local(schema: OpSchema, strategy: OpStrategy) -> Callable:
    """``scaled_dot_product_attention`` with a sharded output: this block's global first
    query row and the global offsets of its attention weights go to the kernel; under the
    ring strategy, ring attention (:mod:`.ring`)."""
    ring = ring_local(schema, strategy)
    if ring is not None:
        return ring
    spec = strategy.output_specs[0]
    if not spec.is_sharded():
        return _math.scaled_dot_product_attention
    starts = spec.local_offsets(_coord(strategy))  # (..., L, Ev): Ev is never sharded
    block = _math_attention.AttentionBlock(
        starts[-2], spec.shape[:-1] + (schema.args[1].shape[-2],), starts[:-1] + (0,))

    def local(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        return _math_attention.attention_block(query, key, value, attn_mask, dropout_p,
                                               is_causal, scale, enable_gqa, block)

    return local


def attention_backward_local(schema: OpSchema, strategy: OpStrategy) -> Callable:
    """``scaled_dot_product_attention_backward`` with the query's gradient sharded on its
    sequence dim: this block's global first query row goes to the kernel (the causal mask
    is the global one); under the ring strategy, ring attention's backward (:mod:`.ring`)."""
    ring = ring_backward_local(schema, strategy)
    if ring is not None:
        return ring
    spec = strategy.output_specs[0]  # the query's gradient (..., L, E)
    row = spec.local_offsets(_coord(strategy))[-2] if spec.is_sharded() else 0
    if not row:
        return _math.scaled_dot_product_attention_backward

    def local(grad, query, key, value, is_causal, scale, enable_gqa):
        return _math_attention.attention_backward_block(grad, query, key, value, is_causal,
                                                        scale, enable_gqa, row)

    return local


def index_local(schema: OpSchema, strategy: OpStrategy) -> Callable:
    """An index argument (replicated) cut to this shard's block on the dims where the
    output is sharded: the candidates shard the output only where it has the index's and the
    input's size."""
    kernel = OPS[schema.op].kernel
    spec = strategy.output_specs[0]
    if not spec.is_sharded():
        return kernel
    plain = tuple(R if p.is_partial() else p for p in spec.placements)
    cut = local_slices(spec.shape, spec.mesh.shape, plain, _coord(strategy))
    sharded = {p.dim for p in plain if p.is_shard()}
    # only the sharded dims are cut: on another dim the index may be longer than the output
    # (a scatter's index along its dim: the output has the input's size there)
    block = tuple(c if k in sharded else slice(None) for k, c in enumerate(cut))
    pos = OPS[schema.op].params.index("indices" if schema.op == "take_along_dim" else "index")

    def local(*values):
        values = list(values)
        values[pos] = values[pos][block]
        return kernel(*values)

    return local


def _in_block(arr: np.ndarray, size: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """The entries of a global index array (into a dim of ``size``; negative ones count
    from the end) that land in the block ``[lo, hi)``: ``(inside, positions in the block,
    0 outside)``."""
    arr = arr % size if size else arr
    inside = (arr >= lo) & (arr < hi)
    return inside, np.where(inside, arr - lo, 0)


def getitem_local(schema: OpSchema, strategy: OpStrategy) -> Callable:
    """``x[idx]`` with dims of its advanced entries sharded
    (:func:`placements.index_meta.masked_index_dims`): the advanced entries become one
    integer array per indexed dim (a mask its nonzero positions), broadcast together; the
    result entries whose positions land in this block on every sharded dim are picked, the
    others zero, so that the ``P(sum)`` over the shards is the result."""
    kernel = OPS[schema.op].kernel
    shape = schema.args[0].shape
    pl = strategy.input_placements[0]
    if not any(p.is_shard() for p in pl):
        return kernel
    _, _, plan = index_plan(shape, schema.get("idx"))
    sharded = {d for d in masked_index_dims(plan) if any(p.is_shard(d) for p in pl)}
    if not sharded:
        return kernel
    coord = _coord(strategy)
    offs = local_offsets(shape, schema.mesh_shape, pl, coord)
    lens = local_shape(shape, schema.mesh_shape, pl, coord)
    out_shape = _local_out_shape(strategy)
    if any(lens[d] == 0 for d in sharded):
        return lambda input, idx: _filled(input, out_shape, 0, input.dtype)
    key: list = []
    inside: np.ndarray = np.ones((), bool)
    shapes = []
    for kind, v, d, o in plan:
        if kind in ("none", "slice"):
            key.append(v)
            continue
        at = o
        for k, arr in enumerate(np.nonzero(v) if kind == "mask" else (np.asarray(v),)):
            shapes.append(arr.shape)
            if d + k in sharded:
                ins, arr = _in_block(arr, shape[d + k], offs[d + k], offs[d + k] + lens[d + k])
                inside = inside & ins
            key.append(int(arr) if kind == "int" else arr)
    inside = np.broadcast_to(inside, np.broadcast_shapes(*shapes))
    mask = inside.reshape((1,) * at + inside.shape + (1,) * (len(out_shape) - at - inside.ndim))
    key = tuple(key)

    def local(input, idx):
        out = kernel(input, key)._arr
        xp = array_module_of(out)
        return wrap_array(xp.where(xp.asarray(mask), out, xp.zeros((), out.dtype)))

    return local


def _local_slice(s: slice, size: int, lo: int, hi: int) -> tuple[slice, slice]:
    """The part of slice ``s`` (of a dim of ``size``) that falls in ``[lo, hi)``: ``(slice
    of the block, slice of the selected positions)``."""
    start, stop, step = s.indices(size)
    n = len(range(start, stop, step))
    k0 = min(n, max(0, -(-(lo - start) // step)))
    k1 = max(k0, min(n, len(range(start, min(stop, hi), step))))
    if k1 == k0:
        return slice(0, 0), slice(0, 0)
    first, last = start + k0 * step, start + (k1 - 1) * step
    return slice(first - lo, last - lo + 1, step), slice(k0, k1)


def _write_index(schema: OpSchema) -> tuple[str, object]:
    """``(op, index)`` of a write through an index: ``x[idx] = value`` or ``index_put``."""
    if schema.op == "setitem":
        return "__setitem__", schema.get("idx")
    return "index_put", index_put_index(schema.get("indices"))


def write_index_local(schema: OpSchema, strategy: OpStrategy) -> Callable:
    """``x[idx] = value`` and ``index_put(x, indices, values, accumulate)`` (and
    ``index_put_``) with ``x`` sharded: write this block's part (see the rule,
    :func:`placements.rules.index.write_rule`).

    Ints and slices are translated to the block. When a dim of the advanced entries (index
    arrays, masks, and ints among them) is sharded, the entries broadcast together and
    those whose positions land in this block on every sharded dim are kept, as one vector
    per indexed dim (in the order, and so at the place, of the global index); the value's
    broadcast index dims are cut to the same entries.
    """
    info = OPS[schema.op]
    kernel = info.kernel
    spec = strategy.output_specs[0]
    if not spec.is_sharded():
        return kernel
    coord = _coord(strategy)
    shape = spec.shape
    offs, lens = spec.local_offsets(coord), spec.local_shape(coord)
    op, index = _write_index(schema)
    region, kept, plan = index_plan(shape, index, op)
    key: list = []
    vkey: list = [slice(None)] * len(region)  # the value's part written here
    target = list(region)  # the value's local shape before vkey (kept dims are local)
    for d, o in kept.items():
        target[o] = lens[d]
    adv = [p for p in plan if p[0] in ("mask", "array") or (p[0] == "int" and p[3] is not None)]
    dims = [k for kind, v, d, _ in adv for k in range(d, d + (v.ndim if kind == "mask" else 1))]
    if any(lens[k] != shape[k] for k in dims):
        flat = np.broadcast_arrays(*[
            a for kind, v, d, _ in adv
            for a in (np.nonzero(v) if kind == "mask" else (np.asarray(v) % shape[d],))
        ])
        inside = np.ones(flat[0].shape, bool)
        for k, a in zip(dims, flat):
            inside &= (a >= offs[k]) & (a < offs[k] + lens[k])
        local_arrays = iter([a[inside] - offs[k] for k, a in zip(dims, flat)])
        o = adv[0][3]
        vkey[o : o + inside.ndim] = [inside]  # the index dims of the value, as one
    else:
        local_arrays = None
    for kind, v, d, o in plan:
        lo = offs[d] if d < len(shape) else 0
        hi = lo + lens[d] if d < len(shape) else 0
        if kind == "none":
            key.append(None)
        elif kind == "slice":
            if lens[d] == shape[d] or d in kept:  # the value is laid out like a kept dim
                key.append(v if lens[d] == shape[d] else slice(None))
            else:
                key.append(_local_slice(v, shape[d], lo, hi)[0])
                vkey[o] = _local_slice(v, shape[d], lo, hi)[1]
        elif kind == "int" and o is None:
            if lens[d] != shape[d] and not lo <= v < hi:
                # nothing of it lands here
                return lambda input, *rest: input if info.inplace else input.clone()
            key.append(v - lo)
        elif local_arrays is None:
            key.append(v)
        else:
            key.extend(next(local_arrays) for _ in range(v.ndim if kind == "mask" else 1))
    key = tuple(key)
    vkey = tuple(vkey)
    cut = any(not (isinstance(k, slice) and k == slice(None)) for k in vkey)

    def local(input, idx, value, *rest):
        if cut and isinstance(value, Tensor):
            arr = value._arr
            value = wrap_array(array_module_of(arr).broadcast_to(arr, target)[vkey])
        return kernel(input, key, value, *rest)

    return local


def index_add_local(schema: OpSchema, strategy: OpStrategy) -> Callable:
    """``index_add(input, dim, index, source)`` with the indexed dim sharded: the source
    rows whose index lands in this block, added at their places in it."""
    kernel = OPS[schema.op].kernel
    shape = schema.args[0].shape
    pl = strategy.input_placements[0]
    d = norm_dim(schema.get("dim"), len(shape)) if shape else 0
    if not shape or not any(p.is_shard(d) for p in pl):
        return kernel
    coord = _coord(strategy)
    lo = local_offsets(shape, schema.mesh_shape, pl, coord)[d]
    n = local_shape(shape, schema.mesh_shape, pl, coord)[d]

    def local(input, dim, index, source, alpha):
        idx = index._arr.reshape(-1)
        xp = array_module_of(idx)
        if idx.size:  # against the global size, before the index is cut
            check_index_values("index_add", int(xp.min(idx)), int(xp.max(idx)), d, shape[d])
        inside = (idx >= lo) & (idx < lo + n)
        rows = wrap_array(xp.compress(inside, source._arr, axis=d))
        return kernel(input, dim, wrap_array(idx[inside] - lo), rows, alpha)

    return local
