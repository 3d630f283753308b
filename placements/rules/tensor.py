"""Sharding rules of tensor-building ops: cat, stack, fill_, zero_, copy_, triu/tril,
flip, roll, repeat/tile.

- ``cat``: the concatenated dim must be unsharded; the other dims keep a Shard shared by
  every input; every Partial kind passes through (concatenation is linear and selects).
- ``stack``: a Shard moves past the new dim; every Partial kind passes through.
- ``fill_``: a Shard or Replicate keeps; on ``P(sum)`` the value is split like a scalar
  operand (the holder writes it, the others write 0); on ``P(avg/max/min)`` every
  coordinate writes it. ``zero_`` keeps any placement. ``copy_`` lays the source out like
  the destination (broadcast dims of the source replicated).
- ``triu``/``tril`` need the last two dims unsharded, ``flip``/``roll`` the moved dims
  (``roll`` without dims: every dim), ``repeat``/``tile`` every repeated dim.
"""

from __future__ import annotations

import operator

from ..errors import ShardingError
from ..meta import broadcast_shapes, norm_dim, norm_dims, result_dtype
from ._core import (
    Candidate,
    OpSchema,
    P,
    R,
    RuleResult,
    S,
    pointwise_candidates,
    register_rule,
)
from .pointwise import cast_partials, inplace_result

__all__ = ["cat_rule", "fill_rule", "move_rule", "repeat_rule"]

_KINDS = ("sum", "avg", "max", "min")


def _keep_rule(
    schema: OpSchema, shape: tuple[int, ...], dim_map: dict[int, int], n_args: int = 1
) -> RuleResult:
    """Candidates of an op whose every argument is laid out alike (``dim_map``: input dim
    -> output dim for the dims that may stay sharded); every Partial kind passes."""
    cands = [Candidate((R,) * (1 + n_args))]
    cands.extend(Candidate((S(o),) + (S(d),) * n_args) for d, o in sorted(dim_map.items()))
    cands.extend(Candidate((P(k),) * (1 + n_args)) for k in _KINDS)
    dtype = result_dtype(schema.args, schema.default_float)
    return RuleResult((shape,), (dtype,), tuple(cands))


@register_rule("cat", "concat", "concatenate", "stack", static=("dim",))
def cat_rule(schema: OpSchema) -> RuleResult:
    """Rule of ``cat``/``stack`` over a list of tensors. **Local**."""
    args = schema.args
    if not args:
        raise ShardingError(f"{schema.op}: expected a non-empty list of tensors")
    shape = args[0].shape  # type: ignore[union-attr]
    ndim = len(shape)
    if schema.op == "stack":
        d = norm_dim(schema.get("dim", 0), ndim + 1, schema.op)
        for a in args:
            if a.shape != shape:  # type: ignore[union-attr]
                raise ShardingError(
                    f"stack expects each tensor to be equal size, but got {shape} and "
                    f"{a.shape}"  # type: ignore[union-attr]
                )
        out = shape[:d] + (len(args),) + shape[d:]
        return _keep_rule(schema, out, {i: i + (i >= d) for i in range(ndim)}, len(args))
    # Legacy rule kept from PyTorch: 1-D empty tensors are skipped (never moved).
    kept = [a for a in args if a.shape != (0,)]  # type: ignore[union-attr]
    if not kept:
        return _keep_rule(schema, (0,), {}, len(args))
    shape = kept[0].shape  # type: ignore[union-attr]
    ndim = len(shape)
    if ndim == 0:
        raise ShardingError(f"{schema.op}: zero-dimensional tensor cannot be concatenated")
    d = norm_dim(schema.get("dim", 0), ndim, schema.op)
    for a in kept:
        s = a.shape  # type: ignore[union-attr]
        if len(s) != ndim or s[:d] + s[d + 1 :] != shape[:d] + shape[d + 1 :]:
            raise ShardingError(
                f"{schema.op}: sizes of tensors must match except in dimension {d}: got "
                + ", ".join(str(b.shape) for b in args)  # type: ignore[union-attr]
            )
    out = shape[:d] + (sum(a.shape[d] for a in kept),) + shape[d + 1 :]  # type: ignore[union-attr]
    result = _keep_rule(schema, out, {i: i for i in range(ndim) if i != d}, len(args))
    if len(kept) == len(args):
        return result
    skip = [a.shape == (0,) for a in args]  # type: ignore[union-attr]
    return RuleResult(
        result.out_shapes,
        result.out_dtypes,
        tuple(
            Candidate(
                (c.placements[0], *(None if k else p for k, p in zip(skip, c.placements[1:])))
            )
            for c in result.candidates
        ),
    )


@register_rule("fill_", "zero_", "copy_")
def fill_rule(schema: OpSchema) -> RuleResult:
    """Rule of the in-place writes ``fill_``, ``zero_`` and ``copy_``. **Local**."""
    op = schema.op
    a = schema.args[0]
    shape = a.shape  # type: ignore[union-attr]
    if op == "zero_":
        cands = [Candidate((R, R))]
        cands.extend(Candidate((S(d), S(d))) for d in range(len(shape)))
        cands.extend(Candidate((P(k), P(k))) for k in _KINDS)
    elif op == "fill_":
        cands = pointwise_candidates(shape, schema.args[:2], [("sum", ("sum", "sum"))])
        cands.extend(Candidate((P(k), P(k), R)) for k in ("avg", "max", "min"))
    else:
        src = schema.args[1]
        if broadcast_shapes(op, [src.shape, shape]) != shape:  # type: ignore[union-attr]
            raise ShardingError(
                f"copy_: source of shape {src.shape} cannot be broadcast to {shape}"  # type: ignore[union-attr]
            )
        # a Partial source survives the copy when the cast to ``a``'s dtype commutes
        kinds = [k for k, _ in cast_partials(src.dtype, a.dtype)]  # type: ignore[union-attr]
        cands = pointwise_candidates(shape, (a, src), [(k, (k, k)) for k in kinds])
    result = RuleResult((shape,), (a.dtype,), tuple(cands))  # type: ignore[union-attr]
    return inplace_result(schema, result)


def _moved_dims(op: str, schema: OpSchema, ndim: int) -> set[int]:
    if op in ("triu", "tril"):
        if ndim < 2:
            raise ShardingError(f"{op}: input tensor must have at least 2 dimensions")
        return {ndim - 2, ndim - 1}
    dims = schema.get("dims")
    if dims is None:
        return set(range(ndim))
    dims = (dims,) if hasattr(dims, "__index__") else tuple(dims)  # type: ignore[arg-type]
    if op == "flip":  # the local kernel's checks: no dim twice; no dims, nothing flipped
        return set(norm_dims(op, dims, ndim)) if dims else set()
    return {norm_dim(d, ndim, op) for d in dims}


@register_rule("triu", "tril", "flip", "roll", static={"flip": ("dims",), "roll": ("dims",)})
def move_rule(schema: OpSchema) -> RuleResult:
    """Rule of ops that move elements within some dims: those dims unsharded. **Local**."""
    a = schema.args[0]
    ndim = len(a.shape)  # type: ignore[union-attr]
    moved = _moved_dims(schema.op, schema, ndim)
    return _keep_rule(schema, a.shape, {d: d for d in range(ndim) if d not in moved})  # type: ignore[union-attr]


@register_rule(static={"repeat": ("sizes",), "tile": ("dims",)})
def repeat_rule(schema: OpSchema) -> RuleResult:
    """Rule of ``repeat``/``tile``: a dim repeated more than once is unsharded. **Local**."""
    a = schema.args[0]
    shape = a.shape  # type: ignore[union-attr]
    sizes = schema.get("sizes") if schema.op == "repeat" else schema.get("dims")
    sizes = tuple(operator.index(s) for s in (sizes if hasattr(sizes, "__iter__") else (sizes,)))  # type: ignore[union-attr]
    if schema.op == "tile" and len(sizes) < len(shape):
        sizes = (1,) * (len(shape) - len(sizes)) + sizes
    if len(sizes) < len(shape):
        raise ShardingError(
            f"repeat: number of dimensions of repeat dims ({len(sizes)}) can not be smaller "
            f"than number of dimensions of tensor ({len(shape)})"
        )
    lead = len(sizes) - len(shape)
    padded = (1,) * lead + shape
    out = tuple(n * r for n, r in zip(padded, sizes))
    keep = {d: d + lead for d in range(len(shape)) if sizes[d + lead] == 1}
    return _keep_rule(schema, out, keep)
