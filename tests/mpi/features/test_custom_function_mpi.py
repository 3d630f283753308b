"""``dt.autograd.Function`` and ``dt.utils.checkpoint`` on DTensors at 1-4 ranks: a fused
tanh-linear Function whose backward returns DTensors, and a checkpointed block of DTensor
ops with dropout (batch-parallel and tensor-parallel layouts), against numpy and the local
unchecked run on the global data."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.mpi import data, meshes
from mpi4py import MPI

import dtensor as dt
from dtensor.utils import checkpoint

WORLD = MPI.COMM_WORLD
R, S = dt.Replicate(), dt.Shard


class TanhLinear(dt.autograd.Function):
    """``tanh(x @ w)``, one node; its backward writes the gradients with DTensor ops."""

    @staticmethod
    def forward(ctx, x, w):
        y = (x @ w).tanh()
        ctx.save_for_backward(x, w, y)
        return y

    @staticmethod
    def backward(ctx, g):
        x, w, y = ctx.saved_tensors
        gy = g * (1 - y * y)
        return gy @ w.T, x.T @ gy


@pytest.mark.mpi(min_size=1)
def test_function_on_dtensors_matches_numpy():
    x0, w0 = data((7, 5), 1).astype(np.float64), data((5, 3), 2).astype(np.float64)
    y0 = np.tanh(x0 @ w0)
    g0 = 2 * y0 * (1 - y0 * y0)  # of sum(y^2)
    for mesh in meshes():
        for px, pw in (([S(0)], [R]), ([R], [S(1)])):
            px, pw = px * mesh.ndim, pw * mesh.ndim
            x = dt.distribute_tensor(x0, mesh, px).requires_grad_()
            w = dt.distribute_tensor(w0, mesh, pw).requires_grad_()
            y = TanhLinear.apply(x, w)
            assert isinstance(y, dt.DTensor) and y.grad_fn.name() == "TanhLinearBackward"
            y.square().sum().backward()
            where = f"{mesh.shape} {px} {pw}"
            assert tuple(x.grad.placements) == tuple(px), where  # laid out as the leaves
            assert tuple(w.grad.placements) == tuple(pw), where
            np.testing.assert_allclose(x.grad.full_tensor().numpy(), g0 @ w0.T, rtol=1e-10,
                                       err_msg=where)
            np.testing.assert_allclose(w.grad.full_tensor().numpy(), x0.T @ g0, rtol=1e-10,
                                       err_msg=where)


def block(x, w1, w2):
    return dt.dropout((x @ w1).relu(), 0.3, True) @ w2 + x


def grads(x, w1, w2, wrap):
    """Two blocks through ``wrap`` (seeded), backward; the gradients as global arrays."""
    dt.manual_seed(3)
    loss = wrap(wrap(x, w1, w2), w1, w2).square().sum()
    loss.backward()
    return [t.grad.full_tensor().numpy() if isinstance(t, dt.DTensor) else t.grad.numpy()
            for t in (x, w1, w2)]


@pytest.mark.mpi(min_size=1)
def test_checkpointed_block_of_dtensor_ops_matches_local():
    x0, w10, w20 = data((6, 4), 3), data((4, 10), 4), data((10, 4), 5)

    def leaves(mesh=None, pls=None):
        if mesh is None:
            return [dt.tensor(a, requires_grad=True) for a in (x0, w10, w20)]
        return [dt.distribute_tensor(a, mesh, p * mesh.ndim).requires_grad_()
                for a, p in zip((x0, w10, w20), pls)]

    want = grads(*leaves(), block)
    for mesh in meshes():
        # batch parallel, then tensor parallel (column- then row-wise)
        for pls in (([S(0)], [R], [R]), ([R], [S(1)], [S(0)])):
            # (not bitwise: a leaf's gradient is summed before or after it is laid out)
            got = grads(*leaves(mesh, pls), lambda *a: checkpoint(block, *a))
            for g, w in zip(got, want):
                np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-3,
                                           err_msg=f"{mesh.shape} {pls}")
