"""``DTensor.redistribute`` from compiled code against the Python method.

Plans that are one all-gather of whole shards (S(0) -> R, uneven and empty shards
included, and a gather over one dim of a 2-D mesh) run from compiled code; every other
plan, and every call while CommDebugMode (or another communication observer) is on, runs
the Python method. Both must give the same DTensors.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import dtensor as dt
import fastpath
from dtensor.debug import CommDebugMode
from dtensor.errors import MeshError, PlacementError

WORLD = MPI.COMM_WORLD
S, R, P = dt.Shard, dt.Replicate(), dt.Partial

needs_front = pytest.mark.skipif(
    not fastpath.ENABLED, reason="compiled fast path not enabled (not built or disabled)"
)

# (global shape, source placements, target placements, run from compiled code)
CASES = [
    ((8, 8), [S(0)], [R], True),
    ((5, 3), [S(0)], [R], True),  # uneven (Allgatherv) at 2-4 ranks, one empty at 4
    ((0, 4), [S(0)], [R], True),
    ((64, 64), [S(0)], [R], True),  # a 16 KiB output: pooled
    ((8, 6), [S(1)], [R], False),  # blocks not contiguous in the output: the executor
    ((256, 128), [S(0)], [R], False),  # above the all-gather size: the executor
    ((6, 4), [P("sum")], [R], False),
    ((6, 4), [R], [S(0)], False),
    ((6, 4), [S(0)], [S(0)], False),
]


def _describe(x):
    loc = x.to_local()
    return (tuple(x.shape), str(x.dtype), tuple(x.placements), tuple(loc.shape), loc.stride(),
            loc.numpy().tobytes())  # fmt: skip


def _source(shape, placements, mesh):
    data = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) * 0.5 - 3
    return dt.distribute_tensor(data, mesh, placements), data


@pytest.fixture(autouse=True)
def _front_back_on():
    yield
    if fastpath.ENABLED:
        dt.debug.set_fastpath(True)


@needs_front
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize(("shape", "src", "dst", "compiled"), CASES, ids=str)
def test_same_dtensors_as_the_python_method(shape, src, dst, compiled):
    mesh = dt.init_device_mesh((WORLD.size,))
    x, data = _source(shape, src, mesh)
    dt.debug.set_fastpath(False)
    want = _describe(x.redistribute(mesh, dst))
    dt.debug.set_fastpath(True)
    before = dt.debug.fastpath_status()["fast_redistributes"]
    for _ in range(3):  # the first call fills the entry, the others hit it
        y = x.redistribute(mesh, list(dst))
        assert _describe(y) == want
    ran = dt.debug.fastpath_status()["fast_redistributes"] - before
    compiled = compiled and WORLD.size > 1  # at one rank the plan moves nothing
    assert ran == (3 if compiled else 0)
    if compiled:
        np.testing.assert_array_equal(y.full_tensor().numpy(), data)
        out = y.to_local().numpy()
        assert not np.shares_memory(out, x.to_local().numpy())
        assert not np.shares_memory(out, x.redistribute(mesh, dst).to_local().numpy())


@needs_front
@pytest.mark.mpi(min_size=4)
def test_a_gather_over_one_dim_of_a_2d_mesh():
    mesh = dt.init_device_mesh((2, WORLD.size // 2))
    x, data = _source((6, 5), [S(0), R], mesh)
    dt.debug.set_fastpath(False)
    want = _describe(x.redistribute(mesh, [R, R]))
    dt.debug.set_fastpath(True)
    before = dt.debug.fastpath_status()["fast_redistributes"]
    y = x.redistribute(mesh, [R, R])
    assert _describe(y) == want and dt.debug.fastpath_status()["fast_redistributes"] == before + 1
    np.testing.assert_array_equal(y.full_tensor().numpy(), data)


@needs_front
@pytest.mark.mpi(min_size=2)
def test_comm_debug_mode_sees_every_redistribute():
    mesh = dt.init_device_mesh((WORLD.size,))
    x, _ = _source((8, 8), [S(0)], mesh)
    x.redistribute(mesh, [R])
    before = dt.debug.fastpath_status()["fast_redistributes"]
    with CommDebugMode() as mode:
        y = x.redistribute(mesh, [R])
    assert mode.get_total_counts() == 1, mode.table()
    assert dt.debug.fastpath_status()["fast_redistributes"] == before  # the Python method ran
    np.testing.assert_array_equal(y.to_local().numpy(), x.full_tensor().numpy())


@needs_front
@pytest.mark.mpi(min_size=1)
def test_bad_arguments_raise_as_in_the_python_method():
    mesh = dt.init_device_mesh((WORLD.size,))
    other = dt.init_device_mesh((1, WORLD.size))
    x, _ = _source((8, 8), [S(0)], mesh)
    for fast in (False, True):
        dt.debug.set_fastpath(fast)
        x.redistribute(mesh, [R])
        with pytest.raises(PlacementError, match="redistribute: 2 placements"):
            x.redistribute(mesh, [R, R])
        with pytest.raises(PlacementError, match="is not a placement"):
            x.redistribute(mesh, ["R"])
        with pytest.raises(MeshError, match="redistribute: moving a DTensor"):
            x.redistribute(other, [R, R])
        assert x.redistribute(mesh, None).placements == (R,)
        assert x.redistribute(mesh, iter([R])).placements == (R,)  # any iterable
        assert x.redistribute(placements=(R,), async_op=True).placements == (R,)
