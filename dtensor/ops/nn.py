"""Records of the neural-network ops: softmax, layer_norm, embedding, losses, dropout, with
their backward formulas."""

from __future__ import annotations

from ..local import kernels as K
from ..local.rng import get_rng_state, set_rng_state
from ._grad import arange
from .shard_kernels import class_sharded_local, dropout_local, embedding_local, mse_local
from .table import Backward, declare

__all__: list[str] = []


def _softmax(g, v, o, need, fns):
    dim = v[1]
    return (o * (g - (g * o).sum(dim=dim, keepdim=True)),)


def _log_softmax(g, v, o, need, fns):
    dim = v[1]
    return (g - o.exp() * g.sum(dim=dim, keepdim=True),)


def _layer_norm(g, v, o, need, fns):
    x, normalized_shape, w, eps = v[0], v[1], v[2], v[4]
    k = 1 if isinstance(normalized_shape, int) else len(tuple(normalized_shape))
    dims = tuple(range(x.ndim - k, x.ndim))
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
    if target.dtype.kind in "fc":  # class probabilities
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
    if reduction == "mean":
        d = d * (g / max(x.numel(), 1))
    else:
        d = d * g
    return (d if need[0] else None, -d if need[1] else None)


def _dropout(g, v, state, need, fns):
    x, p, training = v[0], v[1], v[2]
    now = get_rng_state()
    set_rng_state(state)  # the same random numbers: the same mask
    try:
        mask = fns.dropout(fns.ones_like(x), p, training)
    finally:
        set_rng_state(now)
    return (g * mask,)


def nn_op(name: str, backward: Backward, tensors: tuple[str, ...] = ("input",),
          **kw: object) -> None:
    """Declare the nn op ``name`` over its kernel in :mod:`dtensor.local.kernels`, with its
    formula ``backward`` (compute class ``nn``). **Local**."""
    declare(name, getattr(K, name), tensors, samples="nn", backward=backward, cost="nn", **kw)


nn_op("softmax", Backward(_softmax, out=True), local_fn=class_sharded_local, raw="softmax")
nn_op("log_softmax", Backward(_log_softmax, out=True), local_fn=class_sharded_local,
      raw="softmax")
nn_op("layer_norm", Backward(_layer_norm, ("input", "weight")), ("input", "weight", "bias"),
      method=False)
nn_op("embedding", Backward(_embedding, ("input",)), ("input", "weight"),
      local_fn=embedding_local, method=False)
nn_op("cross_entropy", Backward(_cross_entropy, ("input", "target", "weight")),
      ("input", "target", "weight"), method=False, local_fn=class_sharded_local)
nn_op("mse_loss", Backward(_mse, ("input", "target")), ("input", "target"),
      local_fn=mse_local, method=False)
nn_op("dropout", Backward(_dropout, rng=True), local_fn=dropout_local, method=False)
