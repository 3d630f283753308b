"""DTensor API over MPI: distribute_tensor, from_local, to_local, full_tensor, redistribute,
factories. Every test body is rank-independent in control flow."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from helpers.mpi import meshes_dp_tp as meshes
from mpi4py import MPI

import dtensor as dt
from dtensor.errors import PlacementError, ShardingError
from dtensor.testing import distribute_random
from placements.layout import local_slices

WORLD = MPI.COMM_WORLD
R, S, P = dt.Replicate(), dt.Shard, dt.Partial


def placement_options(ndim, kinds=("sum", "max")):
    return [R, *(P(k) for k in kinds)] + [S(d) for d in range(ndim)]


def all_placements(mesh, ndim, with_partial=True, kinds=("sum", "max")):
    opts = [p for p in placement_options(ndim, kinds) if with_partial or not p.is_partial()]
    return list(itertools.product(opts, repeat=mesh.ndim))


SHAPES = [(8, 6), (5, 3), (1, 7), (0, 4), (3, 2)]


def global_data(shape, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    if np.dtype(dtype) == np.bool_:
        return rng.random(shape) > 0.5
    return (rng.standard_normal(shape) * 10).astype(dtype)


def expected_local(arr, mesh, placements):
    """This rank's shard of the global array (Partial: the value the holder has)."""
    coord = mesh.get_coordinate()
    local = arr[local_slices(arr.shape, mesh.shape, placements, coord)]
    for m, p in enumerate(placements):
        if p.is_partial("sum") and coord[m] != 0:
            local = np.zeros_like(local)
    return local


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("src", [0, None, "last"])
def test_distribute_tensor_gives_each_rank_its_shard(shape, src):
    src_rank = WORLD.size - 1 if src == "last" else src
    for mesh in meshes():
        for pl in all_placements(mesh, len(shape)):
            arr = global_data(shape)
            data = arr if (src_rank is None or WORLD.rank == src_rank) else None
            x = dt.distribute_tensor(data, mesh, pl, src_data_rank=src_rank)
            assert x.shape == shape and x.placements == pl and x.dtype == np.float32
            np.testing.assert_array_equal(x.to_local().numpy(), expected_local(arr, mesh, pl))
            np.testing.assert_array_equal(x.full_tensor().numpy(), arr)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", [np.float64, np.int64, np.bool_])
def test_full_tensor_roundtrip_dtypes(dtype):
    for mesh in meshes():
        for pl in all_placements(mesh, 2, with_partial=dtype != np.bool_):
            arr = global_data((5, 3), dtype)
            x = dt.distribute_tensor(arr, mesh, pl)
            assert x.dtype == np.dtype(dtype)
            np.testing.assert_array_equal(x.full_tensor().numpy(), arr)


MESH_3D = {4: (2, 1, 2), 8: (2, 2, 2)}.get(WORLD.size)


@pytest.mark.mpi(min_size=4)
@pytest.mark.skipif(
    MESH_3D is None,
    reason="a 3-D mesh runs at 4 ranks (2x1x2) and 8 ranks (2x2x2, launched by "
    "tests/unit/launch/test_examples.py::test_3d_meshes_at_8_ranks)",
)
@pytest.mark.parametrize("shape", [(8, 6), (5, 3), (3, 4, 5)], ids=str)
def test_api_on_a_3d_mesh(shape):
    """distribute_tensor (scatter from the last rank), full_tensor and redistribute through
    the public API on a 3-D mesh, for a sample of placement pairs (same draw on every rank)."""
    mesh = dt.init_device_mesh(MESH_3D, mesh_dim_names=("a", "b", "c"))
    assert mesh.ndim == 3 and mesh["c"].shape == (MESH_3D[2],)
    arr = global_data(shape, np.float64)
    pls = all_placements(mesh, len(shape))
    rng = np.random.default_rng(len(shape) * 100 + shape[0])
    for i in rng.permutation(len(pls))[: 40 if WORLD.size < 8 else 16]:  # 8: 4 ranks a core
        src_pl = pls[i]
        data = arr if WORLD.rank == WORLD.size - 1 else None
        x = dt.distribute_tensor(data, mesh, src_pl, src_data_rank=WORLD.size - 1)
        np.testing.assert_array_equal(x.to_local().numpy(), expected_local(arr, mesh, src_pl))
        for j in rng.integers(0, len(pls), 6):
            dst_pl = pls[j]
            y = x.redistribute(mesh, dst_pl)
            assert y.placements == dst_pl and y.shape == shape
            np.testing.assert_allclose(
                y.full_tensor().numpy(), arr, rtol=1e-12, atol=1e-12,
                err_msg=f"{src_pl} -> {dst_pl} on {mesh.shape}",
            )  # fmt: skip
            if not any(p.is_partial() for p in dst_pl):
                np.testing.assert_array_equal(
                    y.to_local().numpy(), expected_local(arr, mesh, dst_pl)
                )


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("shape", [(8, 6), (5, 3), (0, 4)])
def test_redistribute_every_pair(shape):
    for mesh in meshes():
        arr = global_data(shape)
        # every Partial kind on a 1-D mesh; sum and max on 2-D (test_execute covers every
        # pair of kinds there)
        kinds = ("sum", "avg", "max", "min") if mesh.ndim == 1 else ("sum", "max")
        pls = all_placements(mesh, len(shape), kinds=kinds)
        for src_pl in pls:
            # a Partial source holds random per-rank contributions (not the degenerate
            # value-on-one-rank split), so reducing with the wrong op gives wrong numbers
            x = distribute_random(arr, mesh, src_pl, seed=len(pls))
            for dst_pl in pls:
                y = x.redistribute(mesh, dst_pl)
                assert y.placements == dst_pl and y.shape == shape
                np.testing.assert_allclose(
                    y.full_tensor().numpy(), arr, rtol=1e-6, atol=1e-5,
                    err_msg=f"{src_pl} -> {dst_pl} on {mesh.shape}",
                )
                if not any(p.is_partial() for p in dst_pl):
                    np.testing.assert_allclose(
                        y.to_local().numpy(), expected_local(arr, mesh, dst_pl), rtol=1e-6,
                        atol=1e-5,
                    )


@pytest.mark.mpi(min_size=1)
def test_partial_reductions_from_local():
    mesh = dt.init_device_mesh((WORLD.size,))
    contrib = np.arange(6, dtype=np.float64).reshape(2, 3) + WORLD.rank
    allc = np.stack([np.arange(6.0).reshape(2, 3) + r for r in range(WORLD.size)])
    want = {"sum": allc.sum(0), "avg": allc.mean(0), "max": allc.max(0), "min": allc.min(0)}
    for op, expected in want.items():
        x = dt.DTensor.from_local(dt.from_numpy(contrib.copy()), mesh, [P(op)])
        np.testing.assert_allclose(x.full_tensor().numpy(), expected)
        np.testing.assert_allclose(x.redistribute(mesh, [S(1)]).full_tensor().numpy(), expected)


@pytest.mark.mpi(min_size=1)
def test_from_local_infers_exact_uneven_global_shape():
    mesh = dt.init_device_mesh((WORLD.size,))
    n = 2 * WORLD.size + 1  # uneven on every world size > 1
    arr = global_data((n, 3))
    local = arr[local_slices(arr.shape, mesh.shape, (S(0),), mesh.get_coordinate())]
    x = dt.DTensor.from_local(dt.from_numpy(local), mesh, [S(0)])
    assert x.shape == (n, 3)
    np.testing.assert_array_equal(x.full_tensor().numpy(), arr)
    # with shape given: local (no communication), same result
    y = dt.DTensor.from_local(dt.from_numpy(local), mesh, [S(0)], shape=(n, 3))
    np.testing.assert_array_equal(y.full_tensor().numpy(), arr)
    assert y.to_local().untyped_storage().data_ptr() == dt.from_numpy(local).untyped_storage(
    ).data_ptr()


@pytest.mark.mpi(min_size=2)
def test_from_local_run_check_raises_on_every_rank():
    mesh = dt.init_device_mesh((WORLD.size,))
    rows = 3 if WORLD.rank == 1 else 2  # rank 1 disagrees with the even split
    local = dt.zeros(rows, 4)
    with pytest.raises(ShardingError, match="rank 1"):
        dt.DTensor.from_local(local, mesh, [S(0)], shape=(2 * WORLD.size, 4), run_check=True)
    # without shape: inferred shape is consistent only if the split is a torch.chunk split
    if WORLD.size > 2:
        with pytest.raises(ShardingError, match="do not match"):
            dt.DTensor.from_local(local, mesh, [S(0)])


@pytest.mark.mpi(min_size=1)
def test_placement_errors_name_values():
    mesh = dt.init_device_mesh((WORLD.size,))
    with pytest.raises(PlacementError, match="placements"):
        dt.distribute_tensor(np.zeros((4, 4)), mesh, [S(0), R])
    with pytest.raises(PlacementError, match="out of range"):
        dt.distribute_tensor(np.zeros((4, 4)), mesh, [S(2)])
    x = dt.distribute_tensor(np.zeros((4, 4)), mesh, [S(0)])
    with pytest.raises(PlacementError):
        x.redistribute(mesh, [S(5)])
    with pytest.raises(PlacementError, match="not a placement"):
        x.redistribute(mesh, ["R"])


@pytest.mark.mpi(min_size=1)
def test_negative_shard_dim_is_normalised():
    mesh = dt.init_device_mesh((WORLD.size,))
    x = dt.distribute_tensor(np.arange(12.0).reshape(3, 4), mesh, [S(-1)])
    assert x.placements == (S(1),)


@pytest.mark.mpi(min_size=1)
def test_repr_metadata_and_to_local_share_memory():
    mesh = dt.init_device_mesh((WORLD.size,))
    arr = global_data((8, 6))
    x = dt.distribute_tensor(arr, mesh, [S(0)])
    text = repr(x)
    assert "DTensor(" in text and "Shard(dim=0)" in text
    assert x.ndim == 2 and x.numel() == 48 and x.size(1) == 6 and x.stride() == (6, 1)
    assert x.device_mesh is mesh
    local = x.to_local()
    assert local is x.to_local()
    # R -> S is a view of the replicated local tensor: no copy
    r = dt.distribute_tensor(arr, mesh, [R])
    s = r.redistribute(mesh, [S(0)])
    assert (
        s.to_local().untyped_storage().data_ptr() == r.to_local().untyped_storage().data_ptr()
    )


@pytest.mark.mpi(min_size=1)
def test_noncontiguous_local_redistributes():
    mesh = dt.init_device_mesh((WORLD.size,))
    arr = global_data((6, 2 * WORLD.size + 1))
    for pl in [(S(0),), (S(1),)]:
        # build the shard as a transposed view of a contiguous buffer
        local = arr[local_slices(arr.shape, mesh.shape, pl, mesh.get_coordinate())]
        t = dt.from_numpy(np.ascontiguousarray(local.T)).t()
        assert not t.is_contiguous() or min(t.shape) <= 1
        x = dt.DTensor.from_local(t, mesh, pl, shape=arr.shape)
        for dst in [(R,), (S(0),), (S(1),)]:
            np.testing.assert_array_equal(x.redistribute(mesh, dst).full_tensor().numpy(), arr)


@pytest.mark.mpi(min_size=1)
def test_factories_allocate_local_shard_with_global_values():
    for mesh in meshes():
        for pl in all_placements(mesh, 2, with_partial=False):
            shape = (5, 3)
            z = dt.zeros(shape, device_mesh=mesh, placements=pl)
            assert z.to_local().shape == expected_local(np.zeros(shape), mesh, pl).shape
            np.testing.assert_array_equal(z.full_tensor().numpy(), np.zeros(shape, np.float32))
            np.testing.assert_array_equal(
                dt.ones(shape, device_mesh=mesh, placements=pl).full_tensor().numpy(),
                np.ones(shape, np.float32),
            )
            np.testing.assert_array_equal(
                dt.full(shape, 2.5, device_mesh=mesh, placements=pl).full_tensor().numpy(),
                np.full(shape, 2.5, np.float32),
            )
            e = dt.empty(shape, device_mesh=mesh, placements=pl)
            assert e.shape == shape and e.dtype == np.float32
        for pl in [(S(0),) * mesh.ndim, (R,) * mesh.ndim]:
            a = dt.arange(11, device_mesh=mesh, placements=pl)
            np.testing.assert_array_equal(a.full_tensor().numpy(), np.arange(11))
            a = dt.arange(1.5, 7.0, 0.5, device_mesh=mesh, placements=pl).full_tensor().numpy()
            assert a.dtype == np.float32  # the default dtype, as torch's
            np.testing.assert_array_equal(a, np.arange(1.5, 7.0, 0.5, dtype=np.float32))
            lin = dt.linspace(-1, 2, 9, device_mesh=mesh, placements=pl).full_tensor().numpy()
            assert lin.dtype == np.float32
            np.testing.assert_array_equal(lin, np.linspace(-1, 2, 9, dtype=np.float32))
        for pl in all_placements(mesh, 2, with_partial=True):
            eye = dt.eye(5, 3, device_mesh=mesh, placements=pl)
            np.testing.assert_array_equal(eye.full_tensor().numpy(), np.eye(5, 3, dtype=np.float32))
            dt.manual_seed(3)
            ri = dt.randint(-4, 9, (6, 5), device_mesh=mesh, placements=pl).full_tensor().numpy()
            assert ri.min() >= -4 and ri.max() < 9 and len(np.unique(ri)) > 5
            # the values are dtensor's generator's (no outside library draws them): the
            # single-device draw of the same seed is the oracle
            dt.manual_seed(3)
            np.testing.assert_array_equal(ri, dt.randint(-4, 9, (6, 5)).numpy())


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", ["rand", "randn"])
def test_random_factories_same_global_values_on_any_placement(name):
    shape = (7, 5)
    dt.manual_seed(1234)
    want = getattr(dt, name)(shape).numpy()
    for mesh in meshes():
        for pl in all_placements(mesh, 2, with_partial=False) + [(P("sum"),) * mesh.ndim]:
            dt.manual_seed(1234)
            x = getattr(dt, name)(shape, device_mesh=mesh, placements=pl)
            np.testing.assert_array_equal(x.full_tensor().numpy(), want, err_msg=str(pl))
    # consecutive calls differ, and the generator stays in step on every rank
    dt.manual_seed(7)
    a = dt.rand(4, 4, device_mesh=meshes()[0], placements=[S(0)]).full_tensor().numpy()
    b = dt.rand(4, 4, device_mesh=meshes()[0], placements=[S(0)]).full_tensor().numpy()
    assert not np.array_equal(a, b)
    gathered = np.empty((WORLD.size, 16), np.float32)
    WORLD.Allgather(np.ascontiguousarray(b.ravel()), gathered)
    assert (gathered == gathered[0]).all()


@pytest.mark.mpi(min_size=1)
def test_redistribute_allocates_only_its_output_after_warmup():
    mesh = dt.init_device_mesh((WORLD.size,))
    arr = global_data((2048, 2048))
    for src in [(S(0),), (S(1),)]:
        x = dt.distribute_tensor(arr, mesh, src, src_data_rank=None)
        x = dt.DTensor.from_local(x.to_local().clone(), mesh, src, shape=arr.shape)
        y = x.redistribute(mesh, [R])  # warm-up: plans, datatypes, pool segments
        del y
        before = dt.memory_stats()
        y = x.redistribute(mesh, [R])
        during = dt.memory_stats()
        out_bytes = y.to_local().nbytes
        # one pooled allocation (the output), nothing else; no new segment reserved
        assert during["num_allocs"] - before["num_allocs"] <= 1, src
        assert during["allocated_bytes"] - before["allocated_bytes"] <= out_bytes + 4096
        assert during["reserved_bytes"] == before["reserved_bytes"], src
        del y
        for _ in range(5):
            y = x.redistribute(mesh, [R])
            del y
        after = dt.memory_stats()
        assert after["reserved_bytes"] == before["reserved_bytes"]
        assert after["allocated_bytes"] == before["allocated_bytes"]


@pytest.mark.mpi(min_size=2)
def test_outputs_keep_their_mesh_when_caches_differ_between_ranks():
    # Rank 0 alone fills its propagation cache for mesh A; then every rank computes on an
    # equal mesh B built later. Rank 0's output must be on B like everyone else's: on A,
    # its next collective would run on another communicator than the other ranks'.
    a = np.arange(WORLD.size * 6, dtype=np.float32).reshape(2 * WORLD.size, 3)
    shard, rep = [dt.Shard(0)], [dt.Replicate()]
    ma = dt.init_device_mesh((WORLD.size,))
    xa = dt.distribute_tensor(a, ma, shard)
    if WORLD.rank == 0:
        for _ in range(2):  # a miss, then a hit (the compiled front's entry)
            xa + xa
            xa.sum(dim=1)
    mb = dt.init_device_mesh((WORLD.size,))
    xb = dt.distribute_tensor(a, mb, shard)
    for _ in range(2):
        outs = [xb + xb, xb.sum(dim=1), xb.redistribute(mb, rep)]
        assert all(o.device_mesh is mb for o in outs)
        np.testing.assert_array_equal(outs[0].full_tensor().numpy(), 2 * a)
        np.testing.assert_array_equal(outs[1].full_tensor().numpy(), a.sum(axis=1))
