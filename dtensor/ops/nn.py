"""Records of the neural-network ops: softmax, layer_norm, rms_norm, embedding, losses,
dropout, scaled_dot_product_attention, with their backward formulas."""

from __future__ import annotations

import math

from placements.meta import dtype_kind

from ..local import kernels as K
from ..local.grad_engine import is_grad_enabled
from ..local.kernels.attention import attention_scale
from ..local.kernels.nn import layer_norm_backward, rms_eps
from ..local.rng import get_rng_state, set_rng_state
from ._grad import arange
from .shard_kernels import (
    attention_backward_local,
    attention_local,
    class_sharded_local,
    dropout_local,
    embedding_local,
    mse_local,
)
from .table import NOT_DIFFERENTIABLE, Backward, declare

__all__: list[str] = []


def _softmax(g, v, o, need, fns):
    dim = v[1]
    return (o * (g - (g * o).sum(dim=dim, keepdim=True)),)


def _log_softmax(g, v, o, need, fns):
    dim = v[1]
    return (g - o.exp() * g.sum(dim=dim, keepdim=True),)


def _normalized_dims(x, normalized_shape) -> tuple[int, ...]:
    """The trailing dims of ``x`` that ``normalized_shape`` names."""
    k = 1 if isinstance(normalized_shape, int) else len(tuple(normalized_shape))
    return tuple(range(x.ndim - k, x.ndim))


def _layer_norm(g, v, o, need, fns):
    x, normalized_shape, w, eps = v[0], v[1], v[2], v[4]
    if not is_grad_enabled():  # one fused pass per row; the composite when it is recorded
        gx, gw = fns._layer_norm_backward(g, x, normalized_shape, w, eps)
        # the pass gives the affine gradients with gx: returned unasked too, so that a split
        # backward's input half takes them (it then keeps two d-vectors, not g and x)
        return (gx if need[0] else None, gw, g)
    dims = _normalized_dims(x, normalized_shape)
    mu = x.mean(dim=dims, keepdim=True)
    xc = x - mu
    rstd = ((xc * xc).mean(dim=dims, keepdim=True) + eps).rsqrt()
    xhat = xc * rstd
    gxhat = g * w if w is not None else g
    gx = None
    if need[0]:
        gx = rstd * (gxhat - gxhat.mean(dim=dims, keepdim=True)
                     - xhat * (gxhat * xhat).mean(dim=dims, keepdim=True))
    gw = g * xhat if need[1] else None
    return (gx, gw, g if need[2] else None)


def _rms_norm(g, v, o, need, fns):
    x, normalized_shape, w, eps = v
    dims = _normalized_dims(x, normalized_shape)
    rstd = ((x * x).mean(dim=dims, keepdim=True) + rms_eps(x.dtype, eps)).rsqrt()
    gxhat = g * w if w is not None else g
    gx = None
    if need[0]:
        gx = rstd * (gxhat - x * (rstd * rstd) * (gxhat * x).mean(dim=dims, keepdim=True))
    return (gx, g * (x * rstd) if need[1] else None)


def _one_hot(idx, n, dtype, class_dim, fns):
    """A float one-hot of the integer ``idx`` over ``n`` classes, classes at ``class_dim``."""
    ar = arange(n, idx, fns)
    hot = idx.unsqueeze(-1) == ar
    if class_dim != hot.ndim - 1:
        hot = hot.movedim(-1, class_dim)
    return hot.to(dtype)


def _embedding(g, v, o, need, fns):
    idx, w, padding_idx = v[0], v[1], v[2]
    n, d = w.shape
    hot = _one_hot(idx, n, g.dtype, idx.ndim, fns)
    if padding_idx is not None:
        keep = (arange(n, idx, fns) != (padding_idx % n)).to(g.dtype)
        hot = hot * keep
    return (None, hot.reshape(-1, n).mT @ g.reshape(-1, d))


def _cross_entropy(g, v, o, need, fns):
    x, target, weight = v[0], v[1], v[2]
    ignore_index, reduction, smoothing = v[3], v[4], v[5]
    cdim = 0 if x.ndim == 1 else 1
    c = x.shape[cdim]
    p = x.softmax(cdim)
    wshape = [1] * x.ndim
    wshape[cdim] = c
    wb = weight.reshape(wshape) if weight is not None else None
    if dtype_kind(target.dtype) in "fc":  # class probabilities
        q = target * (1.0 - smoothing) + smoothing / c if smoothing else target
        a = q * wb if wb is not None else q
        denom = x.numel() // c if reduction == "mean" else 1
    else:
        valid = (target != ignore_index).to(x.dtype)
        safe = target.where(target != ignore_index, 0)
        hot = _one_hot(safe, c, x.dtype, cdim, fns)
        a = hot * (1.0 - smoothing) + smoothing / c if smoothing else hot
        if wb is not None:
            a = a * wb
            wt = (hot * wb).sum(dim=cdim)
        else:
            wt = None
        a = a * valid.unsqueeze(cdim)
        if reduction == "mean":
            denom = (wt * valid).sum() if wt is not None else valid.sum()
        else:
            denom = 1
    grad = p * a.sum(dim=cdim, keepdim=True) - a
    if reduction == "none":
        grad = grad * g.unsqueeze(cdim)
    else:
        grad = grad * (g / denom)
    return (grad, None, None)


def _mse(g, v, o, need, fns):
    x, t, reduction = v[0], v[1], v[2]
    d = (x - t) * 2.0
    if reduction == "mean":  # over the broadcast shape of input and target (d's), as forward
        d = d * (g / max(d.numel(), 1))
    else:
        d = d * g
    return (d if need[0] else None, -d if need[1] else None)


def _redrawn(state, like, p, fns):
    """The dropout mask (0 or ``1 / (1 - p)``) shaped like ``like`` that a forward drew from
    the random generator's ``state``: the same random numbers again."""
    now = get_rng_state()
    set_rng_state(state)
    try:
        return fns.dropout(fns.ones_like(like), p, True)
    finally:
        set_rng_state(now)


def _dropout(g, v, state, need, fns):
    x, p, training = v[0], v[1], v[2]
    return (g * _redrawn(state, x, p, fns) if training else g,)


def _grouped(a, heads: int):
    """Key or value ``a`` with each of its heads (dim -3) repeated for its group of query
    heads (grouped-query attention)."""
    n = a.shape[-3]
    if n in (1, heads):
        return a
    return a.unsqueeze(-3).expand(*a.shape[:-2], heads // n, *a.shape[-2:]).flatten(-4, -3)


def _fused_backward_fits(q, k, val, gqa: bool) -> bool:
    """Whether ``scaled_dot_product_attention_backward`` takes these: no batch dim
    broadcast (with grouped-query attention, fewer key and value heads)."""
    lead = q.shape[:-3] if gqa and q.ndim >= 3 else q.shape[:-2]
    return all(tuple(a.shape[: len(lead)]) == tuple(lead) and a.ndim == q.ndim
               and (a.ndim < 3 or a.shape[-3] == q.shape[-3] or gqa) for a in (k, val))


def _attention(g, v, state, need, fns):
    """Without mask and dropout, and unless the backward records (``create_graph``), the
    fused ``scaled_dot_product_attention_backward``; otherwise recomputes the attention
    weights from query and key with ordinary ops (nothing of the forward's kept) and redraws
    its dropout mask from the generator's state before the call."""
    q, k, val, mask, p, causal, scale, gqa = v
    if (mask is None and p == 0 and not is_grad_enabled() and g.dtype == q.dtype
            and _fused_backward_fits(q, k, val, gqa)):
        grads = fns.scaled_dot_product_attention_backward(g, q, k, val, causal, scale, gqa)
        return (*grads, None)
    if gqa and q.ndim >= 3:
        k_, v_ = _grouped(k, q.shape[-3]), _grouped(val, q.shape[-3])
    else:
        k_, v_ = k, val
    n_q, n_k = q.shape[-2], k.shape[-2]
    sc = attention_scale(q.shape[-1], scale)
    s = (q @ k_.mT) * sc
    if causal:
        s = s.masked_fill(arange(n_k, q, fns) > arange(n_q, q, fns).unsqueeze(-1), -math.inf)
    elif mask is not None:
        s = s.masked_fill(mask.logical_not(), -math.inf) if mask.dtype.kind == "b" else s + mask
    w = s.softmax(-1)
    if mask is not None:  # rows without any key: zeros (the forward's)
        w = w.masked_fill((s == -math.inf).all(dim=-1, keepdim=True), 0.0)
    keep = _redrawn(state, w, p, fns) if p > 0 else None
    gw = g @ v_.mT
    if keep is not None:
        gw = gw * keep
    gs = w * (gw - (gw * w).sum(dim=-1, keepdim=True))
    gq = (gs @ k_) * sc if need[0] else None
    gk = (gs.mT @ q) * sc if need[1] else None
    gv = (w * keep if keep is not None else w).mT @ g if need[2] else None
    if k_ is not k and gk is not None:
        gk = gk.unflatten(-3, (k.shape[-3], -1)).sum(dim=-3)
    if v_ is not val and gv is not None:
        gv = gv.unflatten(-3, (val.shape[-3], -1)).sum(dim=-3)
    return (gq, gk, gv, gs if need[3] else None)  # a float mask is added to the scores


def nn_op(name: str, backward: Backward, tensors: tuple[str, ...] = ("input",),
          cost: str = "nn", fn=None, **kw: object) -> None:
    """Declare the nn op ``name`` over its kernel ``fn`` (by default ``name`` in
    :mod:`dtensor.local.kernels`), with its formula ``backward`` and compute class ``cost``.
    **Local**."""
    declare(name, fn or getattr(K, name), tensors, samples="nn", backward=backward, cost=cost,
            **kw)


nn_op("softmax", Backward(_softmax, out=True), local_fn=class_sharded_local, raw="softmax")
nn_op("log_softmax", Backward(_log_softmax, out=True), local_fn=class_sharded_local,
      raw="softmax")
nn_op("layer_norm", Backward(_layer_norm, ("input", "weight")), ("input", "weight", "bias"),
      method=False)
# the fused gradient of layer_norm that its formula runs (rule: placements.rules.nn); not
# differentiable itself: under a recorded backward the formula uses the composite form
nn_op("_layer_norm_backward", NOT_DIFFERENTIABLE, ("grad", "input", "weight"),
      method=False, fn=layer_norm_backward)
nn_op("embedding", Backward(_embedding, ("input",)), ("input", "weight"),
      local_fn=embedding_local, method=False)
nn_op("cross_entropy", Backward(_cross_entropy, ("input", "target", "weight")),
      ("input", "target", "weight"), method=False, local_fn=class_sharded_local)
nn_op("mse_loss", Backward(_mse, ("input", "target")), ("input", "target"),
      local_fn=mse_local, method=False)
nn_op("dropout", Backward(_dropout, rng=True), local_fn=dropout_local, method=False)
nn_op("rms_norm", Backward(_rms_norm, ("input", "weight")), ("input", "weight"), method=False)
nn_op("scaled_dot_product_attention",
      Backward(_attention, ("query", "key", "value", "attn_mask"), rng=True),
      ("query", "key", "value", "attn_mask"), local_fn=attention_local, method=False,
      cost="matmul")
nn_op("scaled_dot_product_attention_backward", NOT_DIFFERENTIABLE,
      ("grad", "query", "key", "value"), local_fn=attention_backward_local, method=False,
      cost="matmul")
