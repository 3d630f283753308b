"""DeviceMesh over MPI: shapes, coordinates, sub-meshes, sub-communicators, errors."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import dtensor as dt
from dtensor.errors import MeshError

WORLD = MPI.COMM_WORLD


@pytest.mark.mpi(min_size=1)
def test_1d_mesh_matches_world():
    mesh = dt.init_device_mesh((WORLD.size,))
    assert mesh.shape == (WORLD.size,)
    assert mesh.ndim == 1
    assert mesh.size() == WORLD.size
    assert mesh.size(0) == WORLD.size
    assert mesh.get_coordinate() == (WORLD.rank,)
    assert mesh.get_local_rank() == WORLD.rank
    assert mesh.get_rank() == WORLD.rank
    assert mesh.mesh.tolist() == list(range(WORLD.size))
    assert mesh.get_group(0).size == WORLD.size


@pytest.mark.mpi(min_size=1)
def test_default_mesh_is_world_and_env(monkeypatch):
    monkeypatch.delenv("DTENSOR_MESH", raising=False)
    assert dt.init_device_mesh().shape == (WORLD.size,)
    if WORLD.size == 4:
        monkeypatch.setenv("DTENSOR_MESH", "2x2")
        assert dt.init_device_mesh().shape == (2, 2)


@pytest.mark.mpi(min_size=4)
def test_2d_mesh_coordinates_and_submeshes():
    if WORLD.size != 4:
        pytest.skip("needs exactly 4 ranks")
    mesh = dt.init_device_mesh((2, 2), mesh_dim_names=("dp", "tp"))
    r = WORLD.rank
    assert mesh.get_coordinate() == (r // 2, r % 2)
    assert mesh.get_local_rank("dp") == r // 2
    assert mesh.get_local_rank("tp") == r % 2
    assert mesh.size("tp") == 2
    tp = mesh["tp"]
    assert tp.shape == (2,)
    assert tp.mesh.tolist() == [2 * (r // 2), 2 * (r // 2) + 1]
    assert tp.get_coordinate() == (r % 2,)
    assert tp.mesh_dim_names == ("tp",)
    dp = mesh["dp"]
    assert dp.mesh.tolist() == [r % 2, 2 + r % 2]
    # the sub-communicators group the right ranks, in coordinate order
    got = np.empty(2, np.int64)
    mesh.get_group("tp").mpi.Allgather(np.array([r], np.int64), got)
    assert got.tolist() == tp.mesh.tolist()
    mesh.get_group("dp").mpi.Allgather(np.array([r], np.int64), got)
    assert got.tolist() == dp.mesh.tolist()
    assert mesh["dp", "tp"] is mesh
    assert mesh == dt.init_device_mesh((2, 2), mesh_dim_names=("dp", "tp"))
    assert hash(mesh) == hash(dt.init_device_mesh((2, 2), mesh_dim_names=("dp", "tp")))
    assert mesh != dt.init_device_mesh((4,))


@pytest.mark.mpi(min_size=4)
def test_group_of_dims_on_3d_mesh_shape():
    if WORLD.size != 4:
        pytest.skip("needs exactly 4 ranks")
    mesh = dt.init_device_mesh((2, 1, 2), mesh_dim_names=("a", "b", "c"))
    sub = mesh["a", "c"]
    assert sub.shape == (2, 2)
    assert sub.get_group().size == 4
    assert sub.get_coordinate() == (WORLD.rank // 2, WORLD.rank % 2)


@pytest.mark.mpi(min_size=1)
def test_explicit_rank_array_constructor():
    ranks = np.arange(WORLD.size)[::-1].copy()
    mesh = dt.DeviceMesh("cpu", ranks)
    assert mesh.get_coordinate() == (WORLD.size - 1 - WORLD.rank,)
    assert mesh.mesh.tolist() == ranks.tolist()


@pytest.mark.mpi(min_size=1)
def test_mesh_errors_name_the_values():
    with pytest.raises(MeshError, match=f"needs {WORLD.size + 1} ranks"):
        dt.init_device_mesh((WORLD.size + 1,))
    with pytest.raises(MeshError, match="each rank"):
        dt.DeviceMesh("cpu", np.full(WORLD.size, WORLD.size))
    mesh = dt.init_device_mesh((WORLD.size,), mesh_dim_names=("x",))
    with pytest.raises(MeshError, match="no mesh dim named 'y'"):
        mesh["y"]
    with pytest.raises(MeshError, match="out of range"):
        mesh.size(3)
    with pytest.raises(MeshError, match="mesh_dim_names"):
        dt.init_device_mesh((WORLD.size,), mesh_dim_names=("x", "y"))
    with pytest.raises(ValueError):  # MeshError is a ValueError
        dt.init_device_mesh((0,))


@pytest.mark.mpi(min_size=1)
def test_pytorch_argument_order():
    mesh = dt.init_device_mesh("cpu", (WORLD.size,), mesh_dim_names=("w",))
    assert mesh.device_type == "cpu"
    assert mesh.mesh_dim_names == ("w",)
