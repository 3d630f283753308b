"""Mesh identity and mesh communicators over MPI.

- A mesh's identity is where its coordinates sit in COMM_WORLD: meshes over communicators
  that order the ranks differently are unequal, and ops or redistributes that mix them
  raise ``MeshError`` naming both; a mesh over a duplicate of COMM_WORLD equals the world
  mesh.
- Identical meshes share their communicators, so creating meshes in a loop never runs MPI
  out of communicators; the ranks agree on every cache decision, even when one rank's
  cache was lost.
- ``from_local(run_check=True)`` checks Replicate and Partial local shapes and dtypes
  across ranks when ``shape`` is omitted.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import dtensor as dt
from dtensor.errors import MeshError, ShardingError
from redistribute.comm import mesh as CM

WORLD = MPI.COMM_WORLD
N = WORLD.size


@pytest.fixture
def reversed_comm():
    """COMM_WORLD with the rank order reversed (world rank r is rank N - 1 - r)."""
    comm = WORLD.Split(0, N - 1 - WORLD.rank)
    yield comm
    comm.Free()


@pytest.mark.mpi(min_size=2)
def test_meshes_over_reordered_communicators_differ(reversed_comm):
    world_mesh = dt.init_device_mesh((N,))
    rev_mesh = dt.init_device_mesh((N,), comm=reversed_comm)
    assert rev_mesh.mesh.tolist() == list(range(N))  # ranks of its own communicator
    assert rev_mesh.get_coordinate() == (N - 1 - WORLD.rank,)
    assert rev_mesh != world_mesh
    assert repr(rev_mesh) != repr(world_mesh)
    assert f"world_ranks={list(range(N))[::-1]}" in repr(rev_mesh)
    data = np.arange(4.0 * N)
    a = dt.distribute_tensor(data, world_mesh, [dt.Shard(0)])
    b = dt.distribute_tensor(data, rev_mesh, [dt.Shard(0)])
    np.testing.assert_array_equal(b.full_tensor().numpy(), data)
    with pytest.raises(MeshError) as info:
        a + b
    assert repr(world_mesh) in str(info.value) and repr(rev_mesh) in str(info.value)
    with pytest.raises(MeshError) as info:
        a.redistribute(rev_mesh, [dt.Replicate()])
    assert repr(world_mesh) in str(info.value) and repr(rev_mesh) in str(info.value)


@pytest.mark.mpi(min_size=2)
def test_mesh_ordered_like_world_equals_world_mesh(reversed_comm):
    # coordinate c of this mesh is world rank c, as in the world mesh: same identity
    grid = np.arange(N)[::-1].copy()
    same = dt.DeviceMesh("cpu", grid, comm=reversed_comm)
    world_mesh = dt.init_device_mesh((N,))
    assert same == world_mesh and hash(same) == hash(world_mesh)
    assert same.get_coordinate() == (WORLD.rank,)
    dup = WORLD.Dup()
    try:
        dup_mesh = dt.init_device_mesh((N,), comm=dup)
        assert dup_mesh == world_mesh and hash(dup_mesh) == hash(world_mesh)
        data = np.arange(4.0 * N)
        a = dt.distribute_tensor(data, world_mesh, [dt.Shard(0)])
        b = dt.distribute_tensor(data, dup_mesh, [dt.Shard(0)])
        np.testing.assert_array_equal((a + b).full_tensor().numpy(), 2 * data)
    finally:
        dup.Free()


@pytest.mark.mpi(min_size=2)
def test_sub_meshes_keep_world_identity(reversed_comm):
    world_mesh = dt.init_device_mesh((N, 1), mesh_dim_names=("a", "b"))
    rev_mesh = dt.init_device_mesh((N, 1), mesh_dim_names=("a", "b"), comm=reversed_comm)
    assert world_mesh["a"] != rev_mesh["a"]
    assert world_mesh["b"] == rev_mesh["b"]  # both are this rank alone
    assert world_mesh["a"] == dt.init_device_mesh((N,), mesh_dim_names=("a",))


@pytest.mark.mpi(min_size=2)
@pytest.mark.mode_independent  # mesh creation is below the dispatch (tests/conftest.py)
def test_identical_meshes_share_communicators():
    first = dt.init_device_mesh((N,))
    first_2d = dt.init_device_mesh((N, 1))
    # more meshes than MPI has communicators (MPICH: 2048 per process): unshared, the
    # 1,500 rounds would need 4,500
    for _ in range(1_500):
        mesh = dt.init_device_mesh((N,))
        mesh_2d = dt.init_device_mesh((N, 1))
    assert mesh.get_all_groups() == first.get_all_groups()
    assert mesh_2d.get_all_groups() == first_2d.get_all_groups()
    again = dt.init_device_mesh((N,))
    assert again.get_group(0) is first.get_group(0)
    assert again.get_group(0) is first_2d.get_group(0)  # the same ranks in the same order
    x = dt.distribute_tensor(np.arange(2.0 * N), again, [dt.Shard(0)])
    np.testing.assert_array_equal(x.full_tensor().numpy(), np.arange(2.0 * N))


@pytest.mark.mpi(min_size=2)
def test_ranks_agree_when_one_rank_lost_its_shared_communicators():
    first = dt.init_device_mesh((N,))
    if WORLD.rank == 0:  # rank 0 alone finds no shared communicator: every rank splits anew
        CM._shared_comms.clear()
    mesh = dt.init_device_mesh((N,))
    assert mesh.get_group(0) is not first.get_group(0)
    x = dt.distribute_tensor(np.arange(2.0 * N), mesh, [dt.Shard(0)])
    np.testing.assert_array_equal(x.full_tensor().numpy(), np.arange(2.0 * N))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("placement", [dt.Replicate(), dt.Partial("sum")], ids=["R", "P"])
def test_from_local_run_check_compares_replicated_shapes(placement):
    mesh = dt.init_device_mesh((N,))
    rows = 3 if WORLD.rank == 1 else 2  # rank 1 holds a different shape
    with pytest.raises(ShardingError, match="run_check=True") as info:
        dt.DTensor.from_local(dt.ones(rows, 2), mesh, [placement], run_check=True)
    # each rank compares with its own shape: rank 1 reports rank 0's, the others rank 1's
    if WORLD.rank == 1:
        assert "(rank 0): local float32 (2, 2), expected float32 (3, 2)" in str(info.value)
    else:
        assert "(rank 1): local float32 (3, 2), expected float32 (2, 2)" in str(info.value)
    dtype = dt.float64 if WORLD.rank == 1 else dt.float32
    with pytest.raises(ShardingError, match="float64 \\(2, 2\\)"):
        dt.DTensor.from_local(dt.ones(2, 2, dtype=dtype), mesh, [placement], run_check=True)
    ok = dt.DTensor.from_local(dt.ones(2, 2), mesh, [placement], run_check=True)
    assert ok.shape == (2, 2)
