"""Sharding rules of the indexing ops: index_select, gather, scatter, scatter_add,
take_along_dim, masked_fill, sort, argsort, topk, kthvalue, index_add, index_put, and
``x[idx] = value``.

Index arguments stay replicated in every candidate: every rank then holds the whole index,
checks its values against the global size and raises alike (an out-of-range index seen
by one rank only would leave the others waiting in the next collective). Where the data is
sharded on a dim the op does not index, each rank uses the index's rows of its own shard
(the op table's ``local_fn`` slices them, :func:`dtensor.ops.shard_kernels.index_local`).

- ``index_select``/``gather``/``take_along_dim``: the indexed dim unsharded; another dim
  keeps a Shard where the index (and output) has that dim at full size; every Partial kind
  passes (selecting elements commutes with any reduction).
- ``scatter``: the scattered dim unsharded; input, src and output share a Shard on another
  dim of one size; input and src of one Partial kind give that kind (a rank's write
  replaces its contribution by src's). ``scatter_add`` keeps ``P(sum)``/``P(avg)`` only.
- ``masked_fill``: elementwise over input and mask; ``P(sum)`` takes the value once
  (split like a scalar operand), ``P(avg/max/min)`` everywhere.
- ``sort``/``argsort``/``topk``/``kthvalue``: the sorted dim unsharded, other dims keep
  their Shard; no Partial.
- ``setitem`` (``x[idx] = value``, in place) and ``index_put``/``index_put_`` (the same
  write, ``accumulate=True`` adding instead): every dim may stay sharded. A dim kept whole
  keeps its Shard, with the value sharded alike where it has that dim at full size; a dim
  indexed by ints, slices or index arrays (one or several, masks included) stays sharded
  with the value replicated: each rank writes its own block's part, the entries of the
  broadcast index arrays that land in its block and the matching part of the value
  (:func:`dtensor.ops.shard_kernels.write_index_local`); ``P(sum)`` takes the value once, as
  a write or an accumulation of ``P(sum)`` parts, ``P(avg/max/min)`` everywhere (adding
  one value to every part commutes with those reductions).
- ``index_add``/``index_add_``: another dim than the indexed one keeps a Shard shared by
  input, source and output; the indexed dim may stay sharded with the source replicated:
  each rank adds the source rows whose index lands in its block
  (:func:`dtensor.ops.shard_kernels.index_add_local`); ``P(sum)``/``P(avg)`` pass (linear).

Shapes and argument checks come from :mod:`placements.index_meta`, as in the local kernels.
"""

from __future__ import annotations

import numpy as np

from ..index_meta import (
    gather_shape,
    index_add_check,
    index_put_check,
    index_select_shape,
    kthvalue_shape,
    masked_fill_check,
    scatter_check,
    sort_dim,
    take_along_dim_shape,
    topk_shape,
    write_check,
)
from ._core import Candidate, OpSchema, P, R, RuleResult, S, pointwise_candidates, register_rule
from .pointwise import inplace_result

__all__ = [
    "index_add_rule",
    "masked_fill_rule",
    "scatter_rule",
    "select_rule",
    "sort_rule",
    "write_rule",
]

_KINDS = ("sum", "avg", "max", "min")
_INT64 = np.dtype(np.int64)


def _selection(
    out: tuple[int, ...],
    dtype: np.dtype,
    shards: list[int],
    n_args: int,
) -> RuleResult:
    """Candidates of ``op(input, index...)``: R; S(d) on input and output for each dim of
    ``shards`` (the index replicated); every Partial kind of the input."""
    idx = (R,) * (n_args - 1)
    cands = [Candidate((R, R) + idx)]
    cands.extend(Candidate((S(d), S(d)) + idx) for d in shards)
    cands.extend(Candidate((P(k), P(k)) + idx) for k in _KINDS)
    return RuleResult((out,), (dtype,), tuple(cands))


@register_rule(static={"index_select": ("dim",), "gather": ("dim",),
                       "take_along_dim": ("dim",)})
def select_rule(schema: OpSchema) -> RuleResult:
    """Rule of ``index_select``, ``gather`` and ``take_along_dim``. **Local**."""
    a, index = schema.args[0], schema.args[1]
    shape = a.shape  # type: ignore[union-attr]
    dim = schema.get("dim")
    if schema.op == "index_select":
        out, d = index_select_shape(shape, dim, index.shape, index.dtype)  # type: ignore[union-attr]
        shards = [k for k in range(len(shape)) if k != d]
    elif schema.op == "gather":
        out, d = gather_shape(shape, dim, index.shape, index.dtype)  # type: ignore[union-attr]
        shards = [k for k in range(len(shape)) if k != d and out[k] == shape[k]]
    else:
        out, d = take_along_dim_shape(shape, index.shape, index.dtype, dim)  # type: ignore[union-attr]
        shards = [] if d is None else [
            k for k in range(len(shape))
            if k != d and out[k] == shape[k] == index.shape[k]  # type: ignore[union-attr]
        ]
    return _selection(out, a.dtype, shards, 2)  # type: ignore[union-attr]


@register_rule(static={"scatter": ("dim",), "scatter_add": ("dim",), "scatter_": ("dim",),
                       "scatter_add_": ("dim",)})
def scatter_rule(schema: OpSchema) -> RuleResult:
    """Rule of ``scatter`` and ``scatter_add`` (args: input, index, src) and their in-place
    forms. **Local**."""
    op = schema.op.rstrip("_")
    a, index, src = schema.args[0], schema.args[1], schema.args[2]
    shape = a.shape  # type: ignore[union-attr]
    scalar = src is None or src.is_scalar
    d = scatter_check(
        op, shape, a.dtype, schema.get("dim"), index.shape, index.dtype,  # type: ignore[union-attr]
        None if scalar else src.shape, None if scalar else src.dtype,  # type: ignore[union-attr]
    )
    cands = [Candidate((R, R, R, R))]
    for k in range(len(shape)):
        if k != d and index.shape[k] == shape[k] and (scalar or src.shape[k] == shape[k]):  # type: ignore[union-attr]
            cands.append(Candidate((S(k), S(k), R, R if scalar else S(k))))
    kinds = _KINDS if op == "scatter" else ("sum", "avg")
    cands.extend(Candidate((P(k), P(k), R, P(k))) for k in kinds)
    result = RuleResult((shape,), (a.dtype,), tuple(cands))  # type: ignore[union-attr]
    return inplace_result(schema, result) if schema.op.endswith("_") else result


@register_rule("masked_fill", "masked_fill_")
def masked_fill_rule(schema: OpSchema) -> RuleResult:
    """Rule of ``masked_fill(input, mask, value)`` and ``masked_fill_``. **Local**."""
    a, mask, value = schema.args[0], schema.args[1], schema.args[2]
    shape = a.shape  # type: ignore[union-attr]
    masked_fill_check(shape, mask.shape, mask.dtype, value.shape)  # type: ignore[union-attr]
    partials = [("sum", ("sum", None, "sum"))] + [(k, (k, None, None)) for k in _KINDS[1:]]
    cands = pointwise_candidates(shape, (a, mask, value), partials)
    result = RuleResult((shape,), (a.dtype,), tuple(cands))  # type: ignore[union-attr]
    return inplace_result(schema, result) if schema.op.endswith("_") else result


@register_rule(static={"sort": ("dim",), "argsort": ("dim",), "topk": ("k", "dim"),
                       "kthvalue": ("k", "dim", "keepdim")})
def sort_rule(schema: OpSchema) -> RuleResult:
    """Rule of ``sort``, ``argsort``, ``topk`` and ``kthvalue``: the sorted dim unsharded.
    **Local**."""
    op, a = schema.op, schema.args[0]
    shape = a.shape  # type: ignore[union-attr]
    dim = schema.get("dim", -1)
    dim_map = {k: k for k in range(len(shape))}
    if op == "topk":
        out, d = topk_shape(shape, schema.get("k"), dim)
    elif op == "kthvalue":
        keepdim = bool(schema.get("keepdim", False))
        out, d = kthvalue_shape(shape, schema.get("k"), dim, keepdim)
        if not keepdim:
            dim_map = {k: k - (k > d) for k in range(len(shape))}
    else:
        out, d = shape, sort_dim(op, shape, dim)
    if shape:
        del dim_map[d]
    n_out = 1 if op == "argsort" else 2
    cands = [Candidate((R,) * (n_out + 1))]
    cands.extend(Candidate((S(o),) * n_out + (S(k),)) for k, o in sorted(dim_map.items()))
    dtypes = (_INT64,) if op == "argsort" else (a.dtype, _INT64)  # type: ignore[union-attr]
    return RuleResult((out,) * n_out, dtypes, tuple(cands))


@register_rule(static={"setitem": ("idx",), "index_put": ("indices", "accumulate"),
                       "index_put_": ("indices", "accumulate")})
def write_rule(schema: OpSchema) -> RuleResult:
    """Rule of ``x[idx] = value`` (``setitem``, args: input, value; in place) and of
    ``index_put(input, indices, values, accumulate)`` and ``index_put_``. **Local**."""
    a, value = schema.args[0], schema.args[1]
    shape = a.shape  # type: ignore[union-attr]
    vshape = value.shape  # type: ignore[union-attr]
    if schema.op == "setitem":
        region, kept, _ = write_check("__setitem__", shape, schema.get("idx"), vshape)
    else:
        vdtype = None if value.is_scalar else value.dtype  # type: ignore[union-attr]
        _, region, kept, _ = index_put_check(shape, a.dtype, schema.get("indices"), vshape,  # type: ignore[union-attr]
                                             vdtype)
    lead = len(region) - len(vshape)
    cands = [Candidate((R, R, R))]
    for d in range(len(shape)):
        vp = R
        if d in kept:
            o = kept[d] - lead
            vp = S(o) if o >= 0 and vshape[o] == region[kept[d]] else R
        cands.append(Candidate((S(d), S(d), vp)))
    cands.append(Candidate((P("sum"), P("sum"), P("sum"))))
    cands.extend(Candidate((P(k), P(k), R)) for k in _KINDS[1:])
    result = RuleResult((shape,), (a.dtype,), tuple(cands))  # type: ignore[union-attr]
    return result if schema.op == "index_put" else inplace_result(schema, result)


@register_rule(static={"index_add": ("dim",), "index_add_": ("dim",)})
def index_add_rule(schema: OpSchema) -> RuleResult:
    """Rule of ``index_add(input, dim, index, source)`` and ``index_add_``. **Local**."""
    a, index, src = schema.args[0], schema.args[1], schema.args[2]
    shape = a.shape  # type: ignore[union-attr]
    d = index_add_check(shape, a.dtype, schema.get("dim"), index.shape, index.dtype,  # type: ignore[union-attr]
                        src.shape, src.dtype)  # type: ignore[union-attr]
    cands = [Candidate((R, R, R, R))]
    cands.extend(Candidate((S(k), S(k), R, S(k))) for k in range(len(shape)) if k != d)
    if shape:  # the indexed dim sharded: each shard adds the rows that land in its block
        cands.append(Candidate((S(d), S(d), R, R)))
    cands.extend(Candidate((P(k), P(k), R, P(k))) for k in ("sum", "avg"))
    result = RuleResult((shape,), (a.dtype,), tuple(cands))  # type: ignore[union-attr]
    return inplace_result(schema, result) if schema.op.endswith("_") else result
