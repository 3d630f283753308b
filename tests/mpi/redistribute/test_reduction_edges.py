"""Edge cases of max/min reductions under MPI: NaN from any rank, empty tensors.

NaN survives max/min reductions whichever rank holds it, as in numpy and PyTorch. MPI's predefined MAX/MIN compare with ``>``/``<``, so a NaN held by one rank was kept or
dropped depending on the rank order. Every path is checked: the Comm collectives, the
redistribution of a Partial(max/min) tensor (over MPI and, for large tensors, over shared
memory) and the reductions of DTensors. A max/min-like reduction over an empty dim raises
the same error on a sharded tensor as on a replicated one (an empty shard once gave -inf).
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import dtensor as dt
from redistribute import comm as C

WORLD = MPI.COMM_WORLD
FLOATS = [np.float16, np.float32, np.float64]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("op", ["max", "min"])
def test_allreduce_and_reduce_scatter_keep_nan_from_any_rank(dtype, op):
    comm = C.world()
    n = WORLD.size
    for holder in range(n):
        for special in (np.nan, np.inf, -np.inf):
            sends = [np.arange(2 * n, dtype=dtype) + r for r in range(n)]
            sends[holder][1] = special
            want = getattr(np, op + "imum").reduce(sends)  # numpy: NaN wins
            got = np.empty_like(want)
            comm.allreduce(sends[WORLD.rank], got, op=op)
            np.testing.assert_array_equal(got, want, err_msg=f"{op} {special} on {holder}")
            part = np.empty(2, dtype)
            comm.reduce_scatter(sends[WORLD.rank], part, [2] * n, op=op)
            np.testing.assert_array_equal(part, want[2 * WORLD.rank : 2 * WORLD.rank + 2])


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("n", [6, 1 << 19])  # 24 B over MPI; 2 MiB over shared memory
def test_max_min_of_a_sharded_tensor_with_nan_on_any_rank(n):
    mesh = dt.init_device_mesh((WORLD.size,))
    for pos in (0, n // 2, n - 1):  # on the first, a middle and the last rank's shard
        a = np.arange(1, n + 1, dtype=np.float32)
        a[pos] = np.nan
        x = dt.distribute_tensor(a, mesh, [dt.Shard(0)])
        for out in (x.max(), x.min(), x.amax(0), x.amin(0)):
            assert np.isnan(out.full_tensor().numpy()), (pos, out.placements)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("shape", [(8, 8), (512, 512)])  # MPI and shared memory
@pytest.mark.parametrize("op", ["max", "min"])
def test_partial_max_min_to_replicate_keeps_nan(shape, op):
    mesh = dt.init_device_mesh((WORLD.size,))
    for holder in range(WORLD.size):
        local = np.zeros(shape, np.float32)
        if WORLD.rank == holder:
            local[1, 1] = np.nan
        x = dt.DTensor.from_local(dt.from_numpy(local), mesh, [dt.Partial(op)], shape=shape)
        for target in ([dt.Replicate()], [dt.Shard(0)]):  # all-reduce, reduce-scatter
            got = x.redistribute(mesh, target).full_tensor().numpy()
            assert np.isnan(got[1, 1]) and np.isnan(got).sum() == 1, (holder, target)


EXTREMES = [
    ("max", lambda x: x.max()),
    ("min", lambda x: x.min()),
    ("amax", lambda x: x.amax()),
    ("amin", lambda x: x.amin(0)),
    ("argmax", lambda x: x.argmax()),
    ("max", lambda x: x.max(dim=0)),
    ("min", lambda x: x.min(dim=0, keepdim=True)),
]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", [np.float32, np.int64])
def test_reductions_without_identity_refuse_empty_dims_on_every_placement(dtype):
    mesh = dt.init_device_mesh((WORLD.size,))
    for pl in ([dt.Replicate()], [dt.Shard(0)], [dt.Shard(1)]):
        x = dt.distribute_tensor(np.zeros((0, 4), dtype), mesh, pl)
        for name, fn in EXTREMES:
            with pytest.raises(dt.errors.ShardingError, match=rf"^{name}\(\): .*\(0, 4\)"):
                fn(x)
    # a non-empty reduced dim of an empty tensor is fine: max along dim 1 of (0, 4)
    y = dt.distribute_tensor(np.zeros((0, 4), dtype), mesh, [dt.Shard(0)])
    assert y.max(dim=1).values.shape == (0,)
