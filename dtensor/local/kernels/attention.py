"""The attention local kernel: ``scaled_dot_product_attention`` (PyTorch's math path).

``softmax(query @ key^T * scale + bias) @ value``, the softmax taken stably (the row
maximum subtracted) in float32 for float16 inputs (else in the inputs' dtype). ``bias`` is
``-inf`` where a causal mask (top-left aligned: query ``i`` sees keys ``0..i``) or a
boolean ``attn_mask`` (True: takes part) excludes a key, or a float ``attn_mask`` added.
A row whose every key is excluded gives zeros (PyTorch's ``_safe_softmax``), not NaN.
Dropout of the attention weights draws its mask from dtensor's counter-based generator,
over the counters of the whole weights tensor (:class:`AttentionBlock` places a shard in
it), so that a backward, or a shard of a distributed call, draws the same mask.

Without a mask argument and without dropout (a GPT's causal self-attention) the kernels are
blocked: :data:`BLOCK_ROWS` queries at a time against only the keys that some query of the
block sees (a causal block skips the keys past its last row, about half of the work), the
softmax of each block taken whole over that prefix (no online rescaling: the prefix is in
hand), the scale folded into the query and the causal mask written on the block's diagonal
part only. :func:`scaled_dot_product_attention_backward` is the matching fused backward: it
recomputes each block's weights (as FlashAttention does, nothing of the forward kept) and
forms the three gradients with one batched matmul each per block.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from placements.errors import ArgumentError
from placements.rules.nn import attention_backward_shapes, attention_shapes

from .. import rng as _random
from ..tensor import Tensor
from .base import acc_dtype, as_array, new_array, wrap, xp_of
from .nn import _compiled_softmax, _dropout_apply, _float_input

__all__ = ["BLOCK_ROWS", "AttentionBlock", "attention_backward_block", "attention_block",
           "attention_scale", "scaled_dot_product_attention",
           "scaled_dot_product_attention_backward"]

_OP = "scaled_dot_product_attention"


class AttentionBlock(NamedTuple):
    """Where a block of queries sits in a whole attention call: ``row``, the global index
    of its first query; ``weights``, the global shape of the attention weights
    ``(..., L, S)``; ``starts``, the global offsets of its own weights in them."""

    row: int
    weights: tuple[int, ...]
    starts: tuple[int, ...]


def attention_scale(head_dim: int, scale: float | None) -> float:
    """The factor of the scores: ``scale``, or ``1 / sqrt(head_dim)`` when None. **Local**."""
    if scale is not None:
        return scale
    return 1.0 / math.sqrt(head_dim) if head_dim else math.inf


def check_attention_args(dropout_p: float, is_causal: bool, attn_mask) -> None:
    """PyTorch's checks of the non-tensor arguments. **Local**."""
    if not 0.0 <= dropout_p <= 1.0:
        raise ArgumentError(f"dropout probability has to be between 0 and 1, but got {dropout_p}")
    if is_causal and attn_mask is not None:
        raise ArgumentError(
            "_scaled_dot_product_attention: Explicit attn_mask should not be set when "
            "is_causal=True"
        )


def _grouped(a, heads: int, xp):
    """Key or value ``a`` with each head repeated for its group of ``heads`` query heads."""
    n = a.shape[-3]
    return a if n in (1, heads) else xp.repeat(a, heads // n, axis=-3)


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """Scaled dot-product attention (PyTorch's ``scaled_dot_product_attention``). **Local**.

    ``softmax(query @ key.mT * scale + bias, dim=-1) @ value``, with dropout of the
    attention weights when ``dropout_p > 0`` (always: there is no training flag).

    Parameters
    ----------
    query : Tensor
        ``(..., L, E)``, floating.
    key : Tensor
        ``(..., S, E)``, query's dtype.
    value : Tensor
        ``(..., S, Ev)``, query's dtype. The batch dims of the three broadcast.
    attn_mask : Tensor, optional
        Broadcasts to ``(..., L, S)``: bool (True: the key takes part) or float (added to
        the scores; float32 or the query's dtype).
    dropout_p : float
        In ``[0, 1]``; the mask comes from dtensor's generator (``dt.manual_seed``).
    is_causal : bool
        Query ``i`` attends to keys ``0..i`` (top-left aligned, also when ``L != S``);
        not together with ``attn_mask``.
    scale : float, optional
        Default ``1 / sqrt(E)``.
    enable_gqa : bool
        Grouped-query attention: key and value may have fewer heads (dim -3) than the
        query, a divisor of its count; key/value head ``j`` serves query heads
        ``j * g .. (j + 1) * g - 1``.

    Returns
    -------
    Tensor
        ``(..., L, Ev)`` of the query's dtype. A query whose every key is masked out gets
        zeros.

    Raises
    ------
    ArgumentError
        ``dropout_p`` outside ``[0, 1]``; ``attn_mask`` with ``is_causal``.
    DTypeError
        Mixed or non-floating dtypes of query, key and value; a mask of another dtype.
    ShardingError
        Shapes that do not fit.
    """
    return attention_block(query, key, value, attn_mask, dropout_p, is_causal, scale,
                           enable_gqa, None)


def attention_block(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                    block: AttentionBlock | None) -> Tensor:
    """:func:`scaled_dot_product_attention` of a block of queries (and of the batch) of a
    larger call placed by ``block`` (None: the whole call), against all of its keys: the
    causal mask starts at the block's global row and dropout draws the block's part of the
    whole weights' mask. **Local**."""
    check_attention_args(dropout_p, is_causal, attn_mask)
    q = _float_input(_OP, query)
    k, v = as_array(_OP, key), as_array(_OP, value)
    m = None if attn_mask is None else as_array(_OP, attn_mask)
    _, weights = attention_shapes(q, k, v, m, enable_gqa)
    xp = xp_of(q)
    acc = acc_dtype(q.dtype)
    n_q, n_k = q.shape[-2], k.shape[-2]
    if enable_gqa and q.ndim >= 3:
        k, v = _grouped(k, q.shape[-3], xp), _grouped(v, q.shape[-3], xp)
    if m is None and dropout_p == 0 and blocked_applies(q, k, v):
        row = 0 if block is None else block.row
        o = _blocked_forward(q, k, v, attention_scale(q.shape[-1], scale), is_causal, row, xp)
        return wrap(o)
    s = xp.matmul(q.astype(acc, copy=False), xp.swapaxes(k.astype(acc, copy=False), -1, -2))
    if s.shape != weights:  # value's batch dims broadcast further: one row of weights each
        s = xp.ascontiguousarray(xp.broadcast_to(s, weights))
    s *= acc.type(attention_scale(q.shape[-1], scale))
    if is_causal:
        row = 0 if block is None else block.row
        # a broadcast masked copy: boolean-index assignment (s[..., m] = -inf) gathers the
        # masked positions first and cost about 5x as much on (8, 6, 256, 256)
        xp.copyto(s, acc.type(-np.inf), where=xp.arange(n_k) > xp.arange(row, row + n_q)[:, None])
    elif m is not None and m.dtype.kind == "b":
        s = xp.where(m, s, acc.type(-np.inf))
    elif m is not None:
        s += m.astype(acc, copy=False)
    if n_k:
        top = xp.max(s, axis=-1, keepdims=True)
        top[top == -np.inf] = 0  # a row without any key: exp gives zeros, not NaN
        s -= top
        xp.exp(s, out=s)
        total = xp.sum(s, axis=-1, keepdims=True)
        total[total == 0] = 1
        s /= total
    if dropout_p > 0:
        whole = weights if block is None else block.weights
        seed, offset = _random._reserve(math.prod(whole))
        starts = (0,) * len(whole) if block is None else block.starts
        _dropout_apply(s, dropout_p, seed, offset, whole, starts, out=s)
    o = xp.matmul(s, v.astype(acc, copy=False))
    return wrap(o.astype(q.dtype, copy=False))


#: Query rows per block of the blocked kernels: at (8, 6, 256, 64) float32 one block's
#: weights (48 x 64 x 256 floats, 3 MiB) stay near the cache, the causal skip keeps 62% of
#: the full work, and the per-block numpy calls cost little next to their matmuls.
BLOCK_ROWS = 64


def blocked_applies(q, k, v) -> bool:
    """Whether the blocked kernels serve these (key and value heads already repeated for
    grouped-query attention): the same batch dims on all three (no broadcasting), at least
    one query and one key. **Local**."""
    return (q.shape[:-2] == k.shape[:-2] == v.shape[:-2] and q.shape[-2] > 0
            and k.shape[-2] > 0)


def _blocks(n_q: int, n_k: int, causal: bool, row: int):
    """``(r0, r1, n)`` per block of queries ``r0:r1``: the block sees keys ``0:n``."""
    for r0 in range(0, n_q, BLOCK_ROWS):
        r1 = min(r0 + BLOCK_ROWS, n_q)
        yield r0, r1, (min(n_k, row + r1) if causal else n_k)


def _block_weights(qs, kt, r0: int, r1: int, n: int, causal: bool, row: int, xp):
    """The attention weights of queries ``r0:r1`` (``qs``: scaled queries) over keys
    ``0:n`` (``kt``: the keys transposed), in a new C-contiguous array;
    causal: query ``row + i`` sees keys ``0..row + i`` (at least key 0: no row is empty)."""
    s = xp.matmul(qs[..., r0:r1, :], kt[..., :n])
    c0 = row + r0 + 1  # the first key that some query of the block does not see
    if causal and c0 < n:
        xp.copyto(s[..., c0:], -xp.inf,
                  where=xp.arange(c0, n) > xp.arange(row + r0, row + r1)[:, None])
    w = _compiled_softmax(s, s.ndim - 1, False)  # one pass with a vectorised exp
    if w is not None:
        return w
    s -= xp.max(s, axis=-1, keepdims=True)
    xp.exp(s, out=s)
    s *= 1 / xp.sum(s, axis=-1, keepdims=True)
    return s


def _acc_inputs(q, k, v, scale: float, xp):
    """Query (times the scale, a new array), key and value in the accumulation dtype (the
    matmuls take strided views as they are: copies to make them contiguous cost more than
    they save)."""
    acc = acc_dtype(q.dtype)
    qs = xp.multiply(q, acc.type(scale), dtype=acc)
    return qs, k.astype(acc, copy=False), v.astype(acc, copy=False)


def _blocked_forward(q, k, v, scale: float, causal: bool, row: int, xp):
    """``softmax(q @ k^T * scale + causal bias) @ v`` block by block (the module's notes)."""
    qs, k, v = _acc_inputs(q, k, v, scale, xp)
    kt = xp.swapaxes(k, -1, -2)
    out = new_array((*q.shape[:-1], v.shape[-1]), q.dtype, q)
    for r0, r1, n in _blocks(q.shape[-2], k.shape[-2], causal, row):
        w = _block_weights(qs, kt, r0, r1, n, causal, row, xp)
        out[..., r0:r1, :] = xp.matmul(w, v[..., :n, :])
    return out


def scaled_dot_product_attention_backward(
    grad: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of :func:`scaled_dot_product_attention` without a mask argument and
    without dropout with respect to query, key and value, fused. **Local**.

    Each block of queries recomputes its attention weights ``P`` (the forward's blocks);
    with ``dP = grad @ value^T`` the score gradient is ``P * (dP - rowsum(dP * P))`` and
    the gradients are its products with key and query and ``P^T @ grad``.

    Parameters
    ----------
    grad : Tensor
        ``(..., L, Ev)``, the output's gradient, query's dtype.
    query, key, value, is_causal, scale, enable_gqa
        As for :func:`scaled_dot_product_attention`; the batch dims of query, key and value
        (key and value heads repeated with ``enable_gqa``) equal, none broadcast.

    Returns
    -------
    tuple of Tensor
        The gradients of query, key and value, each of its argument's shape and dtype.

    Raises
    ------
    DTypeError
        Mixed or non-floating dtypes.
    ShardingError
        Shapes that do not fit (broadcast batch dims included).
    """
    return attention_backward_block(grad, query, key, value, is_causal, scale, enable_gqa, 0)


def attention_backward_block(grad, query, key, value, is_causal, scale, enable_gqa,
                             row: int) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`scaled_dot_product_attention_backward` of a block of queries whose first
    query is query ``row`` of the whole call (the causal mask starts there): the key and
    value gradients are this block's part of the sums over every query. **Local**."""
    name = "scaled_dot_product_attention_backward"
    q = _float_input(name, query)
    k, v, g = as_array(name, key), as_array(name, value), as_array(name, grad)
    attention_backward_shapes(g, q, k, v, enable_gqa)
    xp = xp_of(q)
    heads = q.shape[-3] if enable_gqa and q.ndim >= 3 else None
    kg, vg = (k, v) if heads is None else (_repeated(k, heads, xp), _repeated(v, heads, xp))
    sc = attention_scale(q.shape[-1], scale)
    if q.shape[-2] == 0 or k.shape[-2] == 0:  # no weights: the gradients are zeros
        return tuple(wrap(xp.zeros(a.shape, q.dtype)) for a in (q, k, v))
    qs, kg, vg = _acc_inputs(q, kg, vg, sc, xp)
    acc = qs.dtype
    ga = g.astype(acc, copy=False)
    kt, vt = xp.swapaxes(kg, -1, -2), xp.swapaxes(vg, -1, -2)
    gq = xp.empty(q.shape, acc)
    gk = xp.zeros(kg.shape, acc)
    gv = xp.zeros(vg.shape, acc)
    for r0, r1, n in _blocks(q.shape[-2], k.shape[-2], is_causal, row):
        w = _block_weights(qs, kt, r0, r1, n, is_causal, row, xp)
        gb = ga[..., r0:r1, :]
        gv[..., :n, :] += xp.matmul(xp.swapaxes(w, -1, -2), gb)
        ds = xp.matmul(gb, vt[..., :n])  # the weights' gradient
        ds -= xp.einsum("...ij,...ij->...i", ds, w)[..., None]
        ds *= w  # the scores' gradient
        xp.matmul(ds, kg[..., :n, :], out=gq[..., r0:r1, :])
        gk[..., :n, :] += xp.matmul(xp.swapaxes(ds, -1, -2), qs[..., r0:r1, :])
    gq *= acc.type(sc)
    if heads is not None:  # each key/value head sums the gradients of its query heads
        gk = _group_sum(gk, k.shape[-3], xp)
        gv = _group_sum(gv, v.shape[-3], xp)
    return tuple(wrap(xp.ascontiguousarray(a, dtype=q.dtype)) for a in (gq, gk, gv))


def _repeated(a, heads: int, xp):
    """Key or value ``a`` with each head (dim -3) repeated for its group of query heads (a
    single head too)."""
    n = a.shape[-3]
    return a if n == heads else xp.repeat(a, heads // n, axis=-3)


def _group_sum(a, n: int, xp):
    """``a`` with its heads (dim -3) summed per group of ``heads // n`` down to ``n``."""
    if a.shape[-3] == n:
        return a
    return a.reshape(*a.shape[:-3], n, a.shape[-3] // n, *a.shape[-2:]).sum(axis=-3)
