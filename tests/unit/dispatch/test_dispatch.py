"""The Python dispatcher and its propagation cache, in one process.

DTensors here live on *simulated* meshes: a mesh object with a shape and this process's
coordinate, equal to every other simulated mesh of the same shape and name (as a real
DeviceMesh is equal on every rank). Every test avoids collectives, so no MPI job is needed;
running one coordinate after another shows what each rank would compute.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers.sim import data, dtensor_of, local_part

import dtensor as dt
from dtensor.dispatch import dispatcher as _dispatch
from dtensor.errors import MeshError, NoRuleError, ShardingError
from dtensor.ops.table import OPS, OpInfo
from placements import Partial, Replicate, Shard

R = Replicate()


@pytest.fixture(autouse=True)
def fresh_cache():
    size = dt.debug.prop_cache_stats()["maxsize"]
    dt.debug.clear_prop_cache()
    yield
    dt.debug.set_prop_cache_size(size)
    dt.debug.clear_prop_cache()


def stats():
    return dt.debug.prop_cache_stats()


# -- cache keys ------------------------------------------------------------------------------
def test_same_signature_hits_and_counters_count():
    mesh = dt.AbstractMesh((2,), coord=(0,))
    x = dtensor_of(data((4, 6)), mesh, [Shard(0)])
    y = dtensor_of(data((4, 6), seed=1), mesh, [Shard(0)])
    x + y
    s = stats()
    assert (s["hits"], s["misses"], s["size"], s["evictions"]) == (0, 1, 1, 0)
    for _ in range(3):
        x + y
    s = stats()
    assert (s["hits"], s["misses"], s["size"]) == (3, 1, 1)


@pytest.mark.parametrize(
    "variant",
    [
        lambda m: dtensor_of(data((6, 6)), m, [Shard(0)]),  # shape
        lambda m: dtensor_of(data((4, 6), np.float64), m, [Shard(0)]),  # dtype
        lambda m: dtensor_of(data((4, 6)), m, [Shard(1)]),  # placements
        lambda m: dtensor_of(data((4, 6)), m, [R]),  # placements
        lambda m: dtensor_of(  # mesh
            data((4, 6)), dt.AbstractMesh((2,), ("other",), coord=(0,)), [Shard(0)]),
        lambda m: dtensor_of(  # mesh shape
            data((4, 6)), dt.AbstractMesh((1,), coord=(0,)), [Shard(0)]),
    ],
    ids=["shape", "dtype", "shard-dim", "replicate", "mesh", "mesh-shape"],
)
def test_different_metadata_never_shares_an_entry(variant):
    mesh = dt.AbstractMesh((2,), coord=(0,))
    base = dtensor_of(data((4, 6)), mesh, [Shard(0)])
    other = variant(mesh)
    a = base.relu()
    b = other.relu()
    assert stats()["misses"] == 2 and stats()["size"] == 2
    assert a.shape == base.shape and b.shape == other.shape
    assert b.dtype == other.dtype and b.device_mesh == other.device_mesh


@pytest.mark.parametrize(
    "call",
    [
        lambda x: x.sum(dim=1),
        lambda x: x.sum(dim=1, keepdim=True),
        lambda x: x.sum(),
        lambda x: x.sum(dim=(0, 1)),
        lambda x: x.mean(dim=0),
    ],
    ids=["dim1", "keepdim", "all", "dims", "mean0"],
)
def test_static_arguments_are_part_of_the_key(call):
    x = dtensor_of(data((4, 6)), dt.AbstractMesh((2,), coord=(0,)), [Shard(0)])
    x.sum(dim=0)
    out = call(x)
    assert stats()["misses"] == 2
    expected = call(dt.from_numpy(data((4, 6))))
    assert out.shape == tuple(expected.shape)


def test_scalar_value_does_not_miss_but_its_type_does():
    mesh = dt.AbstractMesh((2,), coord=(0,))
    g = data((4, 6))
    x = dtensor_of(g, mesh, [Shard(0)])
    y1 = x * 0.5
    y2 = x * 0.25
    s = stats()
    assert (s["misses"], s["hits"]) == (1, 1)
    np.testing.assert_allclose(y2.to_local().numpy(), local_part(g, mesh, [Shard(0)]) * 0.25)
    np.testing.assert_allclose(y1.to_local().numpy(), local_part(g, mesh, [Shard(0)]) * 0.5)
    x * 2  # an int scalar: another signature (weak int vs weak float)
    assert stats()["misses"] == 2


def test_default_dtype_is_part_of_the_key():
    x = dtensor_of(np.arange(8, dtype=np.int64).reshape(4, 2), dt.AbstractMesh((2,), coord=(0,)),
                   [Shard(0)])
    assert (x * 1.5).dtype == np.float32
    old = dt.get_default_dtype()
    dt.set_default_dtype(np.float64)
    try:
        assert (x * 1.5).dtype == np.float64
    finally:
        dt.set_default_dtype(old)
    assert stats()["misses"] == 2


def test_varargs_and_tuple_sizes_share_an_entry():
    x = dtensor_of(data((4, 6)), dt.AbstractMesh((2,), coord=(0,)), [R])
    a = x.view(6, 4)
    b = x.view((6, 4))
    assert a.shape == b.shape == (6, 4)
    assert (stats()["misses"], stats()["hits"]) == (1, 1)


def test_lru_bound_and_evictions():
    dt.debug.set_prop_cache_size(3)
    mesh = dt.AbstractMesh((2,), coord=(0,))
    xs = [dtensor_of(data((2 * (i + 1), 3)), mesh, [Shard(0)]) for i in range(5)]
    for x in xs:
        x.relu()
    s = stats()
    assert (s["size"], s["misses"], s["evictions"]) == (3, 5, 2)  # holds xs[2], xs[3], xs[4]
    xs[2].relu()  # a hit makes xs[2] the most recently used
    assert stats()["hits"] == 1
    xs[0].relu()  # a miss evicts the least recently used: xs[3]
    s = stats()
    assert (s["misses"], s["evictions"]) == (6, 3)
    xs[2].relu()
    xs[4].relu()
    assert stats()["hits"] == 3
    xs[3].relu()
    assert stats()["misses"] == 7
    dt.debug.set_prop_cache_size(1)  # shrinking evicts down to the bound
    s = stats()
    assert (s["size"], s["evictions"]) == (1, 6)
    xs[3].relu()
    assert stats()["hits"] == 4


def test_clear_resets_counters_and_entries():
    x = dtensor_of(data((4, 6)), dt.AbstractMesh((2,), coord=(0,)), [Shard(0)])
    x.relu()
    x.relu()
    dt.debug.clear_prop_cache()
    assert stats()["size"] == stats()["hits"] == stats()["misses"] == 0
    x.relu()
    assert stats()["misses"] == 1


def test_cache_size_from_environment(monkeypatch):
    monkeypatch.setenv("DTENSOR_PROP_CACHE_SIZE", "17")
    assert _dispatch._env_cache_size() == 17
    monkeypatch.setenv("DTENSOR_PROP_CACHE_SIZE", "0")
    with pytest.raises(ValueError, match="DTENSOR_PROP_CACHE_SIZE"):
        _dispatch._env_cache_size()
    monkeypatch.delenv("DTENSOR_PROP_CACHE_SIZE")
    assert _dispatch._env_cache_size() == 4096


# -- decisions are the same on every coordinate ----------------------------------------------
def test_every_coordinate_takes_the_same_decision():
    g1, g2 = data((5, 6)), data((6, 3), seed=1)
    strategies = []
    for coord in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        dt.debug.clear_prop_cache()
        mesh = dt.AbstractMesh((2, 2), coord=coord)
        a = dtensor_of(g1, mesh, [Shard(0), Shard(1)])
        b = dtensor_of(g2, mesh, [R, Shard(0)])
        a @ b
        (entry,) = _dispatch._CACHE.data.values()
        strategies.append(entry.strategy)
    assert all(s == strategies[0] for s in strategies)


# -- scalars and Partial ---------------------------------------------------------------------
def test_partial_sum_plus_scalar_adds_the_scalar_once():
    g = data((4, 3))
    total = np.zeros_like(g)
    for coord in [(0,), (1,), (2,)]:
        dt.debug.clear_prop_cache()  # entries hold this process's coordinate-dependent data
        mesh = dt.AbstractMesh((3,), coord=coord)
        x = dtensor_of(g, mesh, [Partial("sum")])
        y = x + 2.0
        assert y.placements == (Partial("sum"),)
        total += y.to_local().numpy()
        z = 2.0 + x
        np.testing.assert_array_equal(z.to_local().numpy(), y.to_local().numpy())
    np.testing.assert_allclose(total, g + 2.0, rtol=1e-6)


def test_partial_sum_times_scalar_stays_partial_without_identity():
    g = data((4, 3))
    total = np.zeros_like(g)
    for coord in [(0,), (1,)]:
        dt.debug.clear_prop_cache()
        x = dtensor_of(g, dt.AbstractMesh((2,), coord=coord), [Partial("sum")])
        y = x * 3.0
        total += y.to_local().numpy()
    np.testing.assert_allclose(total, g * 3.0, rtol=1e-6)


# -- outputs ---------------------------------------------------------------------------------
def test_multiple_outputs_keep_the_local_structure():
    g = data((4, 6))
    mesh = dt.AbstractMesh((2,), coord=(0,))
    x = dtensor_of(g, mesh, [Shard(0)])
    out = x.max(dim=1)
    local = dt.from_numpy(local_part(g, mesh, [Shard(0)])).max(dim=1)
    assert type(out) is type(local)
    assert isinstance(out.values, dt.DTensor) and isinstance(out.indices, dt.DTensor)
    np.testing.assert_array_equal(out.values.to_local().numpy(), local.values.numpy())
    np.testing.assert_array_equal(out.indices.to_local().numpy(), local.indices.numpy())


def test_inplace_returns_its_input_and_writes_the_local_shard():
    g = data((4, 6))
    mesh = dt.AbstractMesh((2,), coord=(0,))
    x = dtensor_of(g, mesh, [Shard(0)])
    local = x.to_local()
    y = x.mul_(2.0)
    assert y is x and x.to_local() is local
    np.testing.assert_allclose(local.numpy(), local_part(g, mesh, [Shard(0)]) * 2.0)
    x += 1.0
    np.testing.assert_allclose(local.numpy(), local_part(g, mesh, [Shard(0)]) * 2.0 + 1.0)


def test_inplace_that_would_change_placements_raises_and_leaves_input_unchanged():
    mesh = dt.AbstractMesh((2,), coord=(0,))
    g = data((4, 6))
    p = dtensor_of(g, mesh, [Partial("sum")])
    before = p.to_local().numpy().copy()
    with pytest.raises(ShardingError, match=r"relu_.*P\(sum\)"):
        p.relu_()  # relu of a partial sum needs the sum: the output cannot stay P(sum)
    np.testing.assert_array_equal(p.to_local().numpy(), before)
    assert p.placements == (Partial("sum"),)
    assert stats()["size"] == 0


# -- errors ----------------------------------------------------------------------------------
def test_mixing_a_local_tensor_raises_a_sharding_error():
    x = dtensor_of(data((8, 6)), dt.AbstractMesh((2,), coord=(0,)), [Shard(0)])
    local = dt.from_numpy(data((6,)))
    with pytest.raises(ShardingError) as e:
        dt.add(x, local)
    msg = str(e.value)
    assert "add" in msg and "S(0)" in msg and "(8, 6)" in msg and "(6,)" in msg
    assert "from_local" in msg and "distribute_tensor" in msg
    with pytest.raises(ShardingError):
        x + local
    with pytest.raises(ShardingError):
        x + data((6,))


def test_zero_dim_local_tensor_acts_as_a_replicated_value():
    g = data((4, 6))
    mesh = dt.AbstractMesh((2,), coord=(0,))
    x = dtensor_of(g, mesh, [Shard(0)])
    y = x * dt.tensor(3.0)
    np.testing.assert_allclose(y.to_local().numpy(), local_part(g, mesh, [Shard(0)]) * 3.0)
    assert y.placements == (Shard(0),)


def test_operands_on_different_meshes_raise_mesh_error():
    a = dtensor_of(data((4, 6)), dt.AbstractMesh((2,), ("a",), coord=(0,)), [Shard(0)])
    b = dtensor_of(data((4, 6)), dt.AbstractMesh((2,), ("b",), coord=(0,)), [Shard(0)])
    with pytest.raises(MeshError, match="different meshes"):
        a + b


def test_op_without_rule_raises_no_rule_error_naming_op_and_inputs():
    info = OpInfo(
        name="addd", kernel=OPS["add"].kernel, params=("input", "other"),
        tensor_params=("input", "other"),
    )
    x = dtensor_of(data((4, 6)), dt.AbstractMesh((2,), coord=(0,)), [Shard(0)])
    with pytest.raises(NoRuleError) as e:
        _dispatch.dispatch(info, (x, x), {})
    msg = str(e.value)
    assert "addd" in msg and "S(0)" in msg and "add" in msg.replace("addd", "")
    assert stats()["size"] == 0


def test_binding_errors_name_the_op():
    x = dtensor_of(data((4, 6)), dt.AbstractMesh((2,), coord=(0,)), [Shard(0)])
    with pytest.raises(TypeError, match="unexpected keyword"):
        dt.add(x, x, bogus=1)
    with pytest.raises(TypeError, match="missing required"):
        _dispatch.dispatch(OPS["add"], (x,), {})


def test_local_calls_do_not_touch_the_cache():
    a = dt.from_numpy(data((4, 6)))
    out = dt.add(a, a)
    assert isinstance(out, dt.Tensor)
    np.testing.assert_allclose(out.numpy(), data((4, 6)) * 2)
    assert stats()["misses"] == 0 and stats()["hits"] == 0


def test_operators_methods_and_identity_hash():
    mesh = dt.AbstractMesh((2,), coord=(0,))
    g = data((4, 6))
    x = dtensor_of(g, mesh, [Shard(0)])
    y = dtensor_of(g, mesh, [Shard(0)])
    eq = x == y
    assert isinstance(eq, dt.DTensor) and eq.dtype == np.bool_ and eq.placements == (Shard(0),)
    assert bool(eq.to_local().numpy().all())
    assert len({x, x, y}) == 2  # identity hash
    assert (x == None) is False and (x != None) is True
    local = local_part(g, mesh, [Shard(0)])
    cases = [
        (x - 1.0, local - 1), (1.0 - x, 1 - local), (x / 2.0, local / 2), (2.0 / x, 2 / local),
        (-x, -local), (abs(x), np.abs(local)), (x**2, local**2), (x.relu(), np.maximum(local, 0)),
    ]
    for got, want in cases:
        np.testing.assert_allclose(got.to_local().numpy(), want, rtol=1e-6)
    assert x.T.shape == (6, 4) and x.T.placements == (Shard(1),)
    assert x.mT.shape == (6, 4)
    w = dt.where(x > 0, x, 0.0)
    np.testing.assert_allclose(w.to_local().numpy(), np.where(local > 0, local, 0))
    w2 = x.where(x > 0, 0.0)  # Tensor.where(condition, other): where(condition, self, other)
    np.testing.assert_allclose(w2.to_local().numpy(), np.where(local > 0, local, 0))


def test_slices_are_key_parts_and_index_tensors_are_not_cached():
    g = data((6, 4))
    x = dtensor_of(g, dt.AbstractMesh((2,), coord=(0,)), [R])
    a = x[1:5:2]
    b = x[1:5:2]
    c = x[0:5:2]
    assert (stats()["misses"], stats()["hits"]) == (2, 1)
    np.testing.assert_array_equal(a.to_local().numpy(), g[1:5:2])
    np.testing.assert_array_equal(c.to_local().numpy(), g[0:5:2])
    assert b.shape == (2, 4) and c.shape == (3, 4)


def test_tensor_valued_static_arguments_are_decided_per_call():
    mul = OPS["mul"]
    info = OpInfo(
        name="mul", kernel=lambda input, other, tag: mul.kernel(input, other),
        params=("input", "other", "tag"), tensor_params=("input", "other"),
        static_params=("tag",),
    )
    g = data((4, 6))
    x = dtensor_of(g, dt.AbstractMesh((2,), coord=(0,)), [Shard(0)])
    for tag in (dt.tensor([1, 2]), [dt.tensor([3])], np.arange(2)):
        y = _dispatch.dispatch(info, (x, 2.0, tag), {})
        np.testing.assert_allclose(y.to_local().numpy(), x.to_local().numpy() * 2)
    s = stats()
    assert (s["size"], s["misses"], s["hits"]) == (0, 3, 0)
    _dispatch.dispatch(info, (x, 2.0, [1, slice(0, 2)]), {})
    _dispatch.dispatch(info, (x, 2.0, [1, slice(0, 2)]), {})
    assert (stats()["size"], stats()["hits"]) == (1, 1)


def test_variadic_operands_bind_both_ways():
    mesh = dt.AbstractMesh((2,), coord=(0,))
    a, b = data((4, 3)), data((3, 5), seed=1)
    x, w = dtensor_of(a, mesh, [Shard(0)]), dtensor_of(b, mesh, [R])
    y1 = dt.einsum("ij,jk->ik", x, w)
    y2 = dt.einsum("ij,jk->ik", [x, w])
    assert (stats()["misses"], stats()["hits"]) == (1, 1)
    want = local_part(a, mesh, [Shard(0)]) @ b
    np.testing.assert_allclose(y1.to_local().numpy(), want, rtol=1e-5)
    np.testing.assert_allclose(y2.to_local().numpy(), want, rtol=1e-5)
    z = dt.cat([x, x], dim=1)
    assert z.shape == (4, 6) and z.placements == (Shard(0),)
    assert dt.cat([x, x, x], dim=1).shape == (4, 9)  # another operand count: another key
    assert stats()["misses"] == 3


def test_an_optional_size_parameter_binds_as_given():
    """``roll``'s ``dims`` defaults to None: ``roll(x, 3, None)`` passes that None (only a
    required size parameter gathers trailing positionals, as in ``x.view(2, 3)``)."""
    g = data((5, 7))
    x = dtensor_of(g, dt.AbstractMesh((2,), coord=(0,)), [R])
    calls = [
        (dt.roll(x, 3, None), np.roll(g, 3)), (x.roll(3, None), np.roll(g, 3)),
        (x.roll(3), np.roll(g, 3)), (x.roll(2, 1), np.roll(g, 2, 1)),
        (dt.roll(x, (1, 2), (0, 1)), np.roll(g, (1, 2), (0, 1))),
    ]
    for got, want in calls:
        np.testing.assert_array_equal(got.to_local().numpy(), want)
    assert x.view(35, 1).shape == (35, 1) and x.permute(1, 0).shape == (7, 5)
