"""Sharding rules of neural-network ops: softmax, log_softmax, layer_norm, embedding,
cross_entropy, mse_loss, dropout.

- ``softmax``/``log_softmax``: the other dims keep their Shard (the softmax dim: below).
- ``layer_norm``: the normalized (trailing) dims unsharded; weight and bias replicated.
- ``embedding(indices, weight)``: indices sharded -> output sharded alike (weight
  replicated); weight sharded on the embedding dim -> output sharded on its last dim;
  weight sharded on the vocabulary (rows) -> ``P(sum)``: the local kernel looks up only
  the local rows, masking indices outside them to zero (PyTorch's MaskPartial), so the sum
  over coordinates is the lookup; a Partial weight passes through (a lookup selects).
- ``cross_entropy``: the batch (and spatial) dims of input and target shard alike:
  ``reduction='none'`` keeps the Shard, ``'sum'`` gives ``P(sum)``. ``'mean'`` divides by
  the number of non-ignored targets, which a shard cannot know without communication: it
  needs the batch dims unsharded (documented choice). The class dim may stay sharded
  (vocab-parallel, PyTorch's ``loss_parallel``): the kernel all-reduces the per-sample
  maximum, then in one all-reduce the sums of exponentials and the target logits (picked
  on the shard that holds the class, zero elsewhere), so every shard ends with the whole
  loss (Replicate); the logits are never gathered. The candidate declares those two
  all-reduces, so the cost model takes it only where they cost less than gathering the
  logits (large class counts).
- ``softmax``/``log_softmax`` along a sharded dim: likewise, the row maxima and sums
  all-reduced in the kernel, the output sharded as the input (this keeps the backward of
  a vocab-parallel loss sharded).
- ``mse_loss``: elementwise then reduced: ``'none'`` keeps Shards, ``'sum'`` gives
  ``P(sum)`` and ``'mean'`` too (its local kernel divides the local sum by the global
  element count, exact on uneven shards).
- ``dropout``: every placement kept, Partial included (the mask is a function of the
  global element index, the same on every coordinate that holds an element, and the
  scale is positive); in eval mode it is the identity.
"""

from __future__ import annotations

import math

from ..errors import ArgumentError, ShardingError
from ..meta import (
    as_dtype,
    broadcast_shapes,
    check_embedding_indices,
    dtype_kind,
    norm_dim,
    result_dtype,
)
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

__all__ = ["nn_rule"]

_KINDS = ("sum", "avg", "max", "min")


def _softmax(schema: OpSchema) -> RuleResult:
    a = schema.args[0]
    ndim = len(a.shape)  # type: ignore[union-attr]
    d = norm_dim(schema.get("dim"), ndim, schema.op)
    dtype = schema.get("dtype")
    dt = a.dtype if dtype is None else as_dtype(dtype, schema.default_float)  # type: ignore[union-attr]
    cands = [Candidate((R, R))]
    cands.extend(Candidate((S(i), S(i))) for i in range(ndim) if i != d)
    if ndim:  # the softmax dim sharded: the row maxima and sums all-reduced in the kernel
        rows = math.prod(a.shape) // max(a.shape[d], 1)  # type: ignore[union-attr]
        cands.append(Candidate((S(d), S(d)), reduces=(rows, rows), collective=True))
    return RuleResult((a.shape,), (dt,), tuple(cands))  # type: ignore[union-attr]


def _layer_norm(schema: OpSchema) -> RuleResult:
    args = schema.args + (None,) * (3 - len(schema.args))
    x, w, b = args[:3]
    ns = schema.get("normalized_shape")
    ns = (ns,) if isinstance(ns, int) else tuple(ns)  # type: ignore[arg-type]
    ndim = len(x.shape)  # type: ignore[union-attr]
    if ndim < len(ns) or tuple(x.shape[ndim - len(ns) :]) != ns:  # type: ignore[union-attr]
        raise ShardingError(
            f"layer_norm: normalized_shape {list(ns)} does not match the trailing dims of the "
            f"input of shape {x.shape}"  # type: ignore[union-attr]
        )
    wb = tuple(None if t is None else R for t in (w, b))
    cands = [Candidate((R, R, *wb))]
    cands.extend(Candidate((S(d), S(d), *wb)) for d in range(ndim - len(ns)))
    dtype = result_dtype((x, w, b), schema.default_float)
    return RuleResult((x.shape,), (dtype,), tuple(cands))  # type: ignore[union-attr]


def _embedding(schema: OpSchema) -> RuleResult:
    idx, w = schema.args[:2]
    check_embedding_indices(idx.dtype)  # type: ignore[union-attr]
    if len(w.shape) != 2:  # type: ignore[union-attr]
        raise ShardingError(f"embedding: weight must be 2-D, got shape {w.shape}")  # type: ignore[union-attr]
    nd = len(idx.shape)  # type: ignore[union-attr]
    rest = (None,) * (len(schema.args) - 2)
    cands = [Candidate((R, R, R, *rest))]
    cands.extend(Candidate((S(d), S(d), R, *rest)) for d in range(nd))
    cands.append(Candidate((S(nd), R, S(1), *rest)))
    cands.append(Candidate((P("sum"), R, S(0), *rest)))
    cands.extend(Candidate((P(k), R, P(k), *rest)) for k in _KINDS)
    out = idx.shape + (w.shape[1],)  # type: ignore[union-attr]
    return RuleResult((out,), (w.dtype,), tuple(cands))  # type: ignore[union-attr]


def _cross_entropy(schema: OpSchema) -> RuleResult:
    args = schema.args + (None,) * (3 - len(schema.args))
    x, t, w = args[:3]
    rest = (None,) * (len(schema.args) - 3)
    reduction = schema.get("reduction", "mean")
    if reduction not in ("mean", "sum", "none"):
        raise ArgumentError(f"cross_entropy: {reduction!r} is not a valid value for reduction")
    xs, ts = x.shape, t.shape  # type: ignore[union-attr]
    c_dim = 1 if len(xs) >= 2 else 0
    probs = dtype_kind(t.dtype) in "fc"  # type: ignore[union-attr]
    per_sample = xs[:c_dim] + xs[c_dim + 1 :]
    if (ts != xs) if probs else (ts != per_sample):
        raise ShardingError(
            f"cross_entropy: target of shape {ts} does not match input of shape {xs}"
        )
    wp = None if w is None else R
    cands = [Candidate((R, R, R, wp, *rest))]
    if reduction != "mean":
        for d in range(len(xs)):
            if d == c_dim:
                continue
            od = d if d < c_dim else d - 1
            out_p = S(od) if reduction == "none" else P("sum")
            cands.append(Candidate((out_p, S(d), S(d) if probs else S(od), wp, *rest)))
    # vocab-parallel: the class dim sharded, the target whole (probabilities: sharded
    # alike); the kernel all-reduces the per-sample maximum, then its sums
    n = math.prod(per_sample)
    sums = (n, 3 * n if probs else 2 * n)
    cands.append(Candidate((R, S(c_dim), S(c_dim) if probs else R, wp, *rest), reduces=sums,
                           collective=True))
    out = per_sample if reduction == "none" else ()
    dtype = result_dtype((x,), schema.default_float)
    return RuleResult((out,), (dtype,), tuple(cands))


def _mse_loss(schema: OpSchema) -> RuleResult:
    x, t = schema.args[:2]
    reduction = schema.get("reduction", "mean")
    if reduction not in ("mean", "sum", "none"):
        raise ArgumentError(f"mse_loss: {reduction!r} is not a valid value for reduction")
    shape = broadcast_shapes("mse_loss", [x.shape, t.shape])  # type: ignore[union-attr]
    cands = pointwise_candidates(shape, (x, t))
    dtype = result_dtype((x, t), schema.default_float)
    if reduction == "none":
        return RuleResult((shape,), (dtype,), tuple(cands))
    cands = [cands[0]] + [Candidate((P("sum"), *c.placements[1:])) for c in cands[1:]]
    return RuleResult(((),), (dtype,), tuple(cands))


def _dropout(schema: OpSchema) -> RuleResult:
    a = schema.args[0]
    cands = pointwise_candidates(a.shape, (a,), [(k, (k,)) for k in _KINDS])  # type: ignore[union-attr]
    return RuleResult((a.shape,), (a.dtype,), tuple(cands))  # type: ignore[union-attr]


_NN = {
    "softmax": _softmax,
    "log_softmax": _softmax,
    "layer_norm": _layer_norm,
    "embedding": _embedding,
    "cross_entropy": _cross_entropy,
    "mse_loss": _mse_loss,
    "dropout": _dropout,
}


# the static arguments each nn op reads (dropout's ``training`` is read by its local kernel)
_STATIC = {
    "softmax": ("dim", "dtype"),
    "log_softmax": ("dim", "dtype"),
    "layer_norm": ("normalized_shape",),
    "cross_entropy": ("reduction",),
    "mse_loss": ("reduction",),
    "dropout": ("training",),
}


@register_rule(*_NN, static=_STATIC)
def nn_rule(schema: OpSchema) -> RuleResult:
    """Rule of the nn ops (see the module docstring). **Local**."""
    return _NN[schema.op](schema)
