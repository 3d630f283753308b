"""``dt.utils.checkpoint`` and ``dt.nn.checkpoint_wrapper`` on local tensors: the gradients of a
checkpointed MLP with dropout are bitwise those of the unchecked run (same seed), with
inputs that do not require grad, nested checkpoints, keyword arguments and
``autograd.grad``; an input changed in place raises; the peak allocated memory of forward
and backward is lower."""

from __future__ import annotations

import numpy as np
import pytest

import dtensor as dt
from dtensor.errors import AutogradError, SignatureError
from dtensor.nn import checkpoint_wrapper
from dtensor.utils import checkpoint

D, H, LAYERS = 16, 128, 4


def params(seed=0):
    rng = np.random.default_rng(seed)
    return [(dt.tensor(rng.standard_normal((D, H)) / 4, dtype=dt.float32, requires_grad=True),
             dt.tensor(rng.standard_normal((H, D)) / 8, dtype=dt.float32, requires_grad=True))
            for _ in range(LAYERS)]


def layer(x, w1, w2, *, p=0.25):
    return dt.dropout((x @ w1).relu(), p, True) @ w2 + x


def run(ps, x, wrap, seed=7):
    """Forward and backward of the stack, each layer through ``wrap``; the gradients."""
    dt.manual_seed(seed)
    h = x
    for w1, w2 in ps:
        h = wrap(h, w1, w2)
    h.square().sum().backward()
    return [w.grad.numpy().copy() for pair in ps for w in pair]


def same(a, b):
    assert len(a) == len(b)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u, v)


def test_gradients_bitwise_equal_with_dropout():
    x0 = np.random.default_rng(1).standard_normal((8, D)).astype(np.float32)
    want = run(params(), dt.tensor(x0), layer)
    # inputs that do not require grad: the parameters (leaves read inside) still get theirs
    same(run(params(), dt.tensor(x0), lambda h, a, b: checkpoint(layer, h, a, b)), want)
    # keyword arguments (a tensor among them), and the module wrapper
    same(run(params(), dt.tensor(x0), lambda h, a, b: checkpoint(layer, h, a, w2=b, p=0.25)),
         want)
    wrapped = checkpoint_wrapper(layer)
    same(run(params(), dt.tensor(x0), wrapped), want)
    # nested: two layers per outer checkpoint, each layer checkpointed inside
    ps = params()

    def pair(h, i):
        for w1, w2 in ps[i:i + 2]:
            h = checkpoint(layer, h, w1, w2)
        return h

    dt.manual_seed(7)
    h = dt.tensor(x0, requires_grad=True)
    out = checkpoint(pair, checkpoint(pair, h, 0), 2)
    out.square().sum().backward()
    same([w.grad.numpy() for p in ps for w in p], want)
    # without preserve_rng_state the masks differ
    other = run(params(), dt.tensor(x0), lambda h, a, b: checkpoint(
        layer, h, a, b, preserve_rng_state=False))
    assert not all(np.array_equal(u, v) for u, v in zip(other, want))


def test_autograd_grad_input_grads_and_errors():
    ps = params(2)
    x0 = np.random.default_rng(3).standard_normal((4, D)).astype(np.float32)
    dt.manual_seed(5)
    x = dt.tensor(x0, requires_grad=True)
    loss = layer(layer(x, *ps[0]), *ps[1]).sum()
    want = dt.autograd.grad(loss, [x, *ps[1]])
    dt.manual_seed(5)
    x = dt.tensor(x0, requires_grad=True)
    loss = checkpoint(layer, checkpoint(layer, x, *ps[0]), *ps[1]).sum()
    got = dt.autograd.grad(loss, [x, *ps[1]])
    same([g.numpy() for g in got], [g.numpy() for g in want])
    assert all(w.grad is None for p in ps for w in p)  # grad() touches no .grad

    h = x * 1.0
    y = checkpoint(layer, h, *ps[0])
    assert y.grad_fn.name() == "CheckpointBackward0"
    h.add_(1.0)
    with pytest.raises(AutogradError, match="modified by an inplace operation"):
        y.sum().backward()
    with pytest.raises(SignatureError, match="Unexpected keyword arguments: p"):
        checkpoint(layer, x, *ps[0], p=0.5, use_reentrant=True)
    with dt.no_grad():
        assert not checkpoint(layer, x, *ps[0]).requires_grad


def test_peak_memory_is_lower():
    x0 = np.random.default_rng(4).standard_normal((64, D)).astype(np.float32)

    def peak(wrap):
        ps = params()
        x = dt.tensor(x0)
        dt.reset_peak_memory_stats()
        base = dt.memory_stats()["allocated_bytes"]
        run(ps, x, wrap)
        return dt.memory_stats()["peak_allocated_bytes"] - base

    plain = peak(layer)
    checked = peak(lambda h, a, b: checkpoint(layer, h, a, b))
    # one layer's activations (64 x 128 floats, a few of them) instead of four layers'
    assert checked < 0.7 * plain, (checked, plain)
