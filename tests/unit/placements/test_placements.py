"""Placement types and DTensorSpec."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

from placements import (
    REDUCE_OPS,
    DTensorSpec,
    MeshShape,
    Partial,
    Placement,
    Replicate,
    Shard,
    local_offsets,
    local_shape,
    short_placements,
)
from placements.errors import PlacementError, ShardingError

pytestmark = pytest.mark.mode_independent  # see tests/conftest.py

# ---------------------------------------------------------------------------------------------
# Placement types


def test_reprs_and_short_forms():
    assert repr(Shard(0)) == "Shard(dim=0)"
    assert repr(Shard(-1)) == "Shard(dim=-1)"
    assert repr(Replicate()) == "Replicate()"
    assert repr(Partial()) == "Partial(sum)"
    assert repr(Partial("max")) == "Partial(max)"
    assert [p.short() for p in (Shard(2), Replicate(), Partial("avg"))] == ["S(2)", "R", "P(avg)"]
    assert short_placements([Shard(0), Replicate(), Partial()]) == "S(0),R,P(sum)"
    assert short_placements([Shard(3), Replicate()], ", ") == "S(3), R"


def test_equality_and_hash_are_by_value():
    a, b = Shard(1), Shard(1)  # two constructions of one value
    assert a == b and hash(a) == hash(b)
    assert Shard(np.int64(1)) == Shard(1)
    assert Shard(0) != Shard(1)
    r1, r2 = Replicate(), Replicate()
    assert r1 == r2 and hash(r1) == hash(r2)
    assert Partial() == Partial("sum") and Partial("sum") != Partial("max")
    kinds = [Shard(0), Replicate(), Partial()]
    assert len(set(kinds)) == 3
    assert all(a != b for i, a in enumerate(kinds) for b in kinds[i + 1 :])
    assert Shard(0) != 0 and Replicate() != "R"
    assert {(Shard(0), Replicate()): 1}[(Shard(0), Replicate())] == 1


def test_total_order():
    ordered = [Shard(0), Shard(2), Replicate(), Partial("avg"), Partial("sum")]
    assert sorted([Partial("sum"), Replicate(), Shard(2), Partial("avg"), Shard(0)]) == ordered
    r1, r2 = Replicate(), Replicate()
    assert Shard(0) < r1 <= r2 < Partial() and Partial() > Shard(5)
    with pytest.raises(TypeError):
        _ = Shard(0) < 1


def test_predicates():
    s, r, p = Shard(1), Replicate(), Partial("max")
    assert s.is_shard() and s.is_shard(1) and not s.is_shard(0)
    assert not s.is_replicate() and not s.is_partial()
    assert r.is_replicate() and not r.is_shard() and not r.is_partial()
    assert p.is_partial() and p.is_partial("max") and not p.is_partial("sum")
    assert not p.is_shard() and not p.is_replicate()
    assert all(isinstance(x, Placement) for x in (s, r, p))
    assert (s.kind, r.kind, p.kind) == ("S", "R", "P")


def test_placements_are_immutable_and_slotted():
    s = Shard(0)
    with pytest.raises(AttributeError):
        s.dim = 1
    with pytest.raises(AttributeError):
        del s.dim
    with pytest.raises(AttributeError):
        Partial().reduce_op = "max"
    with pytest.raises(AttributeError):
        Replicate().x = 1
    assert not hasattr(s, "__dict__")
    assert s.dim == 0


@pytest.mark.parametrize("p", [Shard(3), Replicate(), Partial("min")])
def test_placements_pickle_and_copy_to_equal_values(p):
    assert pickle.loads(pickle.dumps(p)) == p
    assert copy.deepcopy(p) == p and copy.copy(p) == p


def test_invalid_placements():
    with pytest.raises(PlacementError, match=r"'mean'.*allowed: sum, avg, max, min, prod"):
        Partial("mean")
    assert REDUCE_OPS == ("sum", "avg", "max", "min", "prod")
    with pytest.raises(PlacementError, match="dim must be an int, not str"):
        Shard("0")
    with pytest.raises(PlacementError, match="not bool"):
        Shard(True)
    with pytest.raises(ValueError):  # PlacementError is a ValueError
        Partial("xor")


# ---------------------------------------------------------------------------------------------
# DTensorSpec

MESH = MeshShape((2, 2))


def test_mesh_shape_is_a_hashable_value():
    assert MeshShape([2, 2]) == MESH and hash(MeshShape((2, 2))) == hash(MESH)
    assert MeshShape((4,)) != MESH and MESH.ndim == 2 and MESH.shape == (2, 2)
    assert pickle.loads(pickle.dumps(MESH)) == MESH
    with pytest.raises(AttributeError):
        MESH.shape = (4,)


def test_equal_specs_are_equal_with_equal_hashes():
    a = DTensorSpec(MESH, [Shard(0), Replicate()], (8, 6), np.float32)
    b = DTensorSpec(MeshShape((2, 2)), (Shard(0), Replicate()), [8, 6], "float32")
    assert a == b and hash(a) == hash(b)
    assert {a: 1}[b] == 1
    assert a != DTensorSpec(MESH, [Shard(1), Replicate()], (8, 6), np.float32)
    assert a != DTensorSpec(MESH, [Shard(0), Replicate()], (8, 7), np.float32)
    assert a != DTensorSpec(MESH, [Shard(0), Replicate()], (8, 6), np.float64)
    assert a != DTensorSpec(MeshShape((1, 4)), [Shard(0), Replicate()], (8, 6), np.float32)
    assert a != DTensorSpec(MESH, [Shard(0), Replicate()], (8, 6), np.float32, stride=(1, 8))
    assert pickle.loads(pickle.dumps(a)) == a


def test_negative_shard_dims_are_normalised():
    a = DTensorSpec(MESH, [Shard(-1), Shard(-2)], (8, 6), np.float32)
    assert a.placements == (Shard(1), Shard(0))
    assert a == DTensorSpec(MESH, [Shard(1), Shard(0)], (8, 6), np.float32)
    assert a.with_placements([Replicate(), Shard(-1)]).placements == (Replicate(), Shard(1))


def test_spec_fields_and_queries():
    spec = DTensorSpec(MESH, [Shard(0), Partial()], (5, 6), "float64", stride=(6, 1))
    assert spec.mesh is MESH and spec.mesh_shape == (2, 2) and spec.ndim == 2
    assert spec.shape == (5, 6) and spec.dtype == np.dtype(np.float64) and spec.stride == (6, 1)
    assert isinstance(spec.placements, tuple)
    assert spec.numel() == 30
    assert spec.is_sharded() and spec.has_partial() and not spec.is_replicated()
    rep = spec.with_placements([Replicate(), Replicate()])
    assert rep.is_replicated() and not rep.is_sharded() and not rep.has_partial()
    assert rep.shape == spec.shape and rep.dtype == spec.dtype and rep.stride == spec.stride
    assert rep.mesh is spec.mesh
    for coord in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        assert spec.local_shape(coord) == local_shape((5, 6), (2, 2), spec.placements, coord)
        assert spec.local_offsets(coord) == local_offsets((5, 6), (2, 2), spec.placements, coord)
    assert spec.local_shape((1, 0)) == (2, 6) and spec.local_offsets((1, 1)) == (3, 0)
    assert DTensorSpec(MeshShape(()), [], (), np.int64).numel() == 1


def test_spec_repr_uses_short_forms():
    spec = DTensorSpec(MESH, [Shard(0), Replicate()], (8, 6), np.float32)
    assert repr(spec) == "DTensorSpec(S(0),R, shape=(8, 6), float32, mesh=(2, 2))"
    spec = DTensorSpec(MeshShape((4,)), [Partial("max")], (3,), "int64", stride=(2,))
    assert repr(spec) == "DTensorSpec(P(max), shape=(3,), int64, stride=(2,), mesh=(4,))"


def test_spec_is_immutable():
    spec = DTensorSpec(MESH, [Shard(0), Replicate()], (8, 6), np.float32)
    with pytest.raises(AttributeError):
        spec.shape = (1, 1)
    with pytest.raises(AttributeError):
        del spec.dtype
    assert not hasattr(spec, "__dict__")


def test_spec_errors():
    with pytest.raises(
        PlacementError,
        match=r"^Shard\(dim=3\) is out of range for a 2-D tensor of shape \(4, 6\) "
        r"\(placements \[S\(3\), R\]\)$",
    ):
        DTensorSpec(MESH, [Shard(3), Replicate()], (4, 6), np.float32)
    with pytest.raises(PlacementError, match=r"Shard\(dim=-3\) is out of range"):
        DTensorSpec(MESH, [Shard(-3), Replicate()], (4, 6), np.float32)
    with pytest.raises(
        PlacementError, match=r"1 placements \[S\(0\)\] for a 2-D mesh of shape \(2, 2\)"
    ):
        DTensorSpec(MESH, [Shard(0)], (4, 6), np.float32)
    with pytest.raises(PlacementError, match="is not a placement"):
        DTensorSpec(MESH, [Shard(0), "R"], (4, 6), np.float32)
    with pytest.raises(ShardingError, match="negative size"):
        DTensorSpec(MESH, [Shard(0), Replicate()], (4, -1), np.float32)
    with pytest.raises(ShardingError, match="stride"):
        DTensorSpec(MESH, [Shard(0), Replicate()], (4, 6), np.float32, stride=(1,))
    with pytest.raises(PlacementError, match="out of range"):
        DTensorSpec(MESH, [Shard(0), Replicate()], (4, 6), np.float32).with_placements(
            [Shard(2), Replicate()]
        )
    with pytest.raises(TypeError):
        DTensorSpec(MESH, [Shard(0), Replicate()], (4, 6), "not-a-dtype")
