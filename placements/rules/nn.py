"""Sharding rules of neural-network ops: softmax, log_softmax, layer_norm, rms_norm,
embedding, cross_entropy, mse_loss, dropout, scaled_dot_product_attention.

- ``softmax``/``log_softmax``: the other dims keep their Shard (the softmax dim: below).
- ``layer_norm``/``rms_norm``: the normalized (trailing) dims unsharded; weight and bias
  replicated.
- ``embedding(indices, weight)``: indices sharded -> output sharded alike (weight
  replicated); weight sharded on the embedding dim -> output sharded on its last dim;
  weight sharded on the vocabulary (rows) -> ``P(sum)``: the local kernel looks up only
  the local rows, masking indices outside them to zero (PyTorch's MaskPartial), so the sum
  over coordinates is the lookup; a Partial weight passes through (a lookup selects).
- ``cross_entropy``: the batch (and spatial) dims of input and target shard alike:
  ``reduction='none'`` keeps the Shard, ``'sum'`` gives ``P(sum)`` and so does ``'mean'``:
  its local kernel divides the block's sum by the whole batch's denominator (the summed
  weights of the non-ignored targets, which a block cannot know alone: the kernel
  all-reduces that one number, and the candidate declares it; probability targets divide
  by the sample count and do not communicate). The logits are never gathered for a mean
  (PyTorch's rule averages the blocks' means, exact only for even shards without ignored
  targets). The class dim may stay sharded
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
- ``scaled_dot_product_attention(query, key, value, attn_mask)``: a batch dim (any dim
  before the last two: batch, heads) sharded alike on query, key, value, the mask and the
  output (an argument that broadcasts it is Replicate there; with ``enable_gqa`` and fewer
  key/value heads than query heads, not the heads dim); or the query's sequence dim
  sharded, key and value replicated: each block of queries attends to every key (the local
  kernel gets the block's global first row, so a causal mask stays the global one, and
  the global offsets of its attention weights, so dropout draws the global mask), the
  mask sharded alike on its query dim; or **ring attention**: query, key, value and
  output all sharded on their sequence dim (no mask, no dropout, one batch shape, a
  causal attention with as many queries as keys; on one mesh dim only, ``nd_check``):
  the kernel (``dtensor/ops/ring.py``) passes the key/value blocks around the ring of
  that mesh dim and declares them (:attr:`Candidate.passes`: ``k - 1`` blocks of key and
  value per rank, one message per step, priced as the all-gather of both that it replaces;
  the backward moves twice that, the key/value blocks again and their gradients, as the
  gathering candidate's backward gathers them again and reduce-scatters their
  gradients, so the forward's price ranks the two as a training step does). Otherwise
  keys and values sharded on their sequence dim are gathered.
- ``scaled_dot_product_attention_backward(grad, query, key, value)`` (the fused gradients
  of an attention without mask and dropout; no batch dim broadcast): a batch dim sharded
  alike everywhere (not the heads of grouped-query attention), or the query's sequence dim
  sharded on grad, query and the query's gradient, key and value replicated: each block
  of queries gives ``P(sum)`` key and value gradients (its part of the sums over queries).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from ..errors import ArgumentError, DTypeError, ShardingError
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
    with_args,
)

__all__ = ["attention_backward_shapes", "attention_shapes", "check_normalized_shape", "nn_rule"]

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


def check_normalized_shape(op: str, shape: tuple[int, ...], normalized_shape: object) -> tuple:
    """``normalized_shape`` of ``layer_norm``/``rms_norm`` (op ``op``) as a tuple, checked
    against the input's ``shape``: it must be the trailing dims. **Local**.

    Raises
    ------
    ShardingError
        PyTorch's message: ``Given normalized_shape=[7], expected input with shape [*, 7],
        but got input of size [5, 6]``, after the op's name.
    """
    ns = normalized_shape
    ns = (ns,) if isinstance(ns, int) else tuple(ns)  # type: ignore[arg-type]
    k = len(ns)
    if not k or len(shape) < k or tuple(shape[len(shape) - k :]) != ns:
        raise ShardingError(
            f"{op}: given normalized_shape={list(ns)}, expected input with shape "
            f"[*, {', '.join(map(str, ns))}], but got input of size {list(shape)}"
        )
    return ns


#: The tensor arguments of the normalizations after the input (weight, bias)
_NORM_PARAMS = {"layer_norm": 2, "rms_norm": 1}


def _norm(schema: OpSchema) -> RuleResult:
    x, *params = with_args(schema, 1 + _NORM_PARAMS[schema.op])
    shape = x.shape  # type: ignore[union-attr]
    ns = check_normalized_shape(schema.op, shape, schema.get("normalized_shape"))
    ndim = len(shape)
    wb = tuple(None if t is None else R for t in params)
    cands = [Candidate((R, R, *wb))]
    cands.extend(Candidate((S(d), S(d), *wb)) for d in range(ndim - len(ns)))
    dtype = result_dtype((x, *params), schema.default_float)
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
    # a mean of class indices: the kernel all-reduces the block's denominator (one number)
    count = (1,) if reduction == "mean" and not probs else ()
    for d in range(len(xs)):
        if d == c_dim:
            continue
        od = d if d < c_dim else d - 1
        out_p = S(od) if reduction == "none" else P("sum")
        cands.append(Candidate((out_p, S(d), S(d) if probs else S(od), wp, *rest),
                               reduces=count, collective=bool(count)))
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


_SDPA = "scaled_dot_product_attention"


def attention_shapes(query, key, value, attn_mask, enable_gqa: bool) -> tuple[tuple, tuple]:
    """``(output shape, attention weights' shape)`` of ``scaled_dot_product_attention`` on
    arguments that have a ``shape`` and a ``dtype`` (arrays, the rules' ``ArgMeta``;
    ``attn_mask`` may be None), checked as PyTorch checks them. **Local**.

    Query ``(..., L, E)``, key ``(..., S, E)`` and value ``(..., S, Ev)`` have as many dims
    and batch dims that broadcast (with ``enable_gqa``, the key's and value's head counts,
    dim -3, divide the query's); the output is ``(..., L, Ev)``, the weights
    ``(..., L, S)``, and the mask broadcasts to the weights.

    Raises
    ------
    DTypeError
        query, key and value of different or non-floating dtypes; a mask neither bool nor
        float32 nor of the query's dtype.
    ShardingError
        Shapes that do not fit.
    """
    q, k, v = query, key, value
    if not q.dtype == k.dtype == v.dtype:
        raise DTypeError(
            f"{_SDPA}: Expected query, key, and value to have the same dtype, but got "
            f"query.dtype: {q.dtype} key.dtype: {k.dtype} and value.dtype: {v.dtype} instead."
        )
    if dtype_kind(q.dtype) != "f":
        raise DTypeError(f"{_SDPA}: expected query, key and value of a floating point dtype, "
                         f"got {q.dtype}")
    nd = len(q.shape)
    if min(nd, len(k.shape), len(v.shape)) < 2:
        raise ShardingError(
            f"{_SDPA}: Expected query, key, and value to all be  at least 2 dimensional, but "
            f"got query.dim: {nd} key.dim: {len(k.shape)} and value.dim: {len(v.shape)} "
            "instead."
        )
    shapes = f"query {list(q.shape)}, key {list(k.shape)} and value {list(v.shape)}"
    if not nd == len(k.shape) == len(v.shape) or q.shape[-1] != k.shape[-1] or (
            k.shape[-2] != v.shape[-2]):
        raise ShardingError(
            f"{_SDPA}: expected query (..., L, E), key (..., S, E) and value (..., S, Ev) "
            f"with as many dims, got {shapes}"
        )
    kb, vb = list(k.shape[:-2]), list(v.shape[:-2])
    if enable_gqa and nd >= 3:
        heads = q.shape[-3]
        if heads % max(k.shape[-3], 1) or heads % max(v.shape[-3], 1):
            raise ShardingError(
                f"{_SDPA}: Number of heads in key and value must divide the number of heads "
                f"in query (enable_gqa=True), got {shapes}"
            )
        kb[-1] = vb[-1] = heads  # the key and value heads, each repeated for its group
    batch = broadcast_shapes(_SDPA, [q.shape[:-2], tuple(kb), tuple(vb)])
    weights = (*batch, q.shape[-2], k.shape[-2])
    if attn_mask is not None:
        m = attn_mask
        if dtype_kind(m.dtype) != "b" and m.dtype != np.float32 and m.dtype != q.dtype:
            raise DTypeError(
                f"{_SDPA}: Expected attn_mask dtype to be bool or float or to match query "
                f"dtype, but got attn_mask.dtype: {m.dtype} and  query.dtype: {q.dtype} "
                "instead."
            )
        tail = weights[len(weights) - len(m.shape) :]
        if len(m.shape) > len(weights) or any(a not in (1, b) for a, b in zip(m.shape, tail)):
            raise ShardingError(
                f"{_SDPA}: attn_mask of shape {list(m.shape)} does not broadcast to the "
                f"attention weights' shape {list(weights)} ({shapes})"
            )
    return (*batch, q.shape[-2], v.shape[-1]), weights


def attention_backward_shapes(grad, query, key, value, enable_gqa: bool) -> tuple[tuple, ...]:
    """The gradients' shapes (query's, key's, value's) of
    ``scaled_dot_product_attention_backward``, checked: the forward's checks, then no batch
    dim broadcast (only the key and value heads, with ``enable_gqa``, may be fewer: a
    divisor of the query's) and ``grad`` of the output's shape and the query's dtype.
    **Local**.

    Raises
    ------
    DTypeError
        Mixed or non-floating dtypes.
    ShardingError
        Shapes that do not fit.
    """
    q, k, v, g = query, key, value, grad
    name = f"{_SDPA}_backward"
    out, _ = attention_shapes(q, k, v, None, enable_gqa)
    if g.dtype != q.dtype:
        raise DTypeError(f"{name}: expected grad of the query's dtype {q.dtype}, got {g.dtype}")
    lead = q.shape[:-3] if enable_gqa and len(q.shape) >= 3 else q.shape[:-2]
    same = all(tuple(a.shape[: len(lead)]) == tuple(lead) for a in (k, v))
    if not same or tuple(out[:-2]) != tuple(q.shape[:-2]) or tuple(g.shape) != tuple(out):
        raise ShardingError(
            f"{name}: expected query (..., L, E), key (..., S, E), value (..., S, Ev) with the "
            f"same batch dims (no broadcasting) and grad (..., L, Ev), got query "
            f"{list(q.shape)}, key {list(k.shape)}, value {list(v.shape)}, grad "
            f"{list(g.shape)}"
        )
    return tuple(q.shape), tuple(k.shape), tuple(v.shape)


def _attention_backward(schema: OpSchema) -> RuleResult:
    g, q, k, v = with_args(schema, 4)
    gqa = bool(schema.get("enable_gqa", False))
    shapes = attention_backward_shapes(g, q, k, v, gqa)
    nd = len(q.shape)
    cands = [Candidate((R,) * 7)]
    for d in range(nd - 2):
        if gqa and d == nd - 3 and k.shape[d] != q.shape[d]:
            continue  # grouped heads: each key/value head serves several query heads
        cands.append(Candidate((S(d),) * 7))
    # a block of queries: its own query gradient, its part of the key and value gradients
    L = S(nd - 2)
    cands.append(Candidate((L, P("sum"), P("sum"), L, L, R, R)))
    if tuple(k.shape[:-2]) == tuple(q.shape[:-2]) == tuple(v.shape[:-2]) and not (
            schema.get("is_causal", False) and q.shape[-2] != k.shape[-2]):
        # ring attention's backward: the key/value blocks pass again (their gradients
        # follow them, in place of the reduce-scatter of the candidate above's P(sum))
        cands.append(Candidate((L,) * 7, collective=True,
                               passes=(math.prod(k.shape) + math.prod(v.shape),)))
        return RuleResult(shapes, (q.dtype,) * 3, tuple(cands), _one_ring(4))
    return RuleResult(shapes, (q.dtype,) * 3, tuple(cands))


def _attention(schema: OpSchema) -> RuleResult:
    q, k, v, m = with_args(schema, 4)
    gqa = bool(schema.get("enable_gqa", False))
    out, weights = attention_shapes(q, k, v, m, gqa)
    nd = len(out)

    def along(a, d: int):  # ``a``'s placement when dim d of the weights is sharded
        if a is None:
            return None
        ad = d - nd + len(a.shape)
        return S(ad) if ad >= 0 and a.shape[ad] == weights[d] else R

    cands = [Candidate((R, R, R, R, None if m is None else R))]
    for d in range(nd - 2):
        if gqa and d == nd - 3 and any(a.shape[d] not in (1, weights[d]) for a in (k, v)):
            continue  # grouped heads: each key/value head serves several query heads
        cands.append(Candidate((S(d), along(q, d), along(k, d), along(v, d), along(m, d))))
    cands.append(Candidate((S(nd - 2), S(nd - 2), R, R, along(m, nd - 2))))
    ring = _ring_candidate(schema, q, k, v, m)
    if ring is None:
        return RuleResult((out,), (q.dtype,), tuple(cands))  # type: ignore[union-attr]
    cands.append(ring)
    return RuleResult((out,), (q.dtype,), tuple(cands), _one_ring(1))  # type: ignore[union-attr]


def _ring_candidate(schema: OpSchema, q, k, v, m) -> Candidate | None:
    """Ring attention's candidate (the module's notes), where it applies: no mask, no
    dropout, query, key and value of one batch shape (grouped-query heads not grouped),
    and a causal attention with as many queries as keys."""
    if m is None and schema.get("dropout_p", 0.0) == 0 and (
            tuple(q.shape[:-2]) == tuple(k.shape[:-2]) == tuple(v.shape[:-2])) and not (
            schema.get("is_causal", False) and q.shape[-2] != k.shape[-2]):
        seq = S(len(q.shape) - 2)
        return Candidate((seq, seq, seq, seq, None), collective=True,
                         passes=(math.prod(k.shape) + math.prod(v.shape),))
    return None


def _one_ring(qi: int) -> Callable[[tuple[Candidate, ...]], bool]:
    """The ``nd_check`` of a rule with a ring candidate (the query's placement at index
    ``qi``): a combination with the ring on a mesh dim shards the query's sequence dim on
    that mesh dim only (the ring kernel runs one ring)."""

    def check(combo: tuple[Candidate, ...]) -> bool:
        seq = next((c.placements[qi] for c in combo if c.passes), None)
        return seq is None or sum(1 for c in combo if c.placements[qi] == seq) == 1

    return check


def _gelu_backward(schema: OpSchema) -> RuleResult:
    """``gelu_backward(grad, input)``: elementwise over equal shapes, linear in ``grad``
    (a Partial sum/avg gradient with the input replicated stays Partial)."""
    g, x = with_args(schema, 2)
    if g is None or x is None or tuple(g.shape) != tuple(x.shape):
        raise ShardingError(f"{schema.op}: grad of shape {None if g is None else list(g.shape)}"
                            f" does not match input of shape "
                            f"{None if x is None else list(x.shape)}")
    cands = pointwise_candidates(x.shape, (g, x), (("sum", ("sum", None)),
                                                   ("avg", ("avg", None))))
    return RuleResult((x.shape,), (x.dtype,), tuple(cands))


def _layer_norm_backward(schema: OpSchema) -> RuleResult:
    """``layer_norm_backward(grad, input, weight)``: as ``layer_norm``, the normalized dims
    unsharded; the weight's gradient (a sum over the leading dims) Partial(sum) where a
    leading dim is sharded."""
    g, x, w = with_args(schema, 3)
    shape = x.shape  # type: ignore[union-attr]
    ns = check_normalized_shape(schema.op, shape, schema.get("normalized_shape"))
    if g is None or tuple(g.shape) != tuple(shape):
        raise ShardingError(f"{schema.op}: grad of shape {None if g is None else list(g.shape)}"
                            f" does not match input of shape {list(shape)}")
    wb = None if w is None else R
    cands = [Candidate((R, R, R, R, wb))]
    cands.extend(Candidate((S(d), P("sum"), S(d), S(d), wb))
                 for d in range(len(shape) - len(ns)))
    return RuleResult((shape, ns), (x.dtype, x.dtype), tuple(cands))  # type: ignore[union-attr]


_NN = {
    "softmax": _softmax,
    "log_softmax": _softmax,
    "layer_norm": _norm,
    "rms_norm": _norm,
    "embedding": _embedding,
    "cross_entropy": _cross_entropy,
    "mse_loss": _mse_loss,
    "dropout": _dropout,
    _SDPA: _attention,
    f"{_SDPA}_backward": _attention_backward,
    "_gelu_backward": _gelu_backward,
    "_layer_norm_backward": _layer_norm_backward,
}


# the static arguments each nn op reads (dropout's ``training`` is read by its local kernel)
_STATIC = {
    "softmax": ("dim", "dtype"),
    "log_softmax": ("dim", "dtype"),
    "layer_norm": ("normalized_shape",),
    "rms_norm": ("normalized_shape",),
    "_layer_norm_backward": ("normalized_shape",),
    "cross_entropy": ("reduction",),
    "mse_loss": ("reduction",),
    "dropout": ("training",),
    _SDPA: ("enable_gqa", "dropout_p", "is_causal"),
    f"{_SDPA}_backward": ("enable_gqa", "is_causal"),
}


@register_rule(*_NN, static=_STATIC)
def nn_rule(schema: OpSchema) -> RuleResult:
    """Rule of the nn ops (see the module docstring). **Local**."""
    return _NN[schema.op](schema)
