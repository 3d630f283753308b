"""Escape hatches over MPI: ``dt.local_map``, ``dt.implicit_replication()``,
``DeviceMesh._flatten`` and ``dt.register_op(..., replace=True)``, against numpy on the
global data (uneven and empty shards at 3 and 4 ranks)."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import dtensor as dt
from dtensor.errors import ArgumentError, PlacementError, ShardingError
from dtensor.testing import distribute_random
from placements.rules import Candidate, RuleResult, get_rule

WORLD = MPI.COMM_WORLD
R, S, P = dt.Replicate(), dt.Shard, dt.Partial


def _data(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("rows", [5, 2, 0])
def test_local_map_runs_on_shards_with_declared_placements(rows):
    mesh = dt.init_device_mesh((WORLD.size,))
    a, w = _data((rows, 3)), _data((3, 4), 1)
    x = dt.distribute_tensor(a, mesh, [S(0)])
    wd = dt.distribute_tensor(w, mesh, [R])

    def mm_and_count(t, m, scale):
        return t @ m * scale, t.shape[0]

    f = dt.local_map(mm_and_count, out_placements=([S(0)], None),
                     in_placements=([S(0)], [R], None))
    out, n = f(x, wd, 2.0)
    assert out.placements == (S(0),) and out.shape == (rows, 4)
    np.testing.assert_allclose(out.full_tensor().numpy(), a @ w * 2, rtol=1e-5, atol=1e-5)
    assert n == x.to_local().shape[0]
    # the local sums as a Partial(sum): the global sum, without any gather of the input
    total = dt.local_map(lambda t: t.sum(), [P("sum")])(x)
    np.testing.assert_allclose(total.full_tensor().numpy(), a.sum(), rtol=1e-5, atol=1e-5)


@pytest.mark.mpi(min_size=1)
def test_local_map_checks_or_redistributes_inputs():
    mesh = dt.init_device_mesh((WORLD.size,))
    a = _data((6, 2))
    x = dt.distribute_tensor(a, mesh, [S(1)])
    double = dt.local_map(lambda t: t * 2, [S(0)], in_placements=([S(0)],))
    with pytest.raises(PlacementError, match="redistribute_inputs=True"):
        double(x)
    moved = dt.local_map(lambda t: t * 2, [S(0)], in_placements=([S(0)],),
                         redistribute_inputs=True)(x)
    np.testing.assert_array_equal(moved.full_tensor().numpy(), a * 2)

    @dt.local_map(out_placements={"y": [S(1)]}["y"], device_mesh=mesh)
    def negate(t):
        return -t

    np.testing.assert_array_equal(negate(x).full_tensor().numpy(), -a)
    # no DTensor among the arguments: the function's own result
    assert isinstance(negate(dt.tensor(a)), dt.Tensor)
    with pytest.raises(PlacementError, match="out_placements"):
        dt.local_map(lambda t: (t, t), [S(1)])(x)
    with pytest.raises(PlacementError, match="in_placements"):
        dt.local_map(lambda t: t, [S(1)], in_placements=([S(1)], [R]))(x)
    with pytest.raises(ArgumentError, match="local tensors"):
        dt.local_map(lambda t: x, [S(1)])(x)


@pytest.mark.mpi(min_size=1)
def test_implicit_replication_treats_local_tensors_as_replicate():
    mesh = dt.init_device_mesh((WORLD.size,))
    a, b = _data((5, 3)), _data((5, 3), 1)
    for pl in ([S(0)], [S(1)], [R], [P("sum")]):
        x = distribute_random(a, mesh, pl, seed=3)
        with pytest.raises(ShardingError, match="cannot mix"):
            x + dt.tensor(b)
        with dt.implicit_replication():
            with dt.implicit_replication():
                y = x * dt.tensor(b)
            z = dt.cat([x, b[:2]])
            w = dt.where(x > 0, b, x)
        np.testing.assert_allclose(y.full_tensor().numpy(), a * b, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(z.full_tensor().numpy(), np.concatenate([a, b[:2]]),
                                   rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(w.full_tensor().numpy(), np.where(a > 0, b, a),
                                   rtol=1e-5, atol=1e-5)
        with pytest.raises(ShardingError, match="cannot mix"):
            x - dt.tensor(b)
    x = dt.distribute_tensor(a, mesh, [S(0)])
    with dt.implicit_replication():
        x.add_(dt.tensor(b))
    np.testing.assert_allclose(x.full_tensor().numpy(), a + b, rtol=1e-6)


def _flat_checks(mesh, flat):
    assert flat.ndim == 1 and flat.shape == (mesh.size(),)
    np.testing.assert_array_equal(flat.mesh, mesh.mesh.reshape(-1))
    coord = flat.get_coordinate()[0]
    assert coord == int(np.ravel_multi_index(mesh.get_coordinate(), mesh.shape))
    assert int(flat.mesh[coord]) == mesh.get_rank()
    a = _data((7, 2))
    x = dt.distribute_tensor(a, flat, [S(0)], src_data_rank=None)
    np.testing.assert_array_equal(x.full_tensor().numpy(), a)
    # the shard of the flattened mesh is the shard of (S(0), S(0)) on the N-D mesh
    nd = dt.distribute_tensor(a, mesh, [S(0)] * mesh.ndim, src_data_rank=None)
    if mesh.ndim <= 2:
        np.testing.assert_array_equal(x.to_local().numpy(), nd.to_local().numpy())


@pytest.mark.mpi(min_size=1)
def test_flatten_merges_mesh_dims_and_shares_communicators():
    n = WORLD.size
    line = dt.init_device_mesh((n,), mesh_dim_names=("w",))
    assert line._flatten() is line
    assert line._flatten("z").mesh_dim_names == ("z",)
    mesh = dt.init_device_mesh((1, n), mesh_dim_names=("dp", "tp"))
    flat = mesh._flatten()
    assert flat.mesh_dim_names == ("dp_tp",) and flat == dt.init_device_mesh((n,), ("dp_tp",))
    assert flat.get_group(0) is line.get_group(0)  # the shared communicator cache
    _flat_checks(mesh, flat)
    if n == 4:
        sq = dt.init_device_mesh((2, 2), mesh_dim_names=("dp", "tp"))
        _flat_checks(sq, sq._flatten("all"))
        cube = dt.init_device_mesh((1, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
        sub = cube["dp", "tp"]._flatten()
        assert sub.mesh_dim_names == ("dp_tp",)
        _flat_checks(cube["dp", "tp"], sub)
        half = dt.init_device_mesh((2, 2, 1), mesh_dim_names=("pp", "dp", "tp"))
        pair = half["dp", "tp"]._flatten()
        assert pair.shape == (2,)
        _flat_checks(half["dp", "tp"], pair)


def _replicate_only(schema):
    a = schema.args[0]
    return RuleResult((a.shape,), (a.dtype,), (Candidate((R, R)),))


@pytest.mark.mpi(min_size=1)
def test_register_op_replaces_a_builtin_rule_only_when_asked():
    mesh = dt.init_device_mesh((WORLD.size,))
    a = _data((5, 3))
    x = dt.distribute_tensor(a, mesh, [S(0)])
    with pytest.raises(ArgumentError, match="already an op"):
        dt.register_op("relu", lambda input: input, _replicate_only)
    assert x.relu().placements == (S(0),)
    builtin = get_rule("relu")
    try:
        relu = dt.register_op("relu", None, _replicate_only, replace=True)
        y = x.relu()
        assert y.placements == (R,)
        np.testing.assert_array_equal(y.to_local().numpy(), np.maximum(a, 0))
        assert relu(x).placements == (R,)
        np.testing.assert_array_equal(relu(dt.tensor(a)).numpy(), np.maximum(a, 0))
        with pytest.raises(ArgumentError, match="kernel=None"):
            dt.register_op("relu", lambda input: input, _replicate_only, replace=True)
        with pytest.raises(ArgumentError, match="no op"):
            dt.register_op("no_such_op_here", None, _replicate_only, replace=True)
    finally:
        dt.register_op("relu", None, builtin, replace=True)
    assert x.relu().placements == (S(0),)
