"""``dt.nn.RMSNorm``, ``F.rms_norm`` and ``F.scaled_dot_product_attention`` against numpy
references."""

from __future__ import annotations

import math

import numpy as np

import dtensor as dt

nn, F = dt.nn, dt.nn.functional


def rms_ref(x, w, eps, dims):
    return x / np.sqrt((x * x).mean(axis=dims, keepdims=True) + eps) * w


def test_rms_norm_module_forward_and_grads():
    rng = np.random.default_rng(0)
    m = nn.RMSNorm((2, 3), eps=1e-6, dtype=dt.float64)
    assert repr(m) == "RMSNorm((2, 3), eps=1e-06, elementwise_affine=True)"
    assert m.weight.detach().numpy().tolist() == [[1.0] * 3] * 2
    w = rng.standard_normal((2, 3))
    with dt.no_grad():
        m.weight.copy_(dt.tensor(w))
    x = rng.standard_normal((4, 2, 3))
    xt = dt.tensor(x, requires_grad=True)
    y = m(xt)
    np.testing.assert_allclose(y.detach().numpy(), rms_ref(x, w, 1e-6, (-2, -1)), rtol=1e-10)
    g = rng.standard_normal(x.shape)
    (y * dt.tensor(g)).sum().backward()
    # d/dx of sum(g * x * r * w), r = (mean(x^2) + eps)^(-1/2) over the normalized dims
    r = 1 / np.sqrt((x * x).mean(axis=(-2, -1), keepdims=True) + 1e-6)
    gw = g * w
    gx = r * gw - x * r**3 * (gw * x).mean(axis=(-2, -1), keepdims=True)
    np.testing.assert_allclose(xt.grad.numpy(), gx, rtol=1e-8, atol=1e-12)
    np.testing.assert_allclose(m.weight.grad.numpy(), (g * x * r).sum(0), rtol=1e-8)


def test_functional_rms_norm_default_eps():
    x = np.random.default_rng(1).standard_normal((3, 5)).astype(np.float32)
    y = F.rms_norm(dt.tensor(x), (5,))
    np.testing.assert_allclose(y.numpy(), rms_ref(x, 1.0, np.finfo(np.float32).eps, (-1,)),
                               rtol=1e-5)


def sdpa_ref(q, k, v, mask=None, is_causal=False, scale=None):
    s = (q @ np.swapaxes(k, -1, -2)) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if is_causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    if mask is not None:
        s = np.where(mask, s, -np.inf) if mask.dtype == bool else s + mask
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def test_scaled_dot_product_attention():
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((2, 3, 4, 5)) for _ in range(3))
    out = F.scaled_dot_product_attention(dt.tensor(q), dt.tensor(k), dt.tensor(v),
                                         is_causal=True)
    np.testing.assert_allclose(out.numpy(), sdpa_ref(q, k, v, is_causal=True), rtol=1e-10)
    mask = rng.standard_normal((4, 4))
    out = F.scaled_dot_product_attention(dt.tensor(q), dt.tensor(k), dt.tensor(v),
                                         attn_mask=dt.tensor(mask), scale=0.3)
    np.testing.assert_allclose(out.numpy(), sdpa_ref(q, k, v, mask, scale=0.3), rtol=1e-10)
