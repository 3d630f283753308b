"""``dt.autograd.Function`` on local tensors: custom exp, mul and two-output functions against
analytic numpy gradients, ``save_for_backward`` and its in-place check, ``needs_input_grad``,
non-differentiable outputs, materialized gradients, PyTorch's errors, composition with table
ops, a Function used twice in one graph and a double backward through one."""

from __future__ import annotations

import numpy as np
import pytest

import dtensor as dt
from dtensor.errors import AutogradError, SignatureError


class Exp(dt.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        assert not dt.is_grad_enabled()
        y = x.exp()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y


class Mul(dt.autograd.Function):
    """``a * b * scale``; ``scale`` a python float."""

    @staticmethod
    def forward(ctx, a, b, scale=1.0):
        ctx.save_for_backward(a, b)
        ctx.scale = scale
        Mul.seen = ctx.needs_input_grad
        return a * b * scale

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        ga = g * b * ctx.scale if ctx.needs_input_grad[0] else None
        gb = g * a * ctx.scale if ctx.needs_input_grad[1] else None
        return ga, gb, None


class SinCos(dt.autograd.Function):
    """Two outputs; the second input is a flag that turns materialization off."""

    @staticmethod
    def forward(ctx, x, materialize):
        ctx.save_for_backward(x)
        ctx.set_materialize_grads(materialize)
        return x.sin(), x.cos()

    @staticmethod
    def backward(ctx, gs, gc):
        (x,) = ctx.saved_tensors
        SinCos.got = (gs, gc)
        out = 0
        if gs is not None:
            out = gs * x.cos()
        if gc is not None:
            out = out - gc * x.sin()
        return out, None


def leaf(shape, seed=0):
    a = np.random.default_rng(seed).standard_normal(shape)
    return a, dt.tensor(a, requires_grad=True)


def test_exp_and_mul_against_numpy():
    a, x = leaf((3, 4))
    y = Exp.apply(x)
    assert y.grad_fn.name() == "ExpBackward" and not y.is_leaf
    np.testing.assert_allclose(y.detach().numpy(), np.exp(a))
    (y * y).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), 2 * np.exp(2 * a), rtol=1e-12)

    _, p = leaf((2, 3), 1)
    a2, q = leaf((2, 3), 2)
    q.requires_grad_(False)
    z = Mul.apply(p, q, 3.0)
    z.sum().backward()
    assert Mul.seen == (True, False, False)  # needs_input_grad
    np.testing.assert_allclose(p.grad.numpy(), 3.0 * a2, rtol=1e-12)
    assert q.grad is None
    Mul.apply(p, q, scale=2.0)  # keywords bind to forward's parameters
    assert Mul.seen == (True, False, False)


def test_two_outputs_and_materialized_grads():
    a, x = leaf((5,))
    s, c = SinCos.apply(x, True)
    (2 * s + 3 * c).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), 2 * np.cos(a) - 3 * np.sin(a), rtol=1e-12)
    s, c = SinCos.apply(x, True)
    s.sum().backward()  # the unused output's gradient is zeros
    np.testing.assert_array_equal(SinCos.got[1].numpy(), np.zeros(5))
    s, c = SinCos.apply(x, False)
    c.sum().backward()
    assert SinCos.got[0] is None


def test_saved_tensor_changed_in_place_raises():
    _, x = leaf((4,))
    h = x * 1.0
    y = Mul.apply(h, h)
    h.mul_(2.0)
    with pytest.raises(AutogradError, match="modified by an inplace operation"):
        y.sum().backward()
    class Keep(Exp):  # keeps its ctx
        @staticmethod
        def forward(ctx, x):
            Keep.ctx = ctx
            return Exp.forward(ctx, x)

    y = Keep.apply(x)
    y.sum().backward()
    ctx = Keep.ctx
    with pytest.raises(AutogradError, match="backward through the graph a second time"):
        y.sum().backward()
    with pytest.raises(AutogradError, match="after they have already been freed"):
        _ = ctx.saved_tensors


def test_non_differentiable_outputs():
    class Split(dt.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            pos = (x > 0).double()
            ctx.mark_non_differentiable(pos)
            return x * pos, pos

        @staticmethod
        def backward(ctx, g, gpos):
            assert np.all(gpos.numpy() == 0)  # materialized zeros
            return g * 2

    _, x = leaf((6,))
    r, pos = Split.apply(x)
    assert r.requires_grad and not pos.requires_grad
    r.sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), np.full(6, 2.0))


def test_pytorch_errors():
    class Bad(dt.autograd.Function):
        @staticmethod
        def forward(ctx, x, y):
            return x + y

        @staticmethod
        def backward(ctx, g):
            return g

    class NotATensor(dt.autograd.Function):
        @staticmethod
        def forward(ctx, x, k):
            return x * k

        @staticmethod
        def backward(ctx, g):
            return g, g

    class WrongShape(dt.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.sum()

        @staticmethod
        def backward(ctx, g):
            return g.expand(7)

    _, x = leaf((3,))
    with pytest.raises(AutogradError, match=r"function BadBackward returned an incorrect "
                       r"number of gradients \(expected 2, got 1\)"):
        Bad.apply(x, x).sum().backward()
    with pytest.raises(AutogradError, match="different than None at position 2"):
        NotATensor.apply(x, 2.0).sum().backward()
    with pytest.raises(AutogradError, match=r"invalid gradient at index 0 - got \[7\] but "
                       r"expected shape compatible with \[3\]"):
        WrongShape.apply(x).backward()
    with pytest.raises(SignatureError, match="argument 1 is of type int"):
        dt.autograd.FunctionCtx().save_for_backward(x, 3)
    with pytest.raises(NotImplementedError, match="implement the forward"):
        dt.autograd.Function.apply(x)


def test_composition_reuse_broadcast_and_double_backward():
    a, x = leaf((3, 4))
    b, w = leaf((4, 2), 3)
    # table ops before and after, the Function used twice, one gradient broadcast back
    h = Exp.apply(x @ w)
    loss = (Exp.apply(h) * 0.5 + h).sum()
    loss.backward()
    e = np.exp(a @ b)
    gh = 0.5 * np.exp(e) * e + e
    np.testing.assert_allclose(x.grad.numpy(), gh @ b.T, rtol=1e-10)
    np.testing.assert_allclose(w.grad.numpy(), a.T @ gh, rtol=1e-10)

    class RowBias(dt.autograd.Function):  # a gradient of the output's shape for a (4,) bias
        @staticmethod
        def forward(ctx, x, bias):
            return x + bias

        @staticmethod
        def backward(ctx, g):
            return g, g

    _, bias = leaf((4,), 4)
    RowBias.apply(x.detach(), bias).sum().backward()
    np.testing.assert_array_equal(bias.grad.numpy(), np.full(4, 3.0))

    # double backward: the saved output has its history again under create_graph
    _, z = leaf((5,), 5)
    (g,) = dt.autograd.grad(Exp.apply(z).sum(), z, create_graph=True)
    g.sum().backward()
    np.testing.assert_allclose(z.grad.numpy(), np.exp(z.detach().numpy()), rtol=1e-12)


def test_once_differentiable_and_no_grad():
    class Twice(dt.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        @dt.autograd.once_differentiable
        def backward(ctx, g):
            return g * 2

    _, x = leaf((3,))
    v = dt.ones(3, dtype=dt.float64, requires_grad=True)  # a gradient with a history
    (g,) = dt.autograd.grad(Twice.apply(x), x, v, create_graph=True)
    np.testing.assert_array_equal(g.detach().numpy(), np.full(3, 2.0))
    with pytest.raises(AutogradError, match="differentiate twice"):
        g.sum().backward()
    with dt.no_grad():
        y = Exp.apply(x)
    assert not y.requires_grad
