"""Autograd against ``torch.autograd`` (optional: where torch is installed): the same
programs, written once against a namespace (``dtensor`` or ``torch``), give the same
gradients in float64."""

from __future__ import annotations

import numpy as np
import pytest

import dtensor as dt

pytestmark = pytest.mark.torch

# name -> (program of (namespace, class-index target, *inputs), input shapes)
PROGRAMS = {
    "mlp": (lambda F, t, x, w1, b1, w2: _nn(F).gelu(x @ w1 + b1, approximate="tanh")
            .matmul(w2).tanh().sum(), ((5, 6), (6, 7), (7,), (7, 3))),
    "attention": (lambda F, t, q, k, v: (F.softmax(q @ k.transpose(0, 1) / 2.0, -1) @ v)
                  .pow(2).mean(), ((4, 3), (5, 3), (5, 2))),
    "norms": (lambda F, t, x, w, b: _nn(F).layer_norm(x, (6,), w, b).logsumexp(1).sum()
              + x.std(dim=0).sum() + x.var().sum() + x.norm(), ((5, 6), (6,), (6,))),
    "losses": (lambda F, t, x, w: _nn(F).cross_entropy(x @ w, t, label_smoothing=0.1)
               + _nn(F).mse_loss(x.sigmoid(), x.clamp(-0.5, 0.5)), ((6, 4), (4, 5))),
    # the mean over the targets that are not ignored (the seed's targets hold two 2s)
    "losses_ignored": (lambda F, t, x, w: _nn(F).cross_entropy(x @ w, t, ignore_index=2),
                       ((6, 4), (4, 5))),
    "einsum": (lambda F, t, x, y, z: (F.einsum("...ij,...jk->...ik", x, y).sin().sum()
                                      + F.einsum("iij->j", z).exp().sum()
                                      + F.einsum("bii,bj->bij", z.movedim(2, 0), y[:, 0]).sum()),
               ((1, 3, 4), (2, 4, 5), (3, 3, 2))),
    "views": (lambda F, t, x, y: F.cat([x, y], 1)[1:, ::2].flip(0).cumsum(1).exp().sum()
              + F.einsum("ij,ik->jk", x, y).abs().sum() + F.stack([x, y], 0).amax(0).sum(),
              ((5, 3), (5, 3))),
    "pointwise": (lambda F, t, x, y: F.where(x > 0, x * y, x / (y * y + 1)).sum()
                  + F.maximum(x, y).sum() + F.atan2(x, y).sum() + (x * 3).remainder(y).sum(),
                  ((4, 5), (4, 5))),
}


def _write_through_views(F, t, a, x, w):
    """In-place writes through views of a non-leaf, some after a view was taken (PyTorch
    refuses a write into an output of split, which dtensor allows)."""
    b = a.clone()
    b[0].mul_(2.0)
    v = b[:, 1]
    v.add_(x)
    rest = b[1:]
    rest[:, 2:].mul_((rest[:, :2] + 0.0).sin())
    b.t()[3].mul_(x)
    b[:, 2:].sub_(w[:, :2] * x[:1])
    b[2] = x[:1].expand(4) * 3.0
    b.reshape(-1)[::2].exp_()
    return (b * w).sum() + (v * v).sum()


PROGRAMS["views_in_place"] = (_write_through_views, ((3, 4), (3,), (3, 4)))


def _gradient_penalty(F, t, x, w1, b1, w2):
    """A loss plus the squared norm of its gradient with respect to the input (the
    gradient taken with ``create_graph=True``): second derivatives reach every input."""
    h = (x @ w1 + b1).tanh()
    out = _nn(F).gelu(h @ w2, approximate="tanh")
    loss = ((out.softmax(-1) * out.exp().sigmoid()).sum() + h.relu().pow(3).mean()
            + (x.sin() * x).sum() + h.log_softmax(-1).sum() + x[1:, 2].exp().sum()
            + x[[0, 2, 0]].exp().sum() + x[:, ::2].pow(3).sum() + x[x > 0.5].sin().sum()
            + _nn(F).cross_entropy(out, t[:5] % 3))
    (g,) = F.autograd.grad(loss, x, create_graph=True)
    return (g * g).sum() + loss


PROGRAMS["gradient_penalty"] = (_gradient_penalty, ((5, 4), (4, 6), (6,), (6, 3)))


def _norm_penalty(F, t, x, w, b):
    """A penalty on layer_norm's input and weight gradients (``create_graph=True``: its
    formula recorded as ops, the composite form, whose second derivatives reach every
    input)."""
    y = _nn(F).layer_norm(x, (6,), w, b)
    loss = (y * y.sin()).sum()
    gx, gw = F.autograd.grad(loss, (x, w), create_graph=True)
    return (gx * gx).sum() + (gw * gw).sum() + loss


PROGRAMS["norm_penalty"] = (_norm_penalty, ((5, 6), (6,), (6,)))


def _nn(F):
    """Where the functional nn ops live: ``dtensor`` itself, ``torch.nn.functional``."""
    return F if F is dt else F.nn.functional


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_gradients_equal_torch(name):
    import torch  # lazy: an optional dependency of the tests

    fn, shapes = PROGRAMS[name]
    rng = np.random.default_rng(11)
    target = rng.integers(0, 5, (6,))
    assert 0 < (target == 2).sum() < len(target)  # "losses_ignored" ignores some targets
    arrays = [rng.standard_normal(s) for s in shapes]
    xs = [dt.from_numpy(a.copy()).requires_grad_() for a in arrays]
    fn(dt, dt.from_numpy(target), *xs).backward()
    ts = [torch.from_numpy(a.copy()).requires_grad_() for a in arrays]
    fn(torch, torch.from_numpy(target), *ts).backward()
    for x, t in zip(xs, ts):
        np.testing.assert_allclose(x.grad.numpy(), t.grad.numpy(), rtol=1e-10, atol=1e-12)
