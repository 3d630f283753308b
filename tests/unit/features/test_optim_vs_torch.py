"""``dt.optim`` SGD, Adam and AdamW against ``torch.optim`` on the same float64 data, over
every option and several steps, with the gradient fed the ways a training loop feeds it:

- ``backward``: real autograd of a loss that depends on the parameters (so every step's
  gradient depends on the trajectory), ``zero_grad(set_to_none=False)`` between steps: the
  gradient tensor lives on and is zeroed and refilled in place;
- ``reused``: one gradient tensor object assigned to ``p.grad`` at every step and changed in
  place between steps (the optimizer must not keep it, nor write into it);
- ``accumulate``: two backward passes per step before ``zero_grad(set_to_none=False)``;
- ``fresh``: a new gradient tensor every step.

Options: SGD's momentum, dampening, nesterov, weight_decay, maximize; Adam's and AdamW's
betas, eps, weight_decay, amsgrad, maximize; and param groups that each override options.
The parameters (and the reused gradient) are compared with torch's after every step.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import dtensor as dt

pytestmark = pytest.mark.torch

STEPS = 5
SHAPES = [(3, 4), (5,)]
FEEDS = ["backward", "reused", "accumulate", "fresh"]


def _sgd_options():
    out = []
    for momentum, dampening, nesterov, wd, maximize in itertools.product(
            [0.0, 0.9], [0.0, 0.3], [False, True], [0.0, 0.1], [False, True]):
        if nesterov and (momentum == 0 or dampening != 0):
            continue  # invalid in both libraries
        out.append({"lr": 0.05, "momentum": momentum, "dampening": dampening,
                    "nesterov": nesterov, "weight_decay": wd, "maximize": maximize})
    return out


def _adam_options():
    return [{"lr": 0.03, "betas": betas, "eps": eps, "weight_decay": wd, "amsgrad": ams,
             "maximize": maximize}
            for betas, eps, wd, ams, maximize in itertools.product(
                [(0.9, 0.999), (0.5, 0.8)], [1e-8, 1e-2], [0.0, 0.1], [False, True],
                [False, True])]


CASES = ([("SGD", o) for o in _sgd_options()] + [("Adam", o) for o in _adam_options()]
         + [("AdamW", o) for o in _adam_options()])


def _ids(case):
    name, opts = case
    return name + "-" + ",".join(f"{k}={v}" for k, v in opts.items() if k != "lr")


class _Side:
    """One library's parameters, optimizer and loss, fed the same way on both sides."""

    def __init__(self, lib, optim_cls, groups, inits, feed):
        self.lib, self.feed = lib, feed
        new = (lambda a: dt.from_numpy(a.copy())) if lib is dt else (
            lambda a: lib.from_numpy(a.copy()))
        self.new = new
        self.params = [new(a).requires_grad_() for a in inits]
        spec, start = [], 0
        for g in groups:
            n = g["n"]
            spec.append({**{k: v for k, v in g.items() if k != "n"},
                         "params": self.params[start:start + n]})
            start += n
        self.opt = optim_cls(spec)
        self.kept = None  # the one gradient object of the "reused" feed

    def _loss(self, coefs, targets):
        total = None
        for p, c, t in zip(self.params, coefs, targets):
            term = ((p - self.new(t)) ** 2 * self.new(c)).sum() + (p * self.new(c)).sin().sum()
            total = term if total is None else total + term
        return total

    def step(self, coefs, targets, grads):
        if self.feed == "backward":
            self.opt.zero_grad(set_to_none=False)
            self._loss(coefs, targets).backward()
        elif self.feed == "accumulate":
            self.opt.zero_grad(set_to_none=False)
            self._loss(coefs, targets).backward()
            self._loss(targets, coefs).backward()
        elif self.feed == "reused":
            if self.kept is None:
                self.kept = [self.new(g) for g in grads]
            else:
                for k, g in zip(self.kept, grads):
                    k.copy_(self.new(g))
            for p, k in zip(self.params, self.kept):
                p.grad = k
        else:
            for p, g in zip(self.params, grads):
                p.grad = self.new(g)
        self.opt.step()

    def values(self):
        vals = [p.detach().numpy().copy() for p in self.params]
        if self.kept is not None:
            vals += [k.numpy().copy() for k in self.kept]
        return vals


def _run(name, groups, feed, seed):
    import torch  # lazy: the oracle (the module is marked torch)

    rng = np.random.default_rng(seed)
    shapes = [SHAPES[i % len(SHAPES)] for i in range(sum(g["n"] for g in groups))]
    inits = [rng.standard_normal(s) for s in shapes]
    ours = _Side(dt, getattr(dt.optim, name), groups, inits, feed)
    theirs = _Side(torch, getattr(torch.optim, name), groups, inits, feed)
    for step in range(STEPS):
        coefs = [rng.uniform(0.5, 2.0, s) for s in shapes]
        targets = [rng.standard_normal(s) for s in shapes]
        grads = [rng.standard_normal(s) for s in shapes]
        ours.step(coefs, targets, grads)
        theirs.step(coefs, targets, grads)
        for i, (a, b) in enumerate(zip(ours.values(), theirs.values())):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12,
                                       err_msg=f"{name} {feed} step {step} tensor {i}")


# every option set under the zeroed-and-refilled gradient of backward, and under one of the
# other feeds in turn (each feed meets every optimizer and most options)
OPTION_RUNS = [(case, feed) for i, case in enumerate(CASES)
               for feed in ("backward", FEEDS[1 + i % 3])]


@pytest.mark.parametrize(("case", "feed"), OPTION_RUNS,
                         ids=[f"{_ids(c)}-{f}" for c, f in OPTION_RUNS])
def test_every_option_matches_torch_over_steps(case, feed):
    name, opts = case
    _run(name, [{"n": 2, **opts}], feed, seed=len(opts) + FEEDS.index(feed))


GROUPS = {
    "SGD": [{"n": 1, "lr": 0.1}, {"n": 2, "lr": 0.03, "momentum": 0.9, "nesterov": True},
            {"n": 1, "lr": 0.05, "momentum": 0.5, "dampening": 0.5, "weight_decay": 0.2,
             "maximize": True}],
    "Adam": [{"n": 2, "lr": 0.01}, {"n": 1, "lr": 0.05, "betas": (0.6, 0.7), "amsgrad": True},
             {"n": 1, "lr": 0.02, "eps": 1e-3, "weight_decay": 0.3, "maximize": True}],
    "AdamW": [{"n": 1, "lr": 0.01, "weight_decay": 0.0},
              {"n": 2, "lr": 0.05, "betas": (0.6, 0.7), "amsgrad": True},
              {"n": 1, "lr": 0.02, "eps": 1e-3, "maximize": True}],
}


@pytest.mark.parametrize("feed", FEEDS)
@pytest.mark.parametrize("name", sorted(GROUPS))
def test_param_groups_take_their_own_options_as_torch(name, feed):
    _run(name, GROUPS[name], feed, seed=11)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, float("inf")])
def test_clip_grad_norm_total_and_scaling_in_the_gradients_precision_as_torch(dtype,
                                                                             norm_type):
    """The total norm has torch's dtype (float64 for float64 gradients: a float32 total
    rounded the clipping coefficient, 1e-8 off torch's) and value, and the clipped
    gradients equal torch's to the last bits."""
    import torch  # lazy: the oracle (the module is marked torch)

    rng = np.random.default_rng(4)
    grads = [(rng.standard_normal(s) * 3).astype(dtype) for s in SHAPES]
    ps = [dt.zeros(s, dtype=dtype).requires_grad_() for s in SHAPES]
    ts = [torch.zeros(s, dtype=getattr(torch, np.dtype(dtype).name), requires_grad=True)
          for s in SHAPES]
    for p, t, g in zip(ps, ts, grads):
        p.grad = dt.from_numpy(g.copy())
        t.grad = torch.from_numpy(g.copy())
    total = dt.nn.utils.clip_grad_norm_(ps, 0.5, norm_type)
    want = torch.nn.utils.clip_grad_norm_(ts, 0.5, norm_type)
    assert total.dtype == np.dtype(dtype)
    np.testing.assert_allclose(total.numpy(), want.numpy(), rtol=1e-6 if dtype == np.float32
                               else 1e-14)
    for p, t in zip(ps, ts):
        np.testing.assert_allclose(p.grad.numpy(), t.grad.numpy(),
                                   rtol=1e-6 if dtype == np.float32 else 1e-14)
