"""``dt.checkpoint.get_state_dict`` / ``set_state_dict``: optimizer state keyed by parameter
name survives a change of parameter order, as a resume under another layout needs."""

from __future__ import annotations

import numpy as np
import pytest

import dtensor as dt
from dtensor.errors import ArgumentError


class Net(dt.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = dt.nn.Linear(3, 4)
        self.b = dt.nn.Linear(4, 2)

    def forward(self, x):
        return self.b(self.a(x).relu())


def _trained():
    dt.manual_seed(0)
    net = Net()
    opt = dt.optim.AdamW(net.parameters(), lr=0.1)
    x = dt.tensor(np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32))
    for _ in range(2):
        net(x).sum().backward()
        opt.step()
        opt.zero_grad()
    return net, opt, x


def test_state_keyed_by_name_loads_into_an_optimizer_of_another_order():
    net, opt, x = _trained()
    msd, osd = dt.checkpoint.get_state_dict(net, opt)
    assert set(osd["state"]) == {"a.weight", "a.bias", "b.weight", "b.bias"}
    assert osd["param_groups"][0]["params"] == ["a.weight", "a.bias", "b.weight", "b.bias"]
    dt.manual_seed(1)
    other = Net()
    params = list(other.parameters())[::-1]  # another order
    opt2 = dt.optim.AdamW(params, lr=0.1)
    dt.checkpoint.set_state_dict(other, opt2, model_state_dict=msd, optim_state_dict=osd)
    for (n, p), q in zip(net.named_parameters(), other.parameters()):
        np.testing.assert_array_equal(p.numpy(), q.numpy(), err_msg=n)
    np.testing.assert_array_equal(opt2.state[other.a.weight]["exp_avg"].numpy(),
                                  opt.state[net.a.weight]["exp_avg"].numpy())
    for o, n in ((opt, net), (opt2, other)):  # the next step agrees
        n(x).sum().backward()
        o.step()
    np.testing.assert_allclose(other.b.weight.numpy(), net.b.weight.numpy(), rtol=1e-6)


def test_an_optimizer_over_foreign_parameters_raises():
    net, _, _ = _trained()
    stray = dt.optim.SGD([dt.nn.Parameter(dt.ones(2))], lr=0.1)
    with pytest.raises(ArgumentError, match="not a parameter of Net"):
        dt.checkpoint.get_state_dict(net, stray)
