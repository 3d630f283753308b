"""One rule places a value under Partial placements (placements.layout.partial_fill): the
mesh-aware factories, distribute_tensor (from a source rank and from every rank) and the
dispatcher's scalar split agree, and DTensor.from_local of those shards reduces back to the
value, for every reduce op and mixed Partial meshes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from mpi4py import MPI

import dtensor as dt
from dtensor.local import allocator
from redistribute import shm

WORLD = MPI.COMM_WORLD
R, S, P = dt.Replicate(), dt.Shard, dt.Partial
OPS = ("sum", "avg", "max", "min", "prod")


def cases():
    """(mesh shape, placements): every reduce op on the world, and on a 2x2 mesh at 4 ranks
    every pair of Partial kinds plus a Shard/Replicate beside a Partial."""
    out = [((WORLD.size,), (P(op),)) for op in OPS]
    if WORLD.size == 4:
        out += [((2, 2), (P(a), P(b))) for a, b in itertools.product(OPS, repeat=2)]
        out += [((2, 2), (S(0), P(op))) for op in OPS] + [((2, 2), (P(op), R)) for op in OPS]
    return out


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize(("mesh_shape", "placements"), cases(), ids=str)
def test_factories_distribute_tensor_and_from_local_agree(mesh_shape, placements):
    mesh = dt.init_device_mesh(mesh_shape)
    value = np.full((4, 3), 3.0, np.float32)
    made = {
        "full": dt.full((4, 3), 3.0, device_mesh=mesh, placements=placements),
        "from source": dt.distribute_tensor(value, mesh, placements),
        "everywhere": dt.distribute_tensor(value, mesh, placements, src_data_rank=None),
    }
    ref = made["full"].to_local().numpy()
    for how, x in made.items():
        assert x.placements == tuple(placements)
        np.testing.assert_array_equal(x.to_local().numpy(), ref, err_msg=how)
        np.testing.assert_array_equal(x.full_tensor().numpy(), value, err_msg=how)
        back = dt.DTensor.from_local(x.to_local(), mesh, placements, shape=(4, 3))
        np.testing.assert_array_equal(back.full_tensor().numpy(), value, err_msg=how)


@pytest.mark.mpi(min_size=2)
def test_partial_prod_factory_holds_the_value_once():
    """``dt.full(..., placements=[Partial("prod")])`` is the value, not value ** world."""
    mesh = dt.init_device_mesh((WORLD.size,))
    x = dt.full((4,), 3.0, device_mesh=mesh, placements=[P("prod")])
    np.testing.assert_array_equal(x.full_tensor().numpy(), np.full(4, 3.0, np.float32))
    expect = 3.0 if mesh.get_coordinate()[0] == 0 else 1.0
    np.testing.assert_array_equal(x.to_local().numpy(), np.full(4, expect, np.float32))
    ar = dt.arange(6, device_mesh=mesh, placements=[P("prod")])
    np.testing.assert_array_equal(ar.full_tensor().numpy(), np.arange(6))
    dt.manual_seed(7)
    r = dt.rand(3, 2, device_mesh=mesh, placements=[P("sum")])
    dt.manual_seed(7)
    np.testing.assert_array_equal(r.full_tensor().numpy(), dt.rand(3, 2).numpy())


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", OPS)
def test_a_python_scalar_split_into_a_partial_counts_once(op):
    """``P(op) + 2`` splits the scalar like a placed value (the holder keeps it)."""
    mesh = dt.init_device_mesh((WORLD.size,))
    x = dt.full((2, 3), 1.5, device_mesh=mesh, placements=[P(op)])
    y = x + 2
    full = y.full_tensor().numpy()
    np.testing.assert_allclose(full, np.full((2, 3), 3.5, np.float32))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("factory", [dt.randn, dt.rand, dt.zeros, dt.full])
def test_factory_shards_live_in_shared_memory(factory):
    """A mesh-aware factory's shard comes from the pool, so its first redistribute can take
    the node-shared-memory path (``dt.randn`` once built its shard in private memory)."""
    mesh = dt.init_device_mesh((WORLD.size,))
    args = (256 * WORLD.size, 256) if factory is not dt.full else ((256 * WORLD.size, 256), 2.0)
    x = factory(*args, device_mesh=mesh, placements=[S(0)])
    local = x.to_local()
    assert local.nbytes >= allocator.POOL_MIN_BYTES
    if shm.enabled():
        assert shm.locate(local.numpy()) is not None, factory.__name__
    y = x.redistribute(mesh, [R])
    np.testing.assert_array_equal(y.to_local().numpy(), x.full_tensor().numpy())
