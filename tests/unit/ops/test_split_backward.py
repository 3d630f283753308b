"""The split backward of zero-bubble pipelines (``grad_engine.backward_input`` and
``WeightWork.run``) on small graphs: the input half's gradients and the weight half's
``.grad`` equal a full backward's bit for bit (the same formulas run on the same values) and
PyTorch's (the oracle, on the same float64 data); the input half computes the input edges
only, the weight half the rest, and no ``.grad`` or hook moves before ``run()``."""

from __future__ import annotations

import numpy as np
import pytest

import dtensor as dt
from dtensor.errors import AutogradError
from dtensor.local import grad_engine as _ag

F = dt.nn.functional


def _data(seed, shapes):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s) for k, s in shapes.items()}


def _leaves(lib, data, names):
    """The arrays of ``data`` as float64 leaves of ``lib`` (dt or torch); those in
    ``names`` require grad."""
    out = {}
    for k, a in data.items():
        t = lib.from_numpy(a.copy())
        if k in names:
            t.requires_grad_(True)
        out[k] = t
    return out


# Each graph: (shapes, grad names, input names, fn(lib, F, t) -> output); the same code
# builds dtensor's and torch's graph.
def _chain(lib, f, t):
    h = f.linear(t["x"], t["w1"], t["b1"]).tanh()
    return f.linear(h, t["w2"], t["b2"])


def _twice(lib, f, t):
    h = (t["x"] @ t["w"]).relu()
    return (h @ t["w"]) * t["x"]


def _tied(lib, f, t):
    h = f.embedding(t["idx"], t["e"]) + t["x"]
    h = f.layer_norm(h, (4,), t["g"], t["b"])
    return h @ t["e"].t()


def _view(lib, f, t):
    w = t["w"].reshape(4, 3).t()  # a weight reached through views: its chain is the W half's
    return (t["x"] @ w).sin() @ t["v"].transpose(0, 1)


def _norms(lib, f, t):
    h = f.layer_norm(t["x"], (6,), t["g"], t["b"])
    return f.embedding(t["idx"], t["e"]) * h.exp()


def _no_input(lib, f, t):
    return f.linear(f.embedding(t["idx"], t["e"]), t["w"]).tanh()


IDX = np.array([[1, 0, 3], [2, 2, 4]])
GRAPHS = {
    "chain": ({"x": (5, 3), "w1": (4, 3), "b1": (4,), "w2": (2, 4), "b2": (2,)},
              ("x", "w1", "b1", "w2", "b2"), ("x",), _chain),
    "weight_used_twice": ({"x": (3, 3), "w": (3, 3)}, ("x", "w"), ("x",), _twice),
    "tied": ({"x": (2, 3, 4), "e": (5, 4), "g": (4,), "b": (4,)},
             ("x", "e", "g", "b"), ("x",), _tied),
    "view_of_weight": ({"x": (2, 3), "w": (12,), "v": (5, 4)}, ("x", "w", "v"), ("x",), _view),
    "layer_norm_embedding": ({"x": (2, 3, 6), "g": (6,), "b": (6,), "e": (5, 6)},
                             ("x", "g", "b", "e"), ("x",), _norms),
    "input_needs_no_grad": ({"e": (5, 4), "w": (3, 4)}, ("e", "w"), (), _no_input),
}


def _build(lib, name, data):
    _, grads, _, fn = GRAPHS[name]
    t = _leaves(lib, data, grads)
    t["idx"] = lib.from_numpy(IDX)
    return t, fn(lib, lib.nn.functional, t)


@pytest.mark.torch
@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_split_equals_full_backward_and_torch(name):
    import torch  # lazy: the oracle (the tests using it are marked torch)

    shapes, grads, inputs, _ = GRAPHS[name]
    data = _data(len(name), shapes)
    # full backward (dtensor)
    full, out = _build(dt, name, data)
    gout = np.random.default_rng(1).standard_normal(tuple(out.shape))
    out.backward(dt.from_numpy(gout.copy()))
    # split
    t, out = _build(dt, name, data)
    weights = [t[k] for k in grads if k not in inputs]
    gx, work = _ag.backward_input([out], [dt.from_numpy(gout.copy())],
                                  [t[k] for k in inputs], weights)
    assert all(w.grad is None for w in weights)  # nothing accumulated before W
    for k in inputs:
        assert t[k].grad is None
    work.run()
    # oracle
    tt, tout = _build(torch, name, data)
    tout.backward(torch.from_numpy(gout))
    for k, g in zip(inputs, gx):
        np.testing.assert_array_equal(g.numpy(), full[k].grad.numpy())
        np.testing.assert_allclose(g.numpy(), tt[k].grad.numpy(), rtol=1e-12, atol=1e-12)
    for k in grads:
        if k in inputs:
            continue
        np.testing.assert_array_equal(t[k].grad.numpy(), full[k].grad.numpy())
        np.testing.assert_allclose(t[k].grad.numpy(), tt[k].grad.numpy(), rtol=1e-12,
                                   atol=1e-12)


def test_non_leaf_inputs():
    """Inputs that are intermediates: the gradient of each, as autograd.grad gives it."""
    data = _data(3, {"x": (3, 4), "y": (3, 4), "w": (2, 4), "b": (2,)})
    gout = np.random.default_rng(2).standard_normal((3, 2))
    res = {}
    for split in (False, True):
        t = _leaves(dt, data, ("x", "y", "w", "b"))
        z = t["x"] * 2.0
        out = F.linear(z + t["y"], t["w"], t["b"]) * z.sum(dim=1, keepdim=True)
        if split:
            got, work = _ag.backward_input([out], [dt.from_numpy(gout)], [z, t["y"]],
                                           [t["w"], t["b"]])
            work.run()
            res[split] = [g.numpy() for g in got] + [t["w"].grad.numpy(), t["b"].grad.numpy()]
        else:
            got = dt.autograd.grad([out], [z, t["y"]], [dt.from_numpy(gout)],
                                   retain_graph=True)
            dt.autograd.backward([out], [dt.from_numpy(gout)], inputs=[t["w"], t["b"]])
            res[split] = [g.numpy() for g in got] + [t["w"].grad.numpy(), t["b"].grad.numpy()]
    for a, b in zip(res[False], res[True]):
        np.testing.assert_array_equal(a, b)


def test_each_half_computes_its_edges_only(monkeypatch):
    """The input half runs linear's formula for the input edge only, the weight half for
    the weight and bias edges only; a node with input edges only runs whole, once."""
    calls = []
    real = _ag.needed

    def spy(node):
        need = real(node)
        calls.append((node.op, tuple(need)))
        return need

    monkeypatch.setattr(_ag, "needed", spy)
    data = _data(5, {"x": (5, 3), "w1": (4, 3), "b1": (4,), "w2": (2, 4), "b2": (2,)})
    t = _leaves(dt, data, ("x", "w1", "b1", "w2", "b2"))
    out = _chain(dt, F, t)
    g = dt.ones(tuple(out.shape), dtype=dt.float64)
    _, work = _ag.backward_input([out], [g], [t["x"]], [t[k] for k in ("w1", "b1", "w2", "b2")])
    assert calls == [("linear", (True, False, False)), ("tanh", (True,)),
                     ("linear", (True, False, False))]
    assert work.pending == 2
    calls.clear()
    work.run()
    assert sorted(calls) == [("linear", (False, True, True))] * 2
    assert work.pending == 0


def test_layer_norm_gives_its_affine_gradients_in_the_input_half(monkeypatch):
    """layer_norm's fused pass yields the weight's and bias's gradients with the input's:
    the input half keeps them (two d-vectors, not the output gradient) and the node does
    not run again; they reach ``.grad`` at ``run()``, equal to a full backward's."""
    calls = []
    real = _ag.needed

    def spy(node):
        calls.append(node.op)
        return real(node)

    monkeypatch.setattr(_ag, "needed", spy)
    data = _data(13, {"x": (2, 3, 6), "g": (6,), "b": (6,), "w": (4, 6)})
    names = ("x", "g", "b", "w")

    def fn(t):
        return F.linear(F.layer_norm(t["x"], (6,), t["g"], t["b"]), t["w"]).tanh().sum()

    ref = _leaves(dt, data, names)
    fn(ref).backward()
    t = _leaves(dt, data, names)
    calls.clear()
    (gx,), work = _ag.backward_input([fn(t)], None, [t["x"]], [t["g"], t["b"], t["w"]])
    assert calls.count("layer_norm") == 1 and t["g"].grad is None
    calls.clear()
    work.run()
    assert calls == ["linear"]
    np.testing.assert_array_equal(gx.numpy(), ref["x"].grad.numpy())
    for k in ("g", "b", "w"):
        np.testing.assert_array_equal(t[k].grad.numpy(), ref[k].grad.numpy())


def test_weight_only_subgraph_waits_for_w(monkeypatch):
    """What leads only to the weights (a view of a weight) runs in the weight half."""
    seen = []
    real = _ag.Node.apply

    def spy(node, grads):
        seen.append(node.op)
        return real(node, grads)

    monkeypatch.setattr(_ag.Node, "apply", spy)
    data = _data(6, {"x": (2, 3), "w": (12,), "v": (5, 4)})
    t = _leaves(dt, data, ("x", "w", "v"))
    out = _view(dt, F, t)
    _, work = _ag.backward_input([out], [dt.ones(tuple(out.shape), dtype=dt.float64)],
                                 [t["x"]], [t["w"], t["v"]])
    first = list(seen)
    assert "reshape" not in first and "t" not in first and "transpose" not in first
    seen.clear()
    work.run()
    assert {"reshape", "t", "transpose"} <= set(seen)


def test_hooks_fire_once_at_w_with_the_summed_gradient():
    data = _data(7, {"x": (3, 3), "w": (3, 3)})
    t = _leaves(dt, data, ("x", "w"))
    fired = []
    t["w"].register_post_accumulate_grad_hook(lambda p: fired.append(p.grad.numpy().copy()))
    out = _twice(dt, F, t)
    g = dt.ones((3, 3), dtype=dt.float64)
    _, work = _ag.backward_input([out], [g], [t["x"]], [t["w"]])
    assert fired == []
    work.run()
    assert len(fired) == 1
    ref = _leaves(dt, data, ("x", "w"))
    _twice(dt, F, ref).backward(dt.ones((3, 3), dtype=dt.float64))
    np.testing.assert_array_equal(fired[0], ref["w"].grad.numpy())


def test_accumulates_onto_existing_grad():
    data = _data(8, {"x": (5, 3), "w1": (4, 3), "b1": (4,), "w2": (2, 4), "b2": (2,)})
    ws = ("w1", "b1", "w2", "b2")
    t = _leaves(dt, data, ("x", *ws))
    ref = _leaves(dt, data, ("x", *ws))
    for _ in range(2):
        _chain(dt, F, ref).sum().backward()
        _, work = _ag.backward_input([_chain(dt, F, t).sum()], None, [t["x"]],
                                     [t[k] for k in ws])
        work.run()
    for k in ws:
        np.testing.assert_array_equal(t[k].grad.numpy(), ref[k].grad.numpy())


def test_graph_is_freed_by_halves():
    """Nodes used by the input half only are freed at its end; the rest after run()."""
    data = _data(9, {"x": (5, 3), "w1": (4, 3), "b1": (4,), "w2": (2, 4), "b2": (2,)})
    t = _leaves(dt, data, ("x", "w1", "b1", "w2", "b2"))
    h = F.linear(t["x"], t["w1"], t["b1"])
    a = h.tanh()
    out = F.linear(a, t["w2"], t["b2"]).sum()
    _, work = _ag.backward_input([out], None, [t["x"]], [t[k] for k in ("w1", "b1", "w2", "b2")])
    assert a.grad_fn.released and not h.grad_fn.released
    work.run()
    assert h.grad_fn.released
    with pytest.raises(AutogradError, match="second time"):
        out.backward()


def test_retain_graph_keeps_every_node():
    data = _data(10, {"x": (5, 3), "w1": (4, 3), "b1": (4,), "w2": (2, 4), "b2": (2,)})
    ws = ("w1", "b1", "w2", "b2")
    t = _leaves(dt, data, ("x", *ws))
    out = _chain(dt, F, t).sum()
    (gx,), work = _ag.backward_input([out], None, [t["x"]], [t[k] for k in ws],
                                     retain_graph=True)
    work.run()
    out.backward()  # the graph is still there: a second full pass adds the same again
    np.testing.assert_array_equal(t["x"].grad.numpy(), gx.numpy())
    for k in ws:
        once = _leaves(dt, data, ("x", *ws))
        _chain(dt, F, once).sum().backward()
        np.testing.assert_array_equal(t[k].grad.numpy(), 2 * once[k].grad.numpy())


class _Scale(dt.autograd.Function):
    """x * w with a hand-written backward (which computes both gradients always)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, g * x


def test_custom_function_and_checkpoint():
    """A formula that ignores the mask (a custom Function) and a checkpointed call (which
    finds the weights it reads as it recomputes) still give each gradient once."""
    data = _data(11, {"x": (4, 3), "w": (4, 3), "v": (2, 3), "c": (2,)})
    names = ("x", "w", "v", "c")

    def fn(t):
        h = _Scale.apply(t["x"], t["w"])
        return dt.utils.checkpoint(lambda a: F.linear(a, t["v"], t["c"]).tanh(), h)

    ref = _leaves(dt, data, names)
    fn(ref).sum().backward()
    t = _leaves(dt, data, names)
    (gx,), work = _ag.backward_input([fn(t).sum()], None, [t["x"]],
                                     [t["w"], t["v"], t["c"]])
    assert t["v"].grad is None
    work.run()
    np.testing.assert_array_equal(gx.numpy(), ref["x"].grad.numpy())
    for k in ("w", "v", "c"):
        np.testing.assert_array_equal(t[k].grad.numpy(), ref[k].grad.numpy())


def test_errors():
    data = _data(12, {"x": (3, 3), "w": (3, 3)})
    t = _leaves(dt, data, ("x", "w"))
    out = _twice(dt, F, t).sum()
    with pytest.raises(AutogradError, match="weight 0 .* is also one of the inputs"):
        _ag.backward_input([out], None, [t["x"]], [t["x"]])
    with pytest.raises(AutogradError, match=r"weight 0 \(shape \(3, 3\)\) is not a leaf"):
        _ag.backward_input([out], None, [t["x"]], [t["w"] * 2])
    with pytest.raises(AutogradError, match="element 0 of the inputs does not require grad"):
        _ag.backward_input([out], None, [dt.ones(3)], [t["w"]])
    _, work = _ag.backward_input([out], None, [t["x"]], [t["w"]])
    work.run()
    with pytest.raises(AutogradError, match="already ran"):
        work.run()
