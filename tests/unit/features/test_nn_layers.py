"""``dt.nn`` layers, containers, ``dt.nn.functional`` and ``dt.nn.init`` on local tensors:
each layer's forward and gradients against a numpy reference on the same weights (the
gradients by central differences of that reference), PyTorch's default initialisations
and the statistics and bounds of the init functions."""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict

import numpy as np
import pytest

import dtensor as dt
from dtensor.errors import ArgumentError, DimError
from dtensor.nn import init

nn, F = dt.nn, dt.nn.functional
ERF = np.vectorize(math.erf)


def numeric_grad(f, x, eps=1e-6):
    """d f / d x of the scalar function ``f`` of the array ``x``, by central differences."""
    g = np.zeros_like(x)
    for idx in itertools.product(*map(range, x.shape)):
        hi, lo = x.copy(), x.copy()
        hi[idx] += eps
        lo[idx] -= eps
        g[idx] = (f(hi) - f(lo)) / (2 * eps)
    return g


def set_params(module, rng):
    """Random float64 values in every parameter (so that gradients are not degenerate)."""
    values = {}
    with dt.no_grad():
        for name, p in module.named_parameters():
            values[name] = rng.standard_normal(tuple(p.shape))
            p.copy_(dt.tensor(values[name]))
    return values


def check_layer(module, ref, x, rng, *, grad_input=True, extra=()):
    """``module(x, *extra)`` and the gradients of ``sum(out * g)`` against ``ref(x, params)``."""
    params = set_params(module, rng)
    xt = dt.tensor(x, requires_grad=grad_input)
    out = module(xt, *(dt.tensor(e) for e in extra))
    want = ref(x, params)
    np.testing.assert_allclose(out.detach().numpy(), want, rtol=1e-7, atol=1e-9)
    g = rng.standard_normal(np.shape(want))
    (out * dt.tensor(g)).sum().backward()
    if grad_input:
        np.testing.assert_allclose(
            xt.grad.numpy(), numeric_grad(lambda v: (ref(v, params) * g).sum(), x),
            rtol=1e-5, atol=1e-7)
    for name, p in module.named_parameters():
        def f(v, name=name):
            return (ref(x, {**params, name: v}) * g).sum()

        np.testing.assert_allclose(p.grad.numpy(), numeric_grad(f, params[name]),
                                   rtol=1e-5, atol=1e-7, err_msg=name)
    return params


def test_linear_forward_and_grads():
    rng = np.random.default_rng(0)
    ref = lambda x, p: x @ p["weight"].T + p["bias"]
    check_layer(nn.Linear(5, 3, dtype=dt.float64), ref, rng.standard_normal((2, 3, 5)), rng)
    lin = nn.Linear(4, 2, bias=False, dtype=dt.float64)
    assert lin.bias is None and len(list(lin.parameters())) == 1
    check_layer(lin, lambda x, p: x @ p["weight"].T, rng.standard_normal((3, 4)), rng)


def test_layer_norm_forward_and_grads():
    rng = np.random.default_rng(1)

    def ref(x, p):
        mu = x.mean(axis=(-2, -1), keepdims=True)
        var = ((x - mu) ** 2).mean(axis=(-2, -1), keepdims=True)
        return (x - mu) / np.sqrt(var + 1e-5) * p["weight"] + p["bias"]

    check_layer(nn.LayerNorm((2, 3), dtype=dt.float64), ref, rng.standard_normal((4, 2, 3)), rng)
    ln = nn.LayerNorm(3, elementwise_affine=False, dtype=dt.float64)
    assert ln.weight is None and ln.bias is None
    x = rng.standard_normal((2, 3))
    y = ln(dt.tensor(x)).numpy()
    np.testing.assert_allclose(y, (x - x.mean(-1, keepdims=True))
                               / np.sqrt(x.var(-1, keepdims=True) + 1e-5), rtol=1e-7)


def test_embedding_forward_and_grads_skip_the_padding_row():
    rng = np.random.default_rng(2)
    emb = nn.Embedding(6, 3, padding_idx=1, dtype=dt.float64)
    assert not emb.weight.detach().numpy()[1].any()  # the padding row starts at zero
    idx = np.array([[0, 1, 5], [1, 3, 0]])
    params = set_params(emb, rng)
    out = emb(dt.tensor(idx))
    np.testing.assert_array_equal(out.detach().numpy(), params["weight"][idx])
    g = rng.standard_normal(out.shape)
    (out * dt.tensor(g)).sum().backward()
    want = np.zeros((6, 3))
    np.add.at(want, idx, g)
    want[1] = 0.0
    np.testing.assert_allclose(emb.weight.grad.numpy(), want, rtol=1e-12)
    with pytest.raises(ArgumentError, match="padding_idx"):
        nn.Embedding(3, 2, padding_idx=3)


@pytest.mark.parametrize(
    ("module", "ref"),
    [
        (nn.GELU(), lambda x, p: 0.5 * x * (1.0 + ERF(x / math.sqrt(2.0)))),
        (nn.GELU("tanh"), lambda x, p: 0.5 * x * (1.0 + np.tanh(
            math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))),
        (nn.SiLU(), lambda x, p: x / (1.0 + np.exp(-x))),
        (nn.ReLU(), lambda x, p: np.maximum(x, 0.0)),
    ],
    ids=["gelu", "gelu-tanh", "silu", "relu"],
)
def test_activations(module, ref):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 4))
    x[np.abs(x) < 1e-3] = 0.5  # away from relu's kink
    check_layer(module, ref, x, rng)


def test_inplace_activations_write_their_input():
    x = dt.tensor([-1.0, 2.0])
    assert nn.ReLU(inplace=True)(x) is x and x.numpy().tolist() == [0.0, 2.0]
    y = dt.tensor([1.0])
    nn.SiLU(inplace=True)(y)
    np.testing.assert_allclose(y.numpy(), [1.0 / (1.0 + math.exp(-1.0))], rtol=1e-6)
    assert repr(nn.ReLU(inplace=True)) == "ReLU(inplace=True)"


def test_dropout_gradient_is_the_mask():
    x = dt.ones(200, dtype=dt.float64, requires_grad=True)
    y = nn.Dropout(0.25)(x)
    y.sum().backward()
    kept = y.detach().numpy() != 0
    np.testing.assert_allclose(x.grad.numpy(), kept / 0.75)
    np.testing.assert_allclose(y.detach().numpy()[kept], 1 / 0.75)
    np.testing.assert_array_equal(nn.Dropout(0.0)(x).detach().numpy(), 1.0)
    with pytest.raises(ArgumentError, match="between 0 and 1"):
        nn.Dropout(1.5)


def test_cross_entropy_loss_with_weight_ignore_index_and_smoothing():
    rng = np.random.default_rng(4)
    n, c, eps = 5, 4, 0.1
    target = np.array([0, 3, -100, 1, 3])
    w = rng.uniform(0.5, 2.0, c)

    def ref(x, p):
        z = x - x.max(1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(1, keepdims=True))
        keep = target != -100
        t = np.where(keep, target, 0)
        nll = -(w[t] * logp[np.arange(n), t])
        smooth = -(logp * w).sum(1)
        per = ((1 - eps) * nll + eps / c * smooth) * keep
        return per.sum() / (w[t] * keep).sum()

    loss = nn.CrossEntropyLoss(dt.tensor(w), label_smoothing=eps)
    assert [k for k, _ in loss.named_buffers()] == ["weight"]
    check_layer(loss, ref, rng.standard_normal((n, c)), rng, extra=(target,))
    plain = nn.CrossEntropyLoss(reduction="sum")
    x = rng.standard_normal((3, c))
    t = np.array([2, 0, 1])
    z = x - np.log(np.exp(x).sum(1, keepdims=True))
    np.testing.assert_allclose(plain(dt.tensor(x), dt.tensor(t)).numpy(),
                               -z[np.arange(3), t].sum(), rtol=1e-10)


def test_mse_loss():
    rng = np.random.default_rng(5)
    t = rng.standard_normal((3, 2))
    check_layer(nn.MSELoss(), lambda x, p: ((x - t) ** 2).mean(), rng.standard_normal((3, 2)),
                rng, extra=(t,))
    out = nn.MSELoss(reduction="none")(dt.tensor(t), dt.zeros(3, 2, dtype=dt.float64))
    np.testing.assert_allclose(out.numpy(), t**2)


def test_functional_names_are_the_dispatching_functions():
    for name in ("linear", "embedding", "layer_norm", "dropout", "gelu", "softmax",
                 "log_softmax", "cross_entropy", "mse_loss"):
        assert getattr(F, name) is getattr(dt, name), name
    x = dt.tensor([[1.0, -2.0, 0.5]])
    np.testing.assert_allclose(F.relu(x).numpy(), [[1.0, 0.0, 0.5]])
    np.testing.assert_allclose(F.softmax(x, -1).numpy().sum(), 1.0, rtol=1e-6)


def test_containers():
    a, b, c = nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1)
    seq = nn.Sequential(OrderedDict([("fc1", a), ("act", b), ("fc2", c)]))
    assert [n for n, _ in seq.named_children()] == ["fc1", "act", "fc2"]
    assert seq[-1] is c and len(seq) == 3 and list(seq) == [a, b, c]
    x = dt.ones(4, 2)
    np.testing.assert_allclose(seq(x).detach().numpy(), c(b(a(x))).detach().numpy())
    head = seq[:2]
    assert isinstance(head, nn.Sequential) and list(head) == [a, b]
    pos = nn.Sequential(a, b, c)
    del pos[0]
    assert [n for n, _ in pos.named_children()] == ["0", "1"] and pos[0] is b
    pos.append(a)
    pos[1] = nn.GELU()
    assert list(pos._modules) == ["0", "1", "2"] and isinstance(pos[1], nn.GELU)
    with pytest.raises(DimError, match="index 5 is out of range"):
        pos[5]

    layers = nn.ModuleList([a])
    layers += [c]
    layers.insert(1, b)
    assert list(layers) == [a, b, c] and layers[-2] is b
    assert len(list(layers.parameters())) == 4
    assert isinstance(layers[1:], nn.ModuleList) and len(layers[1:]) == 2

    d = nn.ModuleDict({"enc": a})
    d["dec"] = c
    d.update([("act", b)])
    assert list(d) == ["enc", "dec", "act"] and "dec" in d and d["act"] is b
    assert len(list(d.parameters())) == 4
    assert d.pop("enc") is a and list(d.keys()) == ["dec", "act"]


def test_default_initialisations_are_pytorchs():
    lin = nn.Linear(64, 32)
    bound = 1 / math.sqrt(64)
    w, bias = lin.weight.detach().numpy(), lin.bias.detach().numpy()
    assert np.abs(w).max() <= bound and np.abs(w).max() > 0.95 * bound
    assert np.abs(bias).max() <= bound
    np.testing.assert_allclose(w.std(), bound / math.sqrt(3), rtol=0.05)
    emb = nn.Embedding(100, 50).weight.detach().numpy()
    assert abs(emb.mean()) < 0.03 and abs(emb.std() - 1) < 0.03
    ln = nn.LayerNorm(4)
    assert ln.weight.detach().numpy().tolist() == [1.0] * 4
    assert ln.bias.detach().numpy().tolist() == [0.0] * 4
    dt.manual_seed(5)
    first = nn.Linear(3, 4).state_dict()
    dt.manual_seed(5)
    for k, v in nn.Linear(3, 4).state_dict().items():
        np.testing.assert_array_equal(v.numpy(), first[k].numpy())


def test_init_values_come_from_the_random_factories():
    t = dt.empty(6, 5)
    dt.manual_seed(7)
    u = dt.rand(6, 5).numpy()
    dt.manual_seed(7)
    assert init.uniform_(t, -1.0, 3.0) is t
    np.testing.assert_allclose(t.numpy(), u * 4.0 - 1.0, rtol=1e-6)
    dt.manual_seed(8)
    z = dt.randn(6, 5).numpy()
    dt.manual_seed(8)
    np.testing.assert_allclose(init.normal_(t, 2.0, 0.5).numpy(), z * 0.5 + 2.0, rtol=1e-6)


def test_init_statistics_and_bounds():
    t = dt.empty(200, 100, dtype=dt.float64)
    init.trunc_normal_(t)
    v = t.numpy()
    assert v.min() >= -2.0 and v.max() <= 2.0
    # the std of N(0, 1) truncated to [-2, 2]
    z = math.erf(2 / math.sqrt(2))
    pdf2 = math.exp(-2.0) / math.sqrt(2 * math.pi)
    assert abs(v.mean()) < 0.02 and abs(v.std() - math.sqrt(1 - 4 * pdf2 / z)) < 0.01
    v = init.trunc_normal_(t, mean=1.0, std=2.0, a=0.0, b=3.0).numpy()
    assert v.min() >= 0.0 and v.max() <= 3.0 and v.max() > 2.99
    w = dt.empty(30, 20)
    assert np.abs(init.xavier_uniform_(w, gain=2.0).numpy()).max() <= 2 * math.sqrt(6 / 50)
    big = dt.empty(400, 300)
    np.testing.assert_allclose(init.xavier_normal_(big).numpy().std(), math.sqrt(2 / 700),
                               rtol=0.02)
    np.testing.assert_allclose(
        init.kaiming_normal_(big, mode="fan_out", nonlinearity="relu").numpy().std(),
        math.sqrt(2 / 400), rtol=0.02)
    bound = math.sqrt(3) * math.sqrt(2 / 1.01) / math.sqrt(300)
    kv = np.abs(init.kaiming_uniform_(big, a=0.1).numpy())
    assert kv.max() <= bound and kv.max() > 0.99 * bound
    assert init.constant_(w, 0.5).numpy().min() == 0.5 and init.ones_(w).numpy().max() == 1.0
    assert not init.zeros_(w).numpy().any()


def test_erfinv_inverts_erf():
    x = np.linspace(-0.9999, 0.9999, 2001)
    y = init._erfinv(dt.tensor(x)).numpy()
    np.testing.assert_allclose(ERF(y), x, atol=1e-6)
    assert init._erfinv(dt.tensor([-1.0, 1.0])).numpy().tolist() == [-math.inf, math.inf]


def test_gains_fans_and_errors():
    assert init.calculate_gain("linear") == 1 and init.calculate_gain("tanh") == 5.0 / 3
    assert init.calculate_gain("relu") == math.sqrt(2.0)
    assert init.calculate_gain("leaky_relu", 0.2) == math.sqrt(2.0 / 1.04)
    with pytest.raises(ArgumentError, match="Unsupported nonlinearity"):
        init.calculate_gain("swish")
    with pytest.raises(ArgumentError, match="fewer than 2 dimensions"):
        init.xavier_uniform_(dt.empty(3))
    with pytest.raises(ArgumentError, match="Mode fan_avg not supported"):
        init.kaiming_uniform_(dt.empty(2, 2), mode="fan_avg")
    with pytest.warns(UserWarning, match="zero-element"):
        init.kaiming_uniform_(dt.empty(0, 3))
    with pytest.warns(UserWarning, match="more than 2 std"):
        init.trunc_normal_(dt.empty(2), mean=5.0)


def test_dropout_of_p_0_and_in_eval_mode_is_the_input_itself():
    x = dt.randn(4, 5).requires_grad_()
    assert nn.Dropout(0.0)(x) is x and nn.Dropout(0.5).eval()(x) is x
    y = nn.Dropout(0.5)(x)
    assert y is not x and y.grad_fn is not None


def test_abstract_parameters_build_layers_without_data():
    before = dt.abstract_memory_stats()["live_bytes"]
    with nn.abstract_parameters() as mesh:
        model = nn.Sequential(nn.Embedding(50, 8), nn.LayerNorm(8), nn.Linear(8, 12))
    assert mesh == dt.AbstractMesh((1,))
    params = list(model.parameters())
    assert all(isinstance(p, dt.AbstractDTensor) and p.device_mesh == mesh for p in params)
    assert [tuple(p.shape) for p in params] == [(50, 8), (8,), (8,), (12, 8), (12,)]
    # the blocks the parameters would hold, nothing more (the inits ran on metadata)
    assert dt.abstract_memory_stats()["live_bytes"] - before == 4 * (400 + 16 + 96 + 12)
    with pytest.raises(dt.errors.MetadataOnlyError):
        params[0].item()
    out = model(dt.abstract_tensor((3, 7), mesh, dtype="int64"))
    assert out.shape == (3, 7, 12) and isinstance(out, dt.AbstractDTensor)
    mesh2 = dt.AbstractMesh((2,))
    with nn.abstract_parameters(mesh2):
        lin = nn.Linear(4, 6)
    assert lin.weight.device_mesh == mesh2 and lin.weight.placements == (dt.Replicate(),)
    assert not isinstance(nn.Linear(4, 6).weight, dt.DTensor)  # only inside the block
    with pytest.raises(dt.errors.MeshError, match="AbstractMesh without coord"), \
            nn.abstract_parameters(dt.AbstractMesh((2,), coord=(0,))):
        pass

