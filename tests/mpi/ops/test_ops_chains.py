"""Chained programs on DTensors equal numpy: a tensor-parallel MLP and an attention block.

Placements are inferred op by op (column-sharded then row-sharded weights give a Partial
sum that one all-reduce resolves), and the values equal the single-process computation.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import dtensor as dt

WORLD = MPI.COMM_WORLD
R, S, P = dt.Replicate(), dt.Shard, dt.Partial


def data(shape, seed):
    return (np.random.default_rng(seed).standard_normal(shape) * 0.5).astype(np.float32)


def dist(arr, mesh, placements):
    return dt.distribute_tensor(arr, mesh, placements, src_data_rank=None)


def layouts():
    """(mesh, data-parallel placement, tensor-parallel mesh dim) to run the chains on."""
    out = [(dt.init_device_mesh((WORLD.size,)), None, 0)]
    if WORLD.size == 4:
        out.append((dt.init_device_mesh((2, 2), mesh_dim_names=("dp", "tp")), 0, 1))
    return out


def place(mesh, dp, tp, batch=None, model=None):
    """Placements with ``batch`` sharding on the dp mesh dim, ``model`` on the tp dim."""
    pl = [R] * mesh.ndim
    if dp is not None and batch is not None:
        pl[dp] = batch
    if model is not None:
        pl[tp] = model
    return pl


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("batch", [8, 2 * WORLD.size + 1])
def test_mlp_column_then_row_parallel(batch):
    x, w1, b1, w2 = data((batch, 6), 0), data((6, 16), 1), data((16,), 2), data((16, 5), 3)
    expected = np.maximum(x @ w1 + b1, 0) @ w2
    for mesh, dp, tp in layouts():
        xd = dist(x, mesh, place(mesh, dp, tp, batch=S(0)))
        w1d = dist(w1, mesh, place(mesh, dp, tp, model=S(1)))
        b1d = dist(b1, mesh, place(mesh, dp, tp, model=S(0)))
        w2d = dist(w2, mesh, place(mesh, dp, tp, model=S(0)))
        h = (xd @ w1d + b1d).relu()
        assert h.placements[tp] == S(1)  # column-parallel: hidden stays sharded
        y = h @ w2d
        assert y.placements[tp] == P("sum")  # row-parallel: a partial sum
        if dp is not None:
            assert y.placements[dp] == S(0)
        out = y.redistribute(mesh, place(mesh, dp, tp, batch=S(0)))
        assert out.placements[tp] == R
        np.testing.assert_allclose(out.full_tensor().numpy(), expected, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(y.full_tensor().numpy(), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.mpi(min_size=1)
def test_mlp_with_linear_and_loss():
    x, w1, w2 = data((6, 4), 4), data((8, 4), 5), data((3, 8), 6)
    target = np.array([0, 2, 1, 1, 0, 2], dtype=np.int64)
    h = np.maximum(x @ w1.T, 0)
    logits = h @ w2.T
    e = np.exp(logits - logits.max(1, keepdims=True))
    loss = -np.log(e / e.sum(1, keepdims=True))[np.arange(6), target].mean()
    for mesh, dp, tp in layouts():
        xd = dist(x, mesh, place(mesh, dp, tp, batch=S(0)))
        w1d = dist(w1, mesh, place(mesh, dp, tp, model=S(0)))  # out-features sharded
        w2d = dist(w2, mesh, place(mesh, dp, tp, model=S(1)))  # in-features sharded
        td = dist(target, mesh, place(mesh, dp, tp, batch=S(0)))
        ld = dt.linear(dt.relu(dt.linear(xd, w1d)), w2d)
        assert ld.placements[tp] == P("sum")
        lossd = dt.cross_entropy(ld, td)
        assert lossd.shape == ()
        np.testing.assert_allclose(lossd.full_tensor().item(), loss, rtol=1e-4)


@pytest.mark.mpi(min_size=1)
def test_attention_block():
    batch, seq, dm, heads = 2, 5, 8, 2
    dh = dm // heads
    x = data((batch, seq, dm), 10)
    wq, wk, wv, wo = (data((dm, dm), 11 + i) for i in range(4))

    def np_attention(a):
        def split(t):  # (b, s, dm) -> (b, h, s, dh)
            return t.reshape(batch, seq, heads, dh).transpose(0, 2, 1, 3)

        q, k, v = split(a @ wq), split(a @ wk), split(a @ wv)
        s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(dh)
        e = np.exp(s - s.max(-1, keepdims=True))
        o = (e / e.sum(-1, keepdims=True)) @ v
        return o.transpose(0, 2, 1, 3).reshape(batch, seq, dm) @ wo

    expected = np_attention(x)
    for mesh, dp, tp in layouts():
        xd = dist(x, mesh, place(mesh, dp, tp, batch=S(0)))
        wqd, wkd, wvd = (dist(w, mesh, place(mesh, dp, tp, model=S(1))) for w in (wq, wk, wv))
        wod = dist(wo, mesh, place(mesh, dp, tp, model=S(0)))

        def split(t):
            return t.view(batch, seq, heads, dh).permute(0, 2, 1, 3)

        q, k, v = split(xd @ wqd), split(xd @ wkd), split(xd @ wvd)
        scores = (q @ k.transpose(-2, -1)) / float(np.sqrt(dh))
        attn = dt.softmax(scores, dim=-1)
        o = (attn @ v).permute(0, 2, 1, 3).reshape(batch, seq, dm)
        y = o @ wod
        np.testing.assert_allclose(y.full_tensor().numpy(), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.mpi(min_size=1)
def test_layer_norm_residual_chain():
    x, w = data((6, 8), 20), data((8, 8), 21)
    gamma, beta = data((8,), 22) + 1, data((8,), 23)

    def np_ln(a):
        return (a - a.mean(-1, keepdims=True)) / np.sqrt(a.var(-1, keepdims=True) + 1e-5)

    expected = x + np_ln(x @ w) * gamma + beta
    for mesh, dp, tp in layouts():
        xd = dist(x, mesh, place(mesh, dp, tp, batch=S(0)))
        wd = dist(w, mesh, place(mesh, dp, tp, model=S(0)))
        gd, bd = dist(gamma, mesh, [R] * mesh.ndim), dist(beta, mesh, [R] * mesh.ndim)
        y = xd + dt.layer_norm(xd @ wd, (8,), gd, bd)
        np.testing.assert_allclose(y.full_tensor().numpy(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.mpi(min_size=1)
def test_repeated_chain_hits_the_cache():
    mesh = dt.init_device_mesh((WORLD.size,))
    x, w = data((8, 6), 30), data((6, 6), 31)
    xd, wd = dist(x, mesh, [S(0)]), dist(w, mesh, [R])
    dt.debug.clear_prop_cache()
    y = xd
    for _ in range(5):
        y = (y @ wd).tanh() * 0.5
    s = dt.debug.prop_cache_stats()
    assert s["misses"] == 3 and s["hits"] == 12
    ref = x
    for _ in range(5):
        ref = np.tanh(ref @ w) * 0.5
    np.testing.assert_allclose(y.full_tensor().numpy(), ref, rtol=1e-4, atol=1e-5)
