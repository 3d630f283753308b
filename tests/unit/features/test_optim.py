"""``dt.optim`` and ``dt.nn.utils`` on local tensors: the update rules against a numpy
reference written from the formulas (and against ``torch.optim`` where torch is installed),
state dicts, ``zero_grad``, gradient clipping, and PyTorch's errors."""

from __future__ import annotations

import math

import numpy as np
import pytest

import dtensor as dt
from dtensor.errors import ArgumentError

STEPS = 4


def _grads(shape, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape) for _ in range(STEPS)]


def ref_sgd(p, grads, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,
            maximize=False):
    p, buf = p.copy(), None
    for g in grads:
        g = -g if maximize else g
        g = g + weight_decay * p
        if momentum:
            buf = g.copy() if buf is None else momentum * buf + (1 - dampening) * g
            g = g + momentum * buf if nesterov else buf
        p = p - lr * g
    return p


def ref_adam(p, grads, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False,
             maximize=False, decoupled=False):
    p = p.copy()
    m, v, vmax = np.zeros_like(p), np.zeros_like(p), np.zeros_like(p)
    for t, g in enumerate(grads, 1):
        g = -g if maximize else g
        if decoupled:
            p = p * (1 - lr * weight_decay)
        else:
            g = g + weight_decay * p
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        vmax = np.maximum(vmax, v)
        vv = vmax if amsgrad else v
        p = p - lr / (1 - betas[0] ** t) * m / (np.sqrt(vv) / math.sqrt(1 - betas[1] ** t) + eps)
    return p


SGD_CASES = [
    {"lr": 0.1},
    {"lr": 0.05, "momentum": 0.9},
    {"lr": 0.05, "momentum": 0.9, "dampening": 0.3, "weight_decay": 0.01},
    {"lr": 0.05, "momentum": 0.8, "nesterov": True, "weight_decay": 0.1},
    {"lr": 0.02, "momentum": 0.5, "maximize": True},
]
ADAM_CASES = [
    ("Adam", {"lr": 0.01}),
    ("Adam", {"lr": 0.01, "betas": (0.8, 0.99), "weight_decay": 0.1}),
    ("Adam", {"lr": 0.01, "amsgrad": True, "maximize": True}),
    ("AdamW", {"lr": 0.01}),
    ("AdamW", {"lr": 0.02, "weight_decay": 0.3, "amsgrad": True, "eps": 1e-6}),
]


def _run(opt_cls, kwargs, p0, grads):
    p = dt.tensor(p0, requires_grad=True)
    opt = opt_cls([p], **kwargs)
    for g in grads:
        p.grad = dt.tensor(g)
        opt.step()
    return p.detach().numpy()


@pytest.mark.parametrize("kwargs", SGD_CASES, ids=str)
def test_sgd_matches_its_formula(kwargs):
    p0 = np.random.default_rng(1).standard_normal((3, 4))
    got = _run(dt.optim.SGD, kwargs, p0, _grads((3, 4)))
    np.testing.assert_allclose(got, ref_sgd(p0, _grads((3, 4)), **kwargs), rtol=1e-12)


@pytest.mark.parametrize(("name", "kwargs"), ADAM_CASES, ids=str)
def test_adam_matches_its_formula(name, kwargs):
    p0 = np.random.default_rng(2).standard_normal((5,))
    got = _run(getattr(dt.optim, name), kwargs, p0, _grads((5,)))
    kw = dict(kwargs)
    if name == "AdamW":
        kw.setdefault("weight_decay", 1e-2)
    want = ref_adam(p0, _grads((5,)), decoupled=name == "AdamW", **kw)
    np.testing.assert_allclose(got, want, rtol=1e-12)


@pytest.mark.torch
@pytest.mark.parametrize(("name", "kwargs"), [("SGD", k) for k in SGD_CASES] + ADAM_CASES,
                         ids=str)
def test_optimizers_match_torch(name, kwargs):
    import torch

    p0 = np.random.default_rng(3).standard_normal((4, 3)).astype(np.float32)
    grads = [g.astype(np.float32) for g in _grads((4, 3), seed=4)]
    got = _run(getattr(dt.optim, name), kwargs, p0, grads)
    tp = torch.tensor(p0, requires_grad=True)
    topt = getattr(torch.optim, name)([tp], **kwargs)
    for g in grads:
        tp.grad = torch.tensor(g)
        topt.step()
    np.testing.assert_allclose(got, tp.detach().numpy(), rtol=2e-6, atol=1e-7)


def test_param_groups_take_their_own_options_and_defaults():
    a = dt.tensor(np.ones(2), requires_grad=True)
    b = dt.tensor(np.ones(2), requires_grad=True)
    opt = dt.optim.SGD([{"params": [a]}, {"params": b, "lr": 1.0}], lr=0.1, momentum=0.0)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 1.0]
    a.grad, b.grad = dt.tensor(np.ones(2)), dt.tensor(np.ones(2))
    opt.step()
    np.testing.assert_allclose(a.detach().numpy(), [0.9, 0.9])
    np.testing.assert_allclose(b.detach().numpy(), [0.0, 0.0])
    assert "Parameter Group 1" in repr(opt) and "lr: 1.0" in repr(opt)


def test_state_dict_round_trip_continues_identically():
    p0 = np.random.default_rng(5).standard_normal((3,))
    grads = _grads((3,), seed=6) * 2
    a = dt.tensor(p0, requires_grad=True)
    b = dt.tensor(p0, requires_grad=True)
    oa = dt.optim.Adam([a], lr=0.05, amsgrad=True)
    for g in grads[:3]:
        a.grad = dt.tensor(g)
        oa.step()
    sd = oa.state_dict()
    assert sorted(sd["state"][0]) == ["exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"]
    assert sd["param_groups"][0]["params"] == [0] and sd["state"][0]["step"] == 3
    with dt.no_grad():
        b.copy_(a)
    ob = dt.optim.Adam([b], lr=0.5)
    ob.load_state_dict(sd)
    assert ob.param_groups[0]["lr"] == 0.05 and ob.param_groups[0]["amsgrad"]
    assert ob.state[b]["exp_avg"] is not oa.state[a]["exp_avg"]  # copied, not shared
    for g in grads[3:]:
        a.grad, b.grad = dt.tensor(g), dt.tensor(g)
        oa.step()
        ob.step()
    np.testing.assert_array_equal(a.detach().numpy(), b.detach().numpy())


def test_zero_grad_to_none_or_zeros_and_steps_skip_missing_grads():
    p = dt.tensor(np.ones(3), requires_grad=True)
    q = dt.tensor(np.ones(3), requires_grad=True)
    opt = dt.optim.SGD([p, q], lr=1.0)
    p.grad = dt.tensor(np.ones(3))
    opt.step()  # q has no gradient: unchanged
    np.testing.assert_array_equal(q.detach().numpy(), np.ones(3))
    grad = p.grad
    opt.zero_grad(set_to_none=False)
    assert p.grad is grad and not p.grad.numpy().any()
    opt.zero_grad()
    assert p.grad is None


def test_step_records_nothing_and_runs_the_closure_with_grad():
    w = dt.tensor(np.full(2, 3.0), requires_grad=True)
    opt = dt.optim.SGD([w], lr=0.1)

    def closure():
        opt.zero_grad()
        loss = (w * w).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert float(loss.numpy()) == 18.0
    np.testing.assert_allclose(w.detach().numpy(), [2.4, 2.4])
    assert w.is_leaf and w.grad_fn is None


def test_bad_arguments_raise_pytorchs_errors():
    p = dt.tensor(np.ones(2), requires_grad=True)
    with pytest.raises(ArgumentError, match="invalid learning rate"):
        dt.optim.SGD([p], lr=-1)
    with pytest.raises(ArgumentError, match="Nesterov"):
        dt.optim.SGD([p], lr=0.1, nesterov=True)
    with pytest.raises(ArgumentError, match="beta parameter at index 1"):
        dt.optim.Adam([p], betas=(0.9, 1.0))
    with pytest.raises(ArgumentError, match="empty parameter list"):
        dt.optim.Adam([])
    with pytest.raises(ArgumentError, match="iterable of Tensors"):
        dt.optim.SGD(p, lr=0.1)
    with pytest.raises(ArgumentError, match="more than one parameter group"):
        dt.optim.SGD([{"params": [p]}, {"params": [p]}], lr=0.1)
    with pytest.raises(ArgumentError, match="non-leaf"):
        dt.optim.SGD([p * 2], lr=0.1)
    opt = dt.optim.SGD([p], lr=0.1)
    with pytest.raises(ArgumentError, match="parameter groups"):
        opt.load_state_dict({"state": {}, "param_groups": []})


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, math.inf])
def test_clip_grad_norm_scales_to_the_total_norm(norm_type):
    rng = np.random.default_rng(7)
    gs = [rng.standard_normal(s).astype(np.float32) for s in ((3, 4), (5,), ())]
    ps = [dt.tensor(np.zeros_like(g), requires_grad=True) for g in gs]
    for p, g in zip(ps, gs):
        p.grad = dt.tensor(g)
    flat = np.concatenate([g.reshape(-1) for g in gs]).astype(np.float64)
    want = np.abs(flat).max() if math.isinf(norm_type) else (np.abs(flat) ** norm_type).sum() ** (
        1 / norm_type)
    total = dt.nn.utils.clip_grad_norm_(ps, 0.5, norm_type)
    np.testing.assert_allclose(float(total.numpy()), want, rtol=1e-5)
    coef = 0.5 / (want + 1e-6)
    for p, g in zip(ps, gs):
        np.testing.assert_allclose(p.grad.numpy(), g * coef, rtol=1e-5)
    # below the limit: unchanged
    before = [p.grad.numpy().copy() for p in ps]
    dt.nn.utils.clip_grad_norm_(ps, 1e9, norm_type)
    for p, b in zip(ps, before):
        np.testing.assert_array_equal(p.grad.numpy(), b)


def test_clip_grad_norm_edge_cases():
    p = dt.tensor(np.zeros(2, np.float32), requires_grad=True)
    assert float(dt.nn.utils.clip_grad_norm_([p], 1.0).numpy()) == 0.0  # no gradient
    p.grad = dt.tensor(np.array([np.inf, 1.0], np.float32))
    with pytest.raises(ArgumentError, match="inf"):
        dt.nn.utils.clip_grad_norm_(p, 1.0, error_if_nonfinite=True)
    with pytest.raises(ArgumentError, match="norm_type"):
        dt.nn.utils.get_total_norm([p.grad], -1.0)


def test_clip_grad_norm_nan_norm_scales_by_nan_as_torch():
    # torch: clip_coef_clamped = clamp(max_norm / (nan + 1e-6), max=1.0) is NaN, and every
    # gradient is multiplied by it (python's min(1.0, nan) is 1.0)
    p = dt.tensor(np.zeros(3, np.float32), requires_grad=True)
    q = dt.tensor(np.zeros(2, np.float32), requires_grad=True)
    p.grad = dt.tensor(np.array([np.nan, 1.0, 2.0], np.float32))
    q.grad = dt.tensor(np.array([3.0, 4.0], np.float32))
    total = dt.nn.utils.clip_grad_norm_([p, q], 1.0)
    assert np.isnan(float(total.numpy()))
    assert np.isnan(p.grad.numpy()).all() and np.isnan(q.grad.numpy()).all()
    # an infinite norm gives a factor of 0: finite gradients become 0 (as in torch)
    q.grad = dt.tensor(np.array([3.0, 4.0], np.float32))
    r = dt.tensor(np.zeros(1, np.float32), requires_grad=True)
    r.grad = dt.tensor(np.array([np.inf], np.float32))
    dt.nn.utils.clip_grad_norm_([q, r], 1.0)
    np.testing.assert_array_equal(q.grad.numpy(), [0.0, 0.0])
