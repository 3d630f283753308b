"""``dt.optim.lr_scheduler``: each scheduler's learning rates against hand-computed values
(and step by step against ``torch.optim.lr_scheduler`` where torch is installed), the
warmup-then-cosine recipe through SequentialLR, state dict round trips (and torch's state
dicts, through JSON, continuing the schedule as torch does), and PyTorch's
errors."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import dtensor as dt
from dtensor.errors import ArgumentError, DTypeError
from dtensor.optim import lr_scheduler as L

LRS = (0.1, 0.03)


def _opt(lrs=LRS):
    """An SGD optimizer with one parameter group per learning rate."""
    groups = [{"params": [dt.tensor(np.ones(2), requires_grad=True)], "lr": lr} for lr in lrs]
    return dt.optim.SGD(groups, lr=lrs[0])


def _run(sched, steps):
    """The learning rates after construction and after each of ``steps`` steps."""
    out = [list(sched.get_last_lr())]
    for _ in range(steps):
        sched.optimizer.step()
        sched.step()
        out.append(list(sched.get_last_lr()))
    return out


def _expect(factors, lrs=LRS):
    return [[lr * f for lr in lrs] for f in factors]


def _close(got, want):
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-12, atol=1e-15)


def test_construction_sets_initial_lr_and_base_lrs():
    opt = _opt()
    opt.param_groups[1]["initial_lr"] = 0.5  # kept: a resumed run's value
    sched = L.StepLR(opt, step_size=3)
    assert [g["initial_lr"] for g in opt.param_groups] == [0.1, 0.5]
    assert sched.base_lrs == [0.1, 0.5] and sched.last_epoch == 0
    assert sched.get_last_lr() == [0.1, 0.03]
    assert "initial_lr" in opt.state_dict()["param_groups"][0]


def test_lambda_lr_scales_the_initial_lrs():
    sched = L.LambdaLR(_opt(), lambda e: 0.5**e)
    _close(_run(sched, 4), _expect([1, 0.5, 0.25, 0.125, 0.0625]))
    sched = L.LambdaLR(_opt(), [lambda e: e + 1, lambda e: 1 / (e + 1)])
    _close(_run(sched, 2), [[0.1, 0.03], [0.2, 0.015], [0.3, 0.01]])


def test_step_and_exponential_lr():
    _close(_run(L.StepLR(_opt(), step_size=2, gamma=0.1), 5),
           _expect([1, 1, 0.1, 0.1, 0.01, 0.01]))
    _close(_run(L.ExponentialLR(_opt(), gamma=0.5), 3), _expect([1, 0.5, 0.25, 0.125]))


def test_linear_lr_warms_up_then_holds():
    _close(_run(L.LinearLR(_opt(), start_factor=0.25, total_iters=3), 5),
           _expect([0.25, 0.5, 0.75, 1, 1, 1]))
    _close(_run(L.LinearLR(_opt(), start_factor=1.0, end_factor=0.5, total_iters=2), 3),
           _expect([1, 0.75, 0.5, 0.5]))


def test_cosine_annealing_follows_the_half_cosine_and_rises_past_t_max():
    sched = L.CosineAnnealingLR(_opt(), T_max=4, eta_min=0.001)
    got = _run(sched, 10)
    want = [[0.001 + (lr - 0.001) * (1 + math.cos(math.pi * e / 4)) / 2 for lr in LRS]
            for e in range(11)]
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-9)
    assert got[4] == pytest.approx([0.001, 0.001]) and got[8] == pytest.approx(list(LRS))


def test_sequential_lr_warmup_then_cosine():
    """The GPT recipe: linear warmup over 3 steps, then cosine decay to 0 over 5."""
    opt = _opt()
    warmup = L.LinearLR(opt, start_factor=0.1, total_iters=3)
    cosine = L.CosineAnnealingLR(opt, T_max=5)
    sched = L.SequentialLR(opt, [warmup, cosine], milestones=[3])
    got = _run(sched, 9)
    factors = [0.1, 0.4, 0.7] + [(1 + math.cos(math.pi * e / 5)) / 2 for e in range(7)]
    np.testing.assert_allclose(np.array(got), np.array(_expect(factors)), rtol=1e-9,
                               atol=1e-15)
    assert [g["lr"] for g in opt.param_groups] == got[-1]


def test_the_optimizer_steps_with_the_scheduled_lr():
    p = dt.tensor(np.zeros(2), requires_grad=True)
    opt = dt.optim.SGD([p], lr=1.0)
    sched = L.LinearLR(opt, start_factor=0.5, total_iters=1)
    for _ in range(2):
        p.grad = dt.tensor(np.ones(2))
        opt.step()
        sched.step()
    np.testing.assert_allclose(p.detach().numpy(), [-1.5, -1.5])  # 0.5, then 1.0


def _cases():
    return {
        "lambda": lambda M, o: M.LambdaLR(o, [lambda e: 0.9**e, lambda e: 1 / (1 + e)]),
        "step": lambda M, o: M.StepLR(o, step_size=4, gamma=0.5),
        "exponential": lambda M, o: M.ExponentialLR(o, gamma=0.9),
        "linear": lambda M, o: M.LinearLR(o, start_factor=0.2, end_factor=0.9,
                                          total_iters=7),
        "cosine": lambda M, o: M.CosineAnnealingLR(o, T_max=9, eta_min=0.002),
        "warmup_cosine": lambda M, o: M.SequentialLR(
            o, [M.LinearLR(o, start_factor=0.01, total_iters=5),
                M.CosineAnnealingLR(o, T_max=20, eta_min=1e-4)], milestones=[5]),
        "three_phases": lambda M, o: M.SequentialLR(
            o, [M.LinearLR(o, start_factor=0.5, total_iters=3), M.ExponentialLR(o, 0.8),
                M.CosineAnnealingLR(o, T_max=6)], milestones=[4, 12]),
    }


@pytest.mark.torch
@pytest.mark.parametrize("case", sorted(_cases()))
def test_schedulers_match_torch(case):
    import torch

    make = _cases()[case]
    want = _run(make(torch.optim.lr_scheduler, torch.optim.SGD(
        [{"params": [torch.zeros(2, requires_grad=True)], "lr": lr} for lr in LRS])), 30)
    got = _run(make(L, _opt()), 30)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-14, atol=0)


@pytest.mark.parametrize("case", sorted(_cases()))
@pytest.mark.parametrize("at", [2, 7])
def test_state_dict_round_trip_continues_the_schedule(case, at):
    make = _cases()[case]
    sched = make(L, _opt())
    _run(sched, at)
    state, opt_state = sched.state_dict(), sched.optimizer.state_dict()
    assert "optimizer" not in state
    rest = _run(sched, 10)

    opt = _opt((1.0, 2.0))  # other lrs: everything must come from the state dicts
    restored = make(L, opt)
    opt.load_state_dict(opt_state)
    restored.load_state_dict(state)
    assert restored.get_last_lr() == rest[0]
    assert _run(restored, 10) == rest
    assert set(state) == set(sched.state_dict())  # loading left the dict as it was


@pytest.mark.torch
@pytest.mark.parametrize("case", sorted(_cases()))
@pytest.mark.parametrize("at", [3, 8])
def test_state_dicts_are_torchs_and_load_from_torch_through_json(case, at):
    """The state dict holds torch's keys (but torch's transient
    ``_get_lr_called_within_step``); torch's state dict, after a JSON round trip (what a
    checkpoint's metadata does to it), continues the schedule here as torch continues it."""
    import torch

    make = _cases()[case]
    t_opt = torch.optim.SGD(
        [{"params": [torch.zeros(2, requires_grad=True)], "lr": lr} for lr in LRS])
    t_sched = make(torch.optim.lr_scheduler, t_opt)
    _run(t_sched, at)
    t_state = json.loads(json.dumps(t_sched.state_dict()))
    t_groups = t_opt.state_dict()["param_groups"]
    want = _run(t_sched, 12)

    sched = make(L, _opt())
    _run(sched, at)

    def keys(state):
        out = set(state) - {"_get_lr_called_within_step"}
        return out, [keys(s) for s in state.get("_schedulers", [])]

    assert keys(sched.state_dict()) == keys(t_state)
    opt = _opt((1.0, 2.0))
    restored = make(L, opt)
    for mine, theirs in zip(opt.param_groups, t_groups):
        mine.update(lr=theirs["lr"], initial_lr=theirs["initial_lr"])
    restored.load_state_dict({k: v for k, v in t_state.items()
                              if k != "_get_lr_called_within_step"})
    np.testing.assert_allclose(np.array(_run(restored, 12)), np.array(want), rtol=1e-14,
                               atol=0)


class _Warmup:
    """A callable-object lambda: its attributes are saved by LambdaLR.state_dict."""

    def __init__(self, n):
        self.n = n

    def __call__(self, e):
        return min(1.0, (e + 1) / self.n)


def test_lambda_lr_saves_only_callable_objects():
    sched = L.LambdaLR(_opt(), [_Warmup(4), lambda e: 1.0])
    state = sched.state_dict()
    assert state["lr_lambdas"] == [{"n": 4}, None]
    other = L.LambdaLR(_opt(), [_Warmup(10), lambda e: 1.0])
    other.load_state_dict(state)
    assert other.lr_lambdas[0].n == 4 and state["lr_lambdas"] == [{"n": 4}, None]


def test_bad_arguments_raise_pytorchs_errors():
    opt = _opt()
    with pytest.raises(ArgumentError, match="expected 2 lr_lambdas.*got 3"):
        L.LambdaLR(opt, [lambda e: 1.0] * 3)
    with pytest.raises(ArgumentError, match="LinearLR.*start_factor=0"):
        L.LinearLR(opt, start_factor=0)
    with pytest.raises(ArgumentError, match="LinearLR.*start_factor=1.5"):
        L.LinearLR(opt, start_factor=1.5)
    with pytest.raises(ArgumentError, match="LinearLR.*end_factor=-0.1"):
        L.LinearLR(opt, end_factor=-0.1)
    with pytest.raises(DTypeError, match="list is not an Optimizer"):
        L.StepLR([], step_size=1)
    with pytest.raises(ArgumentError, match=r"param_groups\[0\] when resuming"):
        L.StepLR(_opt(), step_size=1, last_epoch=3)
    a, b = L.LinearLR(opt), L.CosineAnnealingLR(opt, T_max=3)
    with pytest.raises(ArgumentError, match="schedulers 2 and the number of milestones to be "
                                            "equal to 2"):
        L.SequentialLR(opt, [a, b], milestones=[1, 2])
    with pytest.raises(ArgumentError, match="at least one scheduler"):
        L.SequentialLR(opt, [], milestones=[])
    other = L.StepLR(_opt(), step_size=1)
    with pytest.raises(ArgumentError, match="same optimizer.*StepLR at index 1"):
        L.SequentialLR(opt, [a, other], milestones=[1])
    with pytest.raises(DTypeError, match="index 1.*optimizer"):
        L.SequentialLR(opt, [a, object()], milestones=[1])
    assert issubclass(ArgumentError, ValueError) and issubclass(DTypeError, TypeError)


def test_module_surface():
    assert dt.optim.lr_scheduler is L
    assert sorted(L.__all__) == sorted(["LRScheduler", "LambdaLR", "StepLR", "ExponentialLR",
                                         "LinearLR", "CosineAnnealingLR", "SequentialLR"])
    assert all(issubclass(getattr(L, n), L.LRScheduler) for n in L.__all__)
