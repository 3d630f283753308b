"""Leaving a ``dt.debug.check_spmd()`` block is itself checked.

A rank that leaves the block through an exception while the others stay inside (or leave
it normally) makes every rank raise :class:`CommError` naming how each rank left, instead
of leaving the others blocked in their next collective; ranks that all leave with the same
exception type keep their own exceptions.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import dtensor as dt
from dtensor.debug._spmd import check_spmd
from dtensor.errors import CommError

WORLD = MPI.COMM_WORLD


def _sharded():
    mesh = dt.init_device_mesh((WORLD.size,))
    a = np.arange(4.0 * WORLD.size, dtype=np.float32).reshape(WORLD.size, 4)
    return a, dt.distribute_tensor(a, mesh, [dt.Shard(0)])


@pytest.mark.mpi(min_size=2)
def test_a_rank_leaving_through_a_caught_exception_makes_every_rank_raise():
    a, x = _sharded()
    with pytest.raises(CommError) as info:
        try:
            with check_spmd():
                if WORLD.rank == 0:
                    raise KeyError("only rank 0 fails")
                x.full_tensor()  # the others go on into a collective on the mesh
        except KeyError:
            pass  # rank 0 carries on after the block: the others would wait forever
    msg = str(info.value)
    assert "SPMD divergence" in msg
    assert "check_spmd block" in msg and "raising KeyError" in msg
    if WORLD.rank != 0:
        assert "all_gather" in msg  # this rank's own collective
    # the ranks are in step again: a checked block agrees, the data is right
    with check_spmd():
        np.testing.assert_array_equal(x.full_tensor().numpy(), a)


@pytest.mark.mpi(min_size=2)
def test_leaving_normally_on_some_ranks_and_raising_on_others_raises_everywhere():
    a, x = _sharded()
    with pytest.raises(CommError) as info, check_spmd():
        y = x.full_tensor()  # every rank passes this collective
        if WORLD.rank == WORLD.size - 1:
            raise ValueError("late failure on the last rank")
    msg = str(info.value)
    assert "raising ValueError" in msg and "no exception" in msg
    for r in range(WORLD.size):
        assert f"world rank {r}:" in msg
    np.testing.assert_array_equal(y.numpy(), a)


@pytest.mark.mpi(min_size=1)
def test_the_same_exception_everywhere_keeps_it():
    _, x = _sharded()
    with pytest.raises(ZeroDivisionError), check_spmd():
        x.full_tensor()
        1 / 0  # noqa: B018 - every rank raises the same exception type
    with check_spmd():
        x.full_tensor()


@pytest.mark.mpi(min_size=2)
def test_inner_block_left_one_sided_inside_an_outer_block():
    a, x = _sharded()
    with check_spmd():
        with pytest.raises(CommError, match="raising KeyError"):
            try:
                with check_spmd():
                    if WORLD.rank == 1:
                        raise KeyError("rank 1 leaves the inner block")
                    x.full_tensor()
            except KeyError:
                pass
        # the outer block goes on in step on every rank
        np.testing.assert_array_equal(x.full_tensor().numpy(), a)
