"""numpy references (float64) of scaled dot-product attention and RMS normalisation: the
forward and the analytic backward, for the tests of ``dt.scaled_dot_product_attention`` and
``dt.rms_norm`` (unit and MPI). Nothing of dtensor is used here."""

from __future__ import annotations

import numpy as np


def sum_to(a: np.ndarray, shape: tuple) -> np.ndarray:
    """``a`` summed down to ``shape`` (the reverse of broadcasting ``shape`` to ``a``'s)."""
    lead = a.ndim - len(shape)
    a = a.sum(axis=tuple(range(lead))) if lead else a
    dims = tuple(d for d, n in enumerate(shape) if n == 1 and a.shape[d] != 1)
    return a.sum(axis=dims, keepdims=True) if dims else a


def _mT(a: np.ndarray) -> np.ndarray:
    return np.swapaxes(a, -1, -2)


def _weights(q, k, mask, causal, scale, gqa):
    """``(softmax weights, key with its heads repeated, scale)``."""
    if gqa:
        k = np.repeat(k, q.shape[-3] // k.shape[-3], axis=-3)
    n_q, n_k = q.shape[-2], k.shape[-2]
    sc = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ _mT(k)) * sc
    allowed = np.tril(np.ones((n_q, n_k), bool)) if causal else np.ones((n_q, n_k), bool)
    if mask is not None and mask.dtype == bool:
        allowed = allowed & mask
    s = np.where(allowed, s, -np.inf)
    if mask is not None and mask.dtype != bool:
        s = s + mask
    dead = np.all(s == -np.inf, axis=-1, keepdims=True)
    e = np.exp(s - np.where(dead, 0.0, s.max(axis=-1, keepdims=True)))
    w = np.where(dead, 0.0, e / np.where(dead, 1.0, e.sum(axis=-1, keepdims=True)))
    return w, k, sc


def attention(q, k, v, mask=None, causal=False, scale=None, gqa=False, keep=None):
    """PyTorch's ``scaled_dot_product_attention`` in float64; ``keep`` the dropout factor of
    each attention weight (0 or ``1 / (1 - p)``), None for no dropout. A query without any
    key gets zeros."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    w, _, _ = _weights(q, k, mask, causal, scale, gqa)
    if gqa:
        v = np.repeat(v, q.shape[-3] // v.shape[-3], axis=-3)
    return (w if keep is None else w * keep) @ v


def attention_grads(g, q, k, v, mask=None, causal=False, scale=None, gqa=False, keep=None):
    """The gradients ``(query, key, value, float mask or None)`` of ``sum(attention(...) *
    g)``, analytic."""
    q, k, v, g = (np.asarray(a, np.float64) for a in (q, k, v, g))
    w, k_all, sc = _weights(q, k, mask, causal, scale, gqa)
    v_all = np.repeat(v, q.shape[-3] // v.shape[-3], axis=-3) if gqa else v
    wd = w if keep is None else w * keep
    gw = g @ _mT(v_all)
    if keep is not None:
        gw = gw * keep
    gs = w * (gw - (gw * w).sum(axis=-1, keepdims=True))
    gq = (gs @ k_all) * sc
    gk = (_mT(gs) @ q) * sc
    gv = _mT(wd) @ g
    if gqa:
        gk = gk.reshape(*gk.shape[:-3], k.shape[-3], -1, *gk.shape[-2:]).sum(axis=-3)
        gv = gv.reshape(*gv.shape[:-3], v.shape[-3], -1, *gv.shape[-2:]).sum(axis=-3)
    gm = sum_to(gs, mask.shape) if mask is not None and mask.dtype != bool else None
    return sum_to(gq, q.shape), sum_to(gk, k.shape), sum_to(gv, v.shape), gm


def _rms(x, ndims, eps):
    axes = tuple(range(x.ndim - ndims, x.ndim))
    if eps is None:
        eps = np.finfo(np.float32 if x.dtype == np.float16 else x.dtype).eps
    x = np.asarray(x, np.float64)
    return x, axes, 1.0 / np.sqrt((x * x).mean(axis=axes, keepdims=True) + eps)


def rms_norm(x, ndims, w=None, eps=None):
    """PyTorch's ``rms_norm`` over the last ``ndims`` dims, in float64 (``eps`` None: the
    machine epsilon of ``x``'s dtype, float32's for float16)."""
    x, _, r = _rms(x, ndims, eps)
    return x * r if w is None else x * r * w


def rms_norm_grads(g, x, ndims, w=None, eps=None):
    """The gradients ``(input, weight or None)`` of ``sum(rms_norm(...) * g)``, analytic."""
    x, axes, r = _rms(x, ndims, eps)
    gh = g if w is None else g * w
    gx = r * gh - x * r**3 * (gh * x).mean(axis=axes, keepdims=True)
    return gx, None if w is None else sum_to(g * x * r, w.shape)
