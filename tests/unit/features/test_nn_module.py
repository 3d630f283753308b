"""``dt.nn.Module`` and ``dt.nn.Parameter`` on local tensors: registration, traversal,
state dicts (round trip, strict errors that change nothing), hooks, train/eval, apply,
zero_grad, to(dtype) and repr, with PyTorch's semantics."""

from __future__ import annotations

import numpy as np
import pytest

import dtensor as dt
from dtensor.errors import ArgumentError, DTypeError

nn = dt.nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.scale = nn.Parameter(dt.ones(4))
        self.register_buffer("steps", dt.zeros(1, dtype=dt.int64))
        self.register_buffer("cache", dt.zeros(2), persistent=False)
        self.note = "plain attribute"

    def forward(self, x):
        return self.fc(x) * self.scale


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(4, 2, bias=False))

    def forward(self, x):
        return self.head(self.block(x))


def test_parameter_is_a_marked_alias_of_its_data():
    t = dt.ones(3)
    p = nn.Parameter(t)
    assert p is not t and type(p) is dt.Tensor
    assert isinstance(p, nn.Parameter) and not isinstance(t, nn.Parameter)
    assert p.requires_grad and p.is_leaf and not t.requires_grad
    p.detach().fill_(2.0)  # shares memory
    assert t.numpy().tolist() == [2.0, 2.0, 2.0]
    assert not nn.Parameter(t, requires_grad=False).requires_grad
    assert not isinstance(p * 2, nn.Parameter)
    with pytest.raises(DTypeError, match="Parameter"):
        nn.Parameter(np.ones(3))


def test_registration_and_traversal():
    net = Net()
    assert [n for n, _ in net.named_parameters()] == [
        "block.scale", "block.fc.weight", "block.fc.bias", "head.1.weight"]
    assert all(isinstance(p, nn.Parameter) for p in net.parameters())
    assert [n for n, _ in net.named_parameters(recurse=False)] == []
    assert [n for n, _ in net.block.named_parameters(prefix="b", recurse=False)] == ["b.scale"]
    assert [n for n, _ in net.named_buffers()] == ["block.steps", "block.cache"]
    assert len(list(net.buffers())) == 2
    assert [n for n, _ in net.named_children()] == ["block", "head"]
    assert list(net.children()) == [net.block, net.head]
    assert [n for n, _ in net.named_modules()] == [
        "", "block", "block.fc", "head", "head.0", "head.1"]
    assert len(list(net.modules())) == 6
    assert net.get_submodule("head.1") is net.head[1]
    assert net.get_parameter("block.fc.bias") is net.block.fc.bias
    assert net.get_buffer("block.steps") is net.block.steps
    with pytest.raises(AttributeError, match="Linear has no attribute `nope`"):
        net.get_submodule("block.fc.nope")
    with pytest.raises(AttributeError, match="`note` is not an nn.Parameter"):
        net.get_parameter("block.note")
    assert "fc" in dir(net.block) and net.block.note == "plain attribute"


def test_setattr_delattr_and_register_errors():
    b = Block()
    b.scale = None  # a parameter slot takes None
    assert b.scale is None and "scale" not in [n for n, _ in b.named_parameters()]
    b.fc = nn.Parameter(dt.zeros(2))  # replaces the submodule by a parameter
    assert "fc" not in b._modules and b.fc.shape == (2,)
    with pytest.raises(DTypeError, match="cannot assign 'Tensor' as parameter 'fc'"):
        b.fc = dt.zeros(2)
    with pytest.raises(DTypeError, match="as buffer 'steps'"):
        b.steps = 3
    b.steps = dt.ones(1)
    del b.steps
    assert not hasattr(b, "steps")
    with pytest.raises(ArgumentError, match="can't contain"):
        b.register_parameter("a.b", None)
    with pytest.raises(ArgumentError, match="attribute 'note' already exists"):
        b.register_buffer("note", dt.zeros(1))
    p = nn.Parameter(dt.ones(2), requires_grad=False)
    p.add_(dt.ones(2, requires_grad=True))  # recorded: p is no leaf any more
    with pytest.raises(ArgumentError, match="non-leaf"):
        b.register_parameter("x", p)
    with pytest.raises(DTypeError, match="not a Module subclass"):
        b.add_module("m", 3)

    class Early(nn.Module):
        def __init__(self):
            self.w = nn.Parameter(dt.ones(1))

    with pytest.raises(AttributeError, match="before Module.__init__"):
        Early()


def test_shared_parameters_are_listed_once_unless_asked():
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    b.weight = a.weight
    seq = nn.Sequential(a, b)
    assert len(list(seq.parameters())) == 3
    assert len(list(seq.named_parameters(remove_duplicate=False))) == 4
    assert list(seq.state_dict()) == ["0.weight", "0.bias", "1.weight", "1.bias"]


def test_state_dict_round_trip_in_place():
    dt.manual_seed(1)
    src = Net()
    sd = src.state_dict()
    assert list(sd) == ["block.scale", "block.steps", "block.fc.weight", "block.fc.bias",
                        "head.1.weight"]
    assert not any(v.requires_grad for v in sd.values())
    dt.manual_seed(2)
    dst = Net()
    before = dst.block.fc.weight
    result = dst.load_state_dict(sd)
    assert result == ([], []) and result.missing_keys == []
    assert dst.block.fc.weight is before and before.requires_grad
    for key, value in dst.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), sd[key].numpy(), err_msg=key)


def test_load_state_dict_strict_errors_change_nothing():
    dt.manual_seed(3)
    net = Net()
    snapshot = {k: v.numpy().copy() for k, v in net.state_dict().items()}
    sd = Net().state_dict()
    del sd["block.scale"]
    sd["extra"] = dt.zeros(1)
    with pytest.raises(ArgumentError) as err:
        net.load_state_dict(sd)
    assert 'Unexpected key(s) in state_dict: "extra"' in str(err.value)
    assert 'Missing key(s) in state_dict: "block.scale"' in str(err.value)
    bad = Net().state_dict()
    bad["head.1.weight"] = dt.zeros(3, 4)
    with pytest.raises(ArgumentError, match=r"size mismatch for head.1.weight: .*\(3, 4\)"):
        net.load_state_dict(bad, strict=False)
    for key, value in net.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), snapshot[key], err_msg=key)
    missing, unexpected = net.load_state_dict(sd, strict=False)
    assert (missing, unexpected) == (["block.scale"], ["extra"])
    np.testing.assert_array_equal(net.block.fc.weight.detach().numpy(),
                                  sd["block.fc.weight"].numpy())


def test_hooks_modify_args_and_outputs_and_are_removable():
    m = nn.Linear(2, 2)
    x = dt.ones(1, 2)
    calls = []
    h1 = m.register_forward_pre_hook(lambda mod, args: (args[0] * 0.0,))
    h2 = m.register_forward_hook(lambda mod, args, out: calls.append("second"))
    m.register_forward_hook(lambda mod, args, out: calls.append("first"), prepend=True)
    h3 = m.register_forward_hook(lambda mod, args, kwargs, out: out + 1.0, with_kwargs=True)
    out = m(x)
    np.testing.assert_allclose(out.detach().numpy(), m.bias.detach().numpy()[None] + 1.0)
    assert calls == ["first", "second"]
    for h in (h1, h2, h3):
        h.remove()
    np.testing.assert_allclose(m(x).detach().numpy(), m.forward(x).detach().numpy())
    with m.register_forward_pre_hook(lambda mod, a, k: ((a[0] * 2.0,), k), with_kwargs=True):
        np.testing.assert_allclose(m(x).detach().numpy(), m.forward(x * 2.0).detach().numpy())
    assert not m._forward_pre_hooks


def test_train_eval_with_dropout():
    net = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    assert net.training and net[1].training
    x = dt.ones(64, 4)
    assert net.eval() is net and not net[1].training
    np.testing.assert_array_equal(net(x).detach().numpy(), net[0](x).detach().numpy())
    net.train()
    y, ref = net(x).detach().numpy(), net[0](x).detach().numpy()
    kept = y != 0
    assert 0.3 < kept.mean() < 0.7
    np.testing.assert_allclose(y[kept], 2.0 * ref[kept], rtol=1e-6)
    with pytest.raises(ArgumentError, match="boolean"):
        net.train("yes")


def test_apply_zero_grad_requires_grad():
    net = Net()
    seen = net.apply(lambda m: nn.init.zeros_(m.weight) if isinstance(m, nn.Linear) else None)
    assert seen is net and not net.head[1].weight.detach().numpy().any()
    net(dt.ones(2, 3)).sum().backward()
    assert net.block.fc.bias.grad is not None
    net.zero_grad(set_to_none=False)
    assert not net.block.fc.bias.grad.numpy().any()
    net.zero_grad()
    assert all(p.grad is None for p in net.parameters())
    assert not any(p.requires_grad for p in net.requires_grad_(False).parameters())


def test_to_dtype_casts_float_state_and_keeps_sharing():
    block = Block()
    block.fc.weight.grad = dt.ones(4, 3)
    assert block.to(dt.float64) is block
    assert all(p.dtype == np.float64 and isinstance(p, nn.Parameter) and p.requires_grad
               for p in block.parameters())
    assert block.fc.weight.grad.dtype == np.float64
    assert block.steps.dtype == np.int64 and block.cache.dtype == np.float64
    b1, b2 = nn.Linear(2, 2), nn.Linear(2, 2)
    b2.weight = b1.weight
    tied = nn.Sequential(b1, b2).to("float64")
    assert tied[0].weight is tied[1].weight and tied[0].weight.dtype == np.float64


def test_repr_is_pytorch_like():
    net = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Dropout(0.1), nn.LayerNorm(3))
    assert repr(net) == (
        "Sequential(\n"
        "  (0): Linear(in_features=2, out_features=3, bias=True)\n"
        "  (1): ReLU()\n"
        "  (2): Dropout(p=0.1, inplace=False)\n"
        "  (3): LayerNorm((3,), eps=1e-05, elementwise_affine=True)\n"
        ")"
    )
    assert repr(nn.Embedding(5, 2, padding_idx=-1)) == "Embedding(5, 2, padding_idx=4)"
    assert repr(nn.GELU("tanh")) == "GELU(approximate='tanh')"
    nested = repr(Net())
    assert "(block): Block(\n    (fc): Linear(in_features=3" in nested
