"""Vocab-parallel cross entropy: logits sharded on the class dim give the loss (and its
gradient) without gathering the logits, against numpy at 1-4 ranks, with uneven and empty
class shards, ignored targets, class weights, label smoothing and probability targets; the
cost model chooses it for large class counts and gathers small logits."""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest
from mpi4py import MPI

import dtensor as dt
from redistribute.cost import CostModel, set_default_cost_model

WORLD = MPI.COMM_WORLD
R, S = dt.Replicate(), dt.Shard


def _np_ce(x, t, w=None, ignore=-100, reduction="mean", smoothing=0.0):
    """numpy's cross entropy (float64) of logits ``x`` (class dim 1, or 0 when 1-D)."""
    x = np.asarray(x, np.float64)
    c = 1 if x.ndim >= 2 else 0
    n = x.shape[c]
    logp = x - x.max(c, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(c, keepdims=True))
    wv = np.ones(n) if w is None else np.asarray(w, np.float64)
    wb = wv.reshape((-1,) + (1,) * (x.ndim - 1 - c))
    if t.dtype.kind == "f":
        q = t * (1 - smoothing) + smoothing / n
        loss = -(logp * q * wb).sum(c)
        denom = loss.size
    else:
        valid = t != ignore
        tc = np.where(valid, t, 0)
        picked = np.take_along_axis(logp, np.expand_dims(tc, c), c).squeeze(c)
        wt = np.where(valid, wv[tc], 0.0)
        loss = -picked * wt
        if smoothing:
            loss = loss * (1 - smoothing) - (logp * wb).sum(c) * smoothing / n
        loss = np.where(valid, loss, 0.0)
        denom = wt.sum()
    if reduction == "none":
        return loss
    return loss.sum() / (denom if reduction == "mean" else 1)


@contextmanager
def _gathers_cost_much():
    """A cost model under which moving the logits (gather, all-to-all) costs a second: the
    vocab-parallel candidate wins at any size (every rank sets the same model)."""
    slow = {"alpha_s": 1.0}
    set_default_cost_model(CostModel(per_kind={"all_gather": slow, "all_to_all": slow}))
    dt.clear_caches()
    try:
        yield
    finally:
        set_default_cost_model(None)
        dt.clear_caches()


def _r(mesh, a):
    return dt.distribute_tensor(a, mesh, [R])


def _targets(rng, shape, n):
    t = rng.integers(0, n, shape)
    t.reshape(-1)[::3] = -100  # ignored
    return t


@pytest.mark.mpi(min_size=1)
def test_class_sharded_loss_matches_numpy():
    mesh = dt.init_device_mesh((WORLD.size,))
    rng = np.random.default_rng(0)
    with _gathers_cost_much():
        # 3 and 5 classes: uneven shards, empty ones at 3-4 ranks
        for n in (3, 5):
            x = rng.standard_normal((6, n)).astype(np.float32)
            xd = dt.distribute_tensor(x, mesh, [S(1)])
            t = _targets(rng, (6,), n)
            w = rng.random(n).astype(np.float32) + 0.5
            for reduction in ("none", "sum", "mean"):
                for kw in ({}, {"weight": w}, {"label_smoothing": 0.1}):
                    args = {k: _r(mesh, v) if k == "weight" else v for k, v in kw.items()}
                    td = _r(mesh, t)
                    with dt.debug.CommDebugMode() as mode:
                        got = dt.cross_entropy(xd, td, reduction=reduction, **args)
                    assert got.placements == (R,)
                    # two all-reduces of per-sample vectors, named after the op; no gather
                    want_comm = {"cross_entropy": {"all_reduce": 2}} if WORLD.size > 1 else {}
                    assert mode.get_comm_counts_by_op() == want_comm, mode.table()
                    want = _np_ce(x, t, kw.get("weight"), reduction=reduction,
                                  smoothing=kw.get("label_smoothing", 0.0))
                    np.testing.assert_allclose(got.to_local().numpy(), want, rtol=1e-5,
                                               atol=1e-6)
        # spatial dims, and probability targets sharded like the logits
        x = rng.standard_normal((2, 5, 3)).astype(np.float32)
        t = _targets(rng, (2, 3), 5)
        got = dt.cross_entropy(dt.distribute_tensor(x, mesh, [S(1)]), _r(mesh, t),
                               reduction="none")
        np.testing.assert_allclose(got.full_tensor().numpy(), _np_ce(x, t, reduction="none"),
                                   rtol=1e-5, atol=1e-6)
        p = rng.random((4, 5)).astype(np.float32)
        p /= p.sum(1, keepdims=True)
        x = rng.standard_normal((4, 5)).astype(np.float32)
        got = dt.cross_entropy(dt.distribute_tensor(x, mesh, [S(1)]),
                               dt.distribute_tensor(p, mesh, [S(1)]), label_smoothing=0.2)
        np.testing.assert_allclose(got.full_tensor().numpy(), _np_ce(x, p, smoothing=0.2),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.mpi(min_size=1)
def test_cost_model_chooses_between_gathering_and_vocab_parallel():
    mesh = dt.init_device_mesh((WORLD.size,))
    rng = np.random.default_rng(1)
    for n, vocab_parallel in ((4096, True), (6, False)):
        x = rng.standard_normal((8, n)).astype(np.float32)
        t = rng.integers(0, n, (8,))
        xd = dt.distribute_tensor(x, mesh, [S(1)])
        with dt.debug.CommDebugMode() as mode:
            got = dt.cross_entropy(xd, _r(mesh, t))
        moved = {"all_gather", "all_to_all"} & set(mode.get_comm_counts())
        if WORLD.size > 1:
            assert bool(moved) is not vocab_parallel, (n, mode.get_comm_counts())
        np.testing.assert_allclose(got.full_tensor().numpy(), _np_ce(x, t), rtol=1e-5)


@pytest.mark.mpi(min_size=1)
def test_vocab_parallel_gradient_stays_sharded():
    mesh = dt.init_device_mesh((WORLD.size,))
    rng = np.random.default_rng(2)
    n = 8195  # uneven shards; large enough that gathering costs more
    x = rng.standard_normal((6, n)).astype(np.float32)
    t = _targets(rng, (6,), n)
    xd = dt.distribute_tensor(x, mesh, [S(1)]).requires_grad_()
    with dt.debug.CommDebugMode() as mode:
        loss = dt.cross_entropy(xd, _r(mesh, t))
        loss.backward()
    counts = mode.get_comm_counts()
    assert "all_gather" not in counts and "all_to_all" not in counts, mode.table()
    assert xd.grad.placements == (S(1),)
    p = np.exp(x - x.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    valid = t != -100
    hot = np.zeros_like(p)
    hot[np.arange(6), np.where(valid, t, 0)] = 1
    want = (p - hot) * valid[:, None] / valid.sum()
    np.testing.assert_allclose(xd.grad.full_tensor().numpy(), want, rtol=1e-4, atol=1e-6)


@pytest.mark.mpi(min_size=1)
def test_mean_loss_of_batch_sharded_logits_gathers_nothing():
    # A mean over batch-sharded logits: each block's sum over the whole batch's denominator
    # (one all-reduce of one number forward, one backward); the logits never move, on
    # uneven and empty blocks (3 rows at 4 ranks), ignored targets, weights,
    # label smoothing, spatial dims and probability targets; 2-D meshes: batch on one dim,
    # classes on the other.
    mesh = dt.init_device_mesh((WORLD.size,))
    rng = np.random.default_rng(3)
    n = 4096
    for rows in (16, 3):  # 3 rows: empty blocks at 4 ranks
        x = rng.standard_normal((rows, n)).astype(np.float32)
        t = _targets(rng, (rows,), n)
        w = rng.random(n).astype(np.float32) + 0.5
        for kw in ({}, {"weight": w}, {"label_smoothing": 0.1}):
            args = {k: _r(mesh, v) if k == "weight" else v for k, v in kw.items()}
            xd = dt.distribute_tensor(x, mesh, [S(0)]).requires_grad_()
            td = dt.distribute_tensor(t, mesh, [S(0)])
            with dt.debug.CommDebugMode() as mode:
                loss = dt.cross_entropy(xd, td, **args)
                loss.backward()
            assert loss.placements == (dt.Partial("sum"),) or WORLD.size == 1, loss.placements
            if WORLD.size > 1:
                assert mode.get_comm_counts() == {"all_reduce": 2}, mode.table()
                assert mode.get_total_bytes() <= 64, mode.table()
            assert xd.grad.placements == (S(0),)
            want = _np_ce(x, t, kw.get("weight"), smoothing=kw.get("label_smoothing", 0.0))
            np.testing.assert_allclose(loss.full_tensor().numpy(), want, rtol=1e-5, atol=1e-6)
            xt = x.astype(np.float64)
            eps = 1e-3  # the gradient along one random direction, by central differences
            d = rng.standard_normal(x.shape)
            fd = (_np_ce(xt + eps * d, t, kw.get("weight"),
                         smoothing=kw.get("label_smoothing", 0.0))
                  - _np_ce(xt - eps * d, t, kw.get("weight"),
                           smoothing=kw.get("label_smoothing", 0.0))) / (2 * eps)
            got = float((xd.grad.full_tensor().numpy().astype(np.float64) * d).sum())
            np.testing.assert_allclose(got, fd, rtol=2e-3, atol=1e-5)
    # probability targets: the sample count is known, nothing moves at all
    x = rng.standard_normal((5, 3, 4)).astype(np.float32)
    p = rng.random((5, 3, 4)).astype(np.float32)
    p /= p.sum(1, keepdims=True)
    xd, pd = dt.distribute_tensor(x, mesh, [S(2)]), dt.distribute_tensor(p, mesh, [S(2)])
    with dt.debug.CommDebugMode() as mode:
        got = dt.cross_entropy(xd, pd, label_smoothing=0.2)
    assert mode.get_comm_counts() == {}, mode.table()
    np.testing.assert_allclose(got.full_tensor().numpy(), _np_ce(x, p, smoothing=0.2),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.mpi(min_size=4)
def test_mean_loss_batch_and_class_sharded_on_a_2d_mesh():
    mesh = dt.init_device_mesh((2, WORLD.size // 2))
    rng = np.random.default_rng(4)
    x = rng.standard_normal((6, 8195)).astype(np.float32)
    t = _targets(rng, (6,), 8195)
    xd = dt.distribute_tensor(x, mesh, [S(0), S(1)]).requires_grad_()
    td = dt.distribute_tensor(t, mesh, [S(0), R])
    with dt.debug.CommDebugMode() as mode:
        loss = dt.cross_entropy(xd, td, label_smoothing=0.1)
    counts = mode.get_comm_counts()
    assert "all_gather" not in counts and "all_to_all" not in counts, mode.table()
    np.testing.assert_allclose(loss.full_tensor().numpy(), _np_ce(x, t, smoothing=0.1),
                               rtol=1e-5, atol=1e-6)
