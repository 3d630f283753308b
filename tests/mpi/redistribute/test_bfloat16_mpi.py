"""bfloat16 DTensors under MPI: every redistribute pair, Partial(sum/avg/max) reduced to
Replicate and Shard (MPI has no bfloat16 datatype: moves go as bytes, reductions widen to
float32 and round once, so a sum equals numpy's float32 sum of the bfloat16 contributions
rounded to bfloat16), the Comm's own reductions, a small matmul + sum + backward, and a
checkpoint round trip. Meshes: 1-D over the world and, at 4 ranks, 2x2.
"""

from __future__ import annotations

import shutil
import tempfile

import ml_dtypes
import numpy as np
import pytest
from helpers.mpi import meshes
from mpi4py import MPI

import dtensor as dt
from redistribute import comm as C

WORLD = MPI.COMM_WORLD
BF16 = np.dtype(ml_dtypes.bfloat16)
R, S, P = dt.Replicate(), dt.Shard, dt.Partial


def contributions(shape, k, seed):
    """``k`` arrays of bfloat16 values, one per coordinate of a Partial mesh dim."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(BF16) for _ in range(k)]


def reduced(parts, op):
    """numpy's reduction of the contributions: float32 (exact here), rounded once."""
    wide = np.stack([p.astype(np.float32) for p in parts])
    r = {"sum": wide.sum(0), "avg": wide.mean(0), "max": wide.max(0)}[op]
    return r.astype(BF16)


def partial_dtensor(parts, mesh, placements):
    """The DTensor whose Partial mesh dim ``m`` holds ``parts[coord[m]]`` (its other dims
    as ``placements`` say): each rank keeps its own block, nothing is communicated."""
    m = next(i for i, p in enumerate(placements) if p.is_partial())
    mine = parts[mesh.get_coordinate()[m]]
    plain = [R if i == m else p for i, p in enumerate(placements)]
    local = dt.distribute_tensor(mine, mesh, plain, src_data_rank=None).to_local()
    return dt.DTensor.from_local(local, mesh, placements, shape=mine.shape)


def pairs(mesh):
    """(source placements, target placements) of the cases on ``mesh``."""
    if mesh.ndim == 1:
        moves = [([S(0)], [R]), ([S(1)], [S(0)]), ([R], [S(1)]), ([R], [P("sum")])]
        reductions = [([P(op)], [t]) for op in ("sum", "avg", "max") for t in (R, S(0), S(1))]
        return moves + reductions
    return [([S(0), S(1)], [R, R]), ([P("sum"), S(1)], [R, S(0)]),
            ([S(1), P("avg")], [R, R]), ([P("max"), P("sum")], [S(0), R])]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("shape", [(5, 6), (512, 1024)])  # MPI; 1 MiB: shared memory
def test_redistribute_pairs(shape):
    big = shape[0] > 5
    for mesh in meshes():
        for src, dst in pairs(mesh):
            if big and not (src[0].is_partial() and mesh.ndim == 1 and dst == [R]):
                continue  # the large shape: P -> R only
            ops = [p.reduce_op for p in src if p.is_partial()]
            if len(ops) == 2:  # two Partial dims: contributions per coordinate pair
                parts = contributions(shape, 4, 2)
                want = reduced([reduced(parts[:2], ops[1]), reduced(parts[2:], ops[1])], ops[0])
                coord = mesh.get_coordinate()
                local = parts[2 * coord[0] + coord[1]]
                x = dt.DTensor.from_local(dt.from_numpy(local), mesh, src, shape=shape)
            elif ops:
                k = mesh.shape[[p.is_partial() for p in src].index(True)]
                parts = contributions(shape, k, 1)
                want = reduced(parts, ops[0])
                x = partial_dtensor(parts, mesh, src)
            else:
                want = contributions(shape, 1, 3)[0]
                x = dt.distribute_tensor(want, mesh, src)
            y = x.redistribute(mesh, dst)
            assert y.dtype == BF16 and tuple(y.placements) == tuple(dst)
            got = y.full_tensor().numpy()
            where = f"{src} -> {dst} on mesh {mesh.shape}"
            if "avg" in ops:  # the float32 average rounds twice at most
                np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32),
                                           rtol=2**-7, atol=2**-7, err_msg=where)
            elif dst != [P("sum")]:
                assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), where


@pytest.mark.mpi(min_size=1)
def test_async_and_comm_reductions():
    mesh = dt.init_device_mesh((WORLD.size,))
    parts = contributions((7, 3), WORLD.size, 4)
    x = partial_dtensor(parts, mesh, [P("sum")])
    y = x.redistribute(mesh, [R], async_op=True).wait()
    assert np.array_equal(y.to_local().numpy().view(np.uint16),
                          reduced(parts, "sum").view(np.uint16))
    comm = C.world()
    got = np.empty((7, 3), BF16)
    comm.allreduce(parts[WORLD.rank], got, op="sum")
    assert np.array_equal(got.view(np.uint16), reduced(parts, "sum").view(np.uint16))
    inplace = parts[WORLD.rank].copy()
    comm.allreduce(inplace, op="max")
    assert np.array_equal(inplace, reduced(parts, "max"))
    flat = [p.reshape(-1)[: 2 * WORLD.size] for p in parts]
    mine = np.empty(2, BF16)
    comm.reduce_scatter(flat[WORLD.rank], mine, [2] * WORLD.size, op="sum")
    want = reduced(flat, "sum")[2 * WORLD.rank : 2 * WORLD.rank + 2]
    assert np.array_equal(mine.view(np.uint16), want.view(np.uint16))


@pytest.mark.mpi(min_size=1)
def test_matmul_sum_backward():
    for mesh in meshes():
        rng = np.random.default_rng(5)
        a = rng.standard_normal((8, 6)).astype(BF16)
        b = rng.standard_normal((6, 4)).astype(BF16)
        x = dt.distribute_tensor(a, mesh, [S(0)] + [R] * (mesh.ndim - 1)).requires_grad_()
        w = dt.distribute_tensor(b, mesh, [R] + [S(1)] * (mesh.ndim - 1)).requires_grad_()
        y = x @ w
        loss = y.sum()
        loss.backward()
        af, bf = a.astype(np.float64), b.astype(np.float64)
        assert y.dtype == BF16 and loss.dtype == BF16
        np.testing.assert_allclose(float(loss.full_tensor()), (af @ bf).sum(), rtol=2**-7,
                                   atol=2**-7 * np.abs(af @ bf).sum())
        gx, gw = x.grad.full_tensor().numpy(), w.grad.full_tensor().numpy()
        assert gx.dtype == BF16 and gw.dtype == BF16
        ones = np.ones((8, 4))
        np.testing.assert_allclose(gx.astype(np.float64), ones @ bf.T, rtol=2**-7, atol=0.05)
        np.testing.assert_allclose(gw.astype(np.float64), af.T @ ones, rtol=2**-7, atol=0.05)


@pytest.mark.mpi(min_size=1)
def test_checkpoint_round_trip():
    path = WORLD.bcast(tempfile.mkdtemp(prefix="dtensor-bf16-") if WORLD.rank == 0 else None)
    try:
        mesh = dt.init_device_mesh((WORLD.size,))
        a = np.random.default_rng(6).standard_normal((5, 3)).astype(BF16)
        parts = contributions((5, 3), WORLD.size, 7)
        state = {"w": dt.distribute_tensor(a, mesh, [S(0)]), "p": partial_dtensor(
            parts, mesh, [P("sum")]), "t": dt.from_numpy(a.copy())}
        dt.save(state, f"{path}/ck")
        back = {"w": dt.zeros(5, 3, dtype=dt.bfloat16, device_mesh=mesh, placements=[R]),
                "p": dt.zeros(5, 3, dtype=dt.bfloat16, device_mesh=mesh, placements=[S(1)]),
                "t": dt.zeros(5, 3, dtype=dt.bfloat16)}
        dt.load(back, f"{path}/ck")
        assert np.array_equal(back["w"].full_tensor().numpy().view(np.uint16), a.view(np.uint16))
        want = reduced(parts, "sum").view(np.uint16)
        assert np.array_equal(back["p"].full_tensor().numpy().view(np.uint16), want)
        assert np.array_equal(back["t"].numpy(), a)
        saved = dt.load(f"{path}/ck")
        assert saved["w"].dtype == BF16 and saved["t"].dtype == BF16
        with pytest.raises(dt.errors.DTypeError, match="bfloat16"):
            dt.to_npy(state["w"], f"{path}/w.npy")
    finally:
        WORLD.Barrier()
        if WORLD.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
