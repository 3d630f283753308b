"""The attention local kernel: ``scaled_dot_product_attention`` (PyTorch's math path).

``softmax(query @ key^T * scale + bias) @ value``, the softmax taken stably (the row
maximum subtracted) in float32 for float16 inputs (else in the inputs' dtype). ``bias`` is
``-inf`` where a causal mask (top-left aligned: query ``i`` sees keys ``0..i``) or a
boolean ``attn_mask`` (True: takes part) excludes a key, or a float ``attn_mask`` added.
A row whose every key is excluded gives zeros (PyTorch's ``_safe_softmax``), not NaN.
Dropout of the attention weights draws its mask from dtensor's counter-based generator,
over the counters of the whole weights tensor (:class:`AttentionBlock` places a shard in
it), so that a backward, or a shard of a distributed call, draws the same mask.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from placements.errors import ArgumentError
from placements.rules.nn import attention_shapes

from .. import rng as _random
from ..tensor import Tensor
from .base import acc_dtype, as_array, wrap, xp_of
from .nn import _dropout_apply, _float_input

__all__ = ["AttentionBlock", "attention_block", "attention_scale",
           "scaled_dot_product_attention"]

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
