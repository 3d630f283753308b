"""First MPI tests: the harness itself and local tensors moved by buffer-based collectives.

Local ``dt.Tensor`` buffers (``Tensor.numpy()`` is zero-copy) go through mpi4py's
``Allgather``/``Allgatherv`` and must equal numpy's concatenation of every rank's part,
computed from the shared seed on every rank.
"""

from __future__ import annotations

import numpy as np
import pytest

import dtensor as dt


@pytest.mark.mpi(min_size=1)
def test_seed_and_rng_are_identical_on_every_rank(comm, seed, rng):
    draws = rng.integers(0, 2**31, size=4).tolist()
    assert comm.allgather((seed, draws)) == [(seed, draws)] * comm.Get_size()


@pytest.mark.mpi(min_size=1)
def test_allgather_of_arange_tensors(comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    local = dt.arange(5 * rank, 5 * rank + 5)
    assert local.numpy().dtype == np.int64
    out = np.empty(5 * size, dtype=np.int64)
    comm.Allgather(local.numpy(), out)
    np.testing.assert_array_equal(out, np.arange(5 * size))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32])
def test_allgatherv_of_uneven_blocks_equals_concatenation(comm, rng, dtype):
    rank, size = comm.Get_rank(), comm.Get_size()
    counts = [(r + 1) % 3 for r in range(size)]  # 1, 2, 0, 1, ... rows: rank 2 holds none
    blocks = [(rng.standard_normal((c, 4)) * 100).astype(dtype) for c in counts]
    local = dt.from_numpy(blocks[rank])
    assert local.shape == (counts[rank], 4)

    out = np.empty((sum(counts), 4), dtype=dtype)
    comm.Allgatherv(local.numpy(), [out, [4 * c for c in counts]])
    np.testing.assert_array_equal(out, np.concatenate(blocks))
