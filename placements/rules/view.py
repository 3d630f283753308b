"""Sharding rules of view/shape ops, through a dimension-map analysis.

Every view op is described by where each output dim comes from: an input dim unchanged
(permute, transpose, unsqueeze, a full slice...), a group of input dims merged or split
(view, reshape, flatten, unflatten), or nothing (a new or broadcast dim). Candidates:

- all-Replicate, and every Partial kind kept (a view selects or copies elements, which
  commutes with any reduction);
- a Shard on an input dim that maps to an output dim unchanged carries over;
- a Shard on the FIRST input dim of a merged/split group carries over to the group's
  first output dim only when it is exact: on every mesh coordinate, the local block viewed
  locally must be the torch.chunk shard of the new global shape. This is checked from the
  sizes and the mesh shape (including nested sharding over several mesh dims) by the
  rule's ``nd_check``; uneven shards often fail it, and the input is then redistributed
  (the view never raises where it would succeed on one device);
- any other dim (sliced by ``narrow``/``select``/``[...]``, split by ``split``/``chunk``/
  ``unbind``, broadcast by ``expand``, squeezed, a non-first dim of a group) must be
  unsharded.

One rule per family, over the shared candidate builders :func:`_map_result` (a dim map)
and :func:`_reshape` (merged/split groups with their exactness check); the shapes and their
errors come from :mod:`placements.meta`, as in the local tensor:

- :func:`permute_rule`: permute, transpose/swapaxes/swapdims, t, movedim/moveaxis;
- :func:`reshape_rule`: view, reshape, flatten, unflatten;
- :func:`expand_rule`: expand, expand_as (``other`` gives its shape only: never moved);
- :func:`squeeze_rule`: squeeze, unsqueeze;
- :func:`slice_rule`: narrow, select, basic indexing (``getitem``);
- :func:`split_rule`: split, chunk, unbind (one output per piece).

The local kernels of ``view``/``reshape``/``flatten``/``unflatten``/``expand`` receive the
LOCAL output shape (the op table's ``local_fn`` computes it from the output spec).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from ..cache import memoize
from ..index_meta import index_plan, is_advanced_entry, masked_index_dims
from ..layout import shard_range
from ..meta import (
    as_dims,
    chunk_sizes,
    expand_shape,
    flatten_shape,
    index_shape,
    infer_size,
    movedim_dims,
    narrow_args,
    nonscalar_dim,
    norm_dim,
    permute_dims,
    select_args,
    split_dim,
    split_sizes,
    squeeze_dims,
    t_dims,
    transpose_dims,
    unflatten_shape,
)
from ._core import Candidate, OpSchema, P, R, RuleResult, S, register_rule

__all__ = [
    "expand_rule",
    "permute_rule",
    "reshape_groups",
    "reshape_rule",
    "slice_rule",
    "split_rule",
    "squeeze_rule",
]

_KINDS = ("sum", "avg", "max", "min")


def reshape_groups(
    a: tuple[int, ...], b: tuple[int, ...]
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Minimal groups ``(input dims, output dims)`` of equal products for ``a -> b``.

    Size-1 dims belong to no group. Needs ``prod(a) == prod(b) > 0``. **Local**.
    """
    ai = [i for i, n in enumerate(a) if n != 1]
    bj = [j for j, n in enumerate(b) if n != 1]
    groups = []
    p = q = 0
    while p < len(ai):
        gi, gj = [ai[p]], [bj[q]]
        f, t = a[ai[p]], b[bj[q]]
        p += 1
        q += 1
        while f != t:
            if f < t:
                f *= a[ai[p]]
                gi.append(ai[p])
                p += 1
            else:
                t *= b[bj[q]]
                gj.append(bj[q])
                q += 1
        groups.append((tuple(gi), tuple(gj)))
    return groups


@memoize("placements.rules.view.nested_exact", 4096)
def _nested_exact(n_in: int, rest_in: int, n_out: int, rest_out: int, ks: tuple[int, ...]) -> bool:
    """Whether splitting ``n_in`` (times ``rest_in``) and ``n_out`` (times ``rest_out``) over
    the mesh dims of sizes ``ks`` (nested, in order) gives equal blocks everywhere."""
    blocks = [(n_in, n_out)]
    for k in ks:
        nxt = []
        for bi, bo in blocks:
            for c in range(k):
                li, lo = shard_range(bi, k, c)[1], shard_range(bo, k, c)[1]
                if li * rest_in != lo * rest_out:
                    return False
                nxt.append((li, lo))
        blocks = nxt
    return True


def _map_result(
    schema: OpSchema,
    out_shapes: tuple[tuple[int, ...], ...],
    dim_map: dict[int, int],
    extra: int = 0,
    nd_check=None,
) -> RuleResult:
    """Candidates of a view: Shard(d) -> Shard(dim_map[d]), all Partial kinds kept."""
    n_out = len(out_shapes)
    none = (None,) * extra
    cands = [Candidate((R,) * (n_out + 1) + none)]
    for d in sorted(dim_map):
        cands.append(Candidate((S(dim_map[d]),) * n_out + (S(d),) + none))
    for k in _KINDS:
        cands.append(Candidate((P(k),) * (n_out + 1) + none))
    dtype = schema.args[0].dtype  # type: ignore[union-attr]
    return RuleResult(out_shapes, (dtype,) * n_out, tuple(cands), nd_check)


def _reshape(schema: OpSchema, shape_in: tuple[int, ...], shape_out: tuple[int, ...]) -> RuleResult:
    """Rule of a reshape ``shape_in -> shape_out`` (equal numel)."""
    if math.prod(shape_in) == 0:
        return _map_result(schema, (shape_out,), {})
    groups = reshape_groups(shape_in, shape_out)
    dim_map: dict[int, int] = {}
    merged: dict[int, tuple[int, int, int]] = {}  # first input dim -> (out dim, rest_in, rest_out)
    for gi, gj in groups:
        dim_map[gi[0]] = gj[0]
        if len(gi) > 1 or len(gj) > 1:
            rest_in = math.prod(shape_in[d] for d in gi[1:])
            rest_out = math.prod(shape_out[d] for d in gj[1:])
            merged[gi[0]] = (gj[0], rest_in, rest_out)
    mesh_shape = schema.mesh_shape

    def nd_check(combo: tuple[Candidate, ...]) -> bool:
        for d, (o, rest_in, rest_out) in merged.items():
            sd = S(d)
            ks = tuple(mesh_shape[m] for m, c in enumerate(combo) if c.placements[1] == sd)
            if ks and not _nested_exact(shape_in[d], rest_in, shape_out[o], rest_out, ks):
                return False
        return True

    return _map_result(schema, (shape_out,), dim_map, nd_check=nd_check if merged else None)


def _keep_except(ndim: int, removed: Sequence[int], keep_dim: bool = False) -> dict[int, int]:
    """Dim map of an op that removes (or, with ``keep_dim``, only unshards) some dims."""
    out, j = {}, 0
    for d in range(ndim):
        if d in removed:
            j += keep_dim
            continue
        out[d] = j
        j += 1
    return out


@register_rule(
    "permute", "transpose", "swapaxes", "swapdims", "t", "movedim", "moveaxis",
    static={
        "permute": ("dims",),
        **{op: ("dim0", "dim1") for op in ("transpose", "swapaxes", "swapdims")},
        **{op: ("source", "destination") for op in ("movedim", "moveaxis")},
    },
)
def permute_rule(schema: OpSchema) -> RuleResult:
    """Rule of the dim permutations: a Shard follows its dim. **Local**."""
    op, get = schema.op, schema.get
    shape = schema.args[0].shape  # type: ignore[union-attr]
    ndim = len(shape)
    if op == "permute":
        perm = permute_dims(ndim, get("dims"))
    elif op == "t":
        perm = t_dims(ndim)
    elif op in ("movedim", "moveaxis"):
        perm = movedim_dims(ndim, get("source"), get("destination"))
    else:
        perm = transpose_dims(ndim, get("dim0"), get("dim1"), op)
    out = tuple(shape[d] for d in perm)
    return _map_result(schema, (out,), {d: j for j, d in enumerate(perm)})


@register_rule(
    static={
        "view": ("shape",),
        "reshape": ("shape",),
        "flatten": ("start_dim", "end_dim"),
        "unflatten": ("dim", "sizes"),
    }
)
def reshape_rule(schema: OpSchema) -> RuleResult:
    """Rule of the reshapes: groups of dims merged or split (see :func:`_reshape`). **Local**."""
    op, get = schema.op, schema.get
    shape = schema.args[0].shape  # type: ignore[union-attr]
    if op == "flatten":
        out = flatten_shape(shape, get("start_dim", 0), get("end_dim", -1))
    elif op == "unflatten":
        out = unflatten_shape(shape, get("dim"), get("sizes"))
    else:
        out = infer_size(as_dims(get("shape")), math.prod(shape))
    return _reshape(schema, shape, out)


@register_rule("expand", "expand_as", static={"expand": ("sizes",)})
def expand_rule(schema: OpSchema) -> RuleResult:
    """Rule of ``expand``/``expand_as``: a Shard on a dim that keeps its size carries over;
    a broadcast (size-1) dim and the new leading dims are unsharded. **Local**."""
    shape = schema.args[0].shape  # type: ignore[union-attr]
    if schema.op == "expand":
        out = expand_shape(shape, as_dims(schema.get("sizes")))
    else:
        out = expand_shape(shape, schema.args[1].shape)  # type: ignore[union-attr]
    lead = len(out) - len(shape)
    dim_map = {d: lead + d for d in range(len(shape)) if out[lead + d] == shape[d]}
    return _map_result(schema, (out,), dim_map, extra=int(schema.op == "expand_as"))


@register_rule("squeeze", "unsqueeze", static=("dim",))
def squeeze_rule(schema: OpSchema) -> RuleResult:
    """Rule of ``squeeze``/``unsqueeze``: the other dims keep their Shard. **Local**."""
    shape = schema.args[0].shape  # type: ignore[union-attr]
    ndim = len(shape)
    if schema.op == "unsqueeze":
        d = norm_dim(schema.get("dim"), ndim + 1, "unsqueeze")
        out = shape[:d] + (1,) + shape[d:]
        return _map_result(schema, (out,), {i: i + (i >= d) for i in range(ndim)})
    removed = squeeze_dims(shape, schema.get("dim"))
    out = tuple(n for d, n in enumerate(shape) if d not in removed)
    return _map_result(schema, (out,), _keep_except(ndim, removed))


@register_rule(
    static={"narrow": ("dim", "start", "length"), "select": ("dim", "index"), "getitem": ("idx",)}
)
def slice_rule(schema: OpSchema) -> RuleResult:
    """Rule of ``narrow``, ``select`` and indexing: a sliced or indexed dim is unsharded, a
    dim kept whole keeps its Shard; every Partial kind passes (indexing selects). **Local**.

    Advanced indexing (integer or bool tensors, ndarrays, lists, on any dims) reads the
    index, which every rank holds whole (a local value), so each rank indexes its block of
    the dims kept whole with the global indices (:func:`placements.index_meta.index_plan`);
    a DTensor inside an index is refused by its ``__array__``. A dim indexed by an advanced
    entry (an integer array, a mask, an int among arrays; one or several, broadcasting
    together) may also stay sharded, one candidate per such dim
    (:func:`placements.index_meta.masked_index_dims`): each rank keeps the result entries
    whose positions land in its block on every sharded indexed dim and zeros the others, a
    ``P(sum)`` result over the mesh dims that shard indexed dims
    (:func:`dtensor.ops.shard_kernels.getitem_local`); the all-reduce this defers counts in the
    candidate's cost (one per such mesh dim), against gathering the indexed dims.
    """
    op, get = schema.op, schema.get
    shape = schema.args[0].shape  # type: ignore[union-attr]
    ndim = len(shape)
    if op == "narrow":
        d, _, length = narrow_args(shape, get("dim"), get("start"), get("length"))
        out = shape[:d] + (length,) + shape[d + 1 :]
        return _map_result(schema, (out,), _keep_except(ndim, [d], keep_dim=True))
    if op == "select":
        d, _ = select_args(shape, get("dim"), get("index", 0))
        return _map_result(schema, (shape[:d] + shape[d + 1 :],), _keep_except(ndim, [d]))
    key = get("idx")
    if not any(is_advanced_entry(it) for it in (key if isinstance(key, tuple) else (key,))):
        out, dim_map = index_shape(shape, key)
        return _map_result(schema, (out,), dim_map)
    out, dim_map, plan = index_plan(shape, key)
    result = _map_result(schema, (out,), dim_map)
    dims = masked_index_dims(plan)
    if not dims:
        return result
    # an indexed dim kept sharded: local indexing with masking, a P(sum) to reduce later
    reduces = (math.prod(out),)
    masked = tuple(Candidate((P("sum"), S(d)), reduces=reduces) for d in dims)
    return replace(result, candidates=result.candidates + masked)


@register_rule(
    static={
        "split": ("split_size_or_sections", "dim"),
        "chunk": ("chunks", "dim"),
        "unbind": ("dim",),
    }
)
def split_rule(schema: OpSchema) -> RuleResult:
    """Rule of ``split``/``chunk``/``unbind``: one output per piece, the split dim unsharded
    (``unbind`` removes it). **Local**."""
    op, get = schema.op, schema.get
    shape = schema.args[0].shape  # type: ignore[union-attr]
    ndim = len(shape)
    if op == "unbind":
        d = nonscalar_dim(get("dim", 0), ndim, op)
        outs = tuple(shape[:d] + shape[d + 1 :] for _ in range(shape[d]))
        return _map_result(schema, outs, _keep_except(ndim, [d]))
    d = split_dim(ndim, get("dim", 0), op)
    if op == "chunk":
        sizes = chunk_sizes(shape[d], get("chunks"))
    else:
        sizes = split_sizes(shape[d], get("split_size_or_sections"), d)
    outs = tuple(shape[:d] + (n,) + shape[d + 1 :] for n in sizes)
    return _map_result(schema, outs, _keep_except(ndim, [d], keep_dim=True))
