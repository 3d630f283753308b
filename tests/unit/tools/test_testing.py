"""``dtensor.testing``: Partial contributions that reduce to the value and differ between
coordinates, blocks that tile the value under any placements, and the errors it names."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import dtensor as dt
from dtensor.testing import blocks, distribute_random, partial_contributions
from placements import Partial, Replicate, Shard
from placements.errors import ArgumentError
from placements.layout import local_slices

F32, F64, I64, I32, B, C64 = (np.dtype(t) for t in (np.float32, np.float64, np.int64,
                                                     np.int32, np.bool_, np.complex64))
_REDUCE = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}
_BOOL_REDUCE = {"sum": np.logical_or, "max": np.logical_or, "min": np.logical_and,
                "prod": np.logical_and}
_SPECIAL = [np.nan, np.inf, -np.inf]


def _value(dtype: np.dtype, shape=(6, 5), seed=0, special=False) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype == B:
        return rng.random(shape) < 0.5
    if dtype.kind in "iu":
        return rng.integers(-50, 50, shape).astype(dtype)
    v = rng.standard_normal(shape) * 3
    if dtype.kind == "c":
        v = v + 1j * rng.standard_normal(shape)
    v = v.astype(dtype)
    if special:
        v.flat[[0, 7, 13]] = _SPECIAL
    return v


def _reduce(op: str, parts: list[np.ndarray]) -> np.ndarray:
    """The reduction of contributions, as a Partial(op) tensor's reduce defines it."""
    if parts[0].dtype == B:
        return _BOOL_REDUCE[op].reduce(parts)
    if op == "avg":
        return (np.add.reduce(parts) / len(parts)).astype(parts[0].dtype)
    return _REDUCE[op].reduce(parts).astype(parts[0].dtype)


def _cases():
    for dtype in (F32, F64, I64, I32, B, C64):
        for op in ("sum", "avg", "max", "min", "prod"):
            if (dtype == B and op == "avg") or (dtype == C64 and op in ("max", "min")):
                continue
            yield dtype, op


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize(("dtype", "op"), list(_cases()))
def test_contributions_reduce_to_the_value(dtype, op, k):
    # NaN and inf in real floats (complex arithmetic turns inf * 1 into inf + nan j)
    for special in (False, True) if dtype.kind == "f" else (False,):
        value = _value(dtype, special=special)
        parts = partial_contributions(value, op, k, np.random.default_rng(k))
        assert len(parts) == k
        for p in parts:
            assert p.shape == value.shape and p.dtype == value.dtype
        got = _reduce(op, parts)
        if dtype.kind in "fc":  # sum/avg: up to rounding; NaN and inf where they were
            tol = 1e-5 if dtype in (F32, C64) else 1e-12
            np.testing.assert_allclose(got, value, rtol=tol, atol=tol * 10, equal_nan=True)
            assert np.array_equal(np.isnan(got), np.isnan(value))
            assert np.array_equal(got[np.isinf(value)], value[np.isinf(value)])
            for p in parts if op != "prod" else parts[:1]:  # every addend holds them
                np.testing.assert_array_equal(p[~np.isfinite(value)], value[~np.isfinite(value)])
        else:
            np.testing.assert_array_equal(got, value)


@pytest.mark.parametrize(("dtype", "op"), [c for c in _cases() if c[1] != "prod"])
def test_contributions_differ_between_coordinates(dtype, op):
    value = _value(dtype)
    for k in (2, 3, 4):
        parts = partial_contributions(value, op, k, np.random.default_rng(0))
        for a, b in itertools.combinations(parts, 2):
            assert not np.array_equal(a, b), (dtype, op, k)
        # no contribution is the value itself (a Partial that could pass for a Replicate)
        assert not any(np.array_equal(p, value) for p in parts), (dtype, op, k)


def test_max_min_contributions_bound_the_value():
    value = _value(F32, special=True)
    finite = np.isfinite(value)
    for op, cmp in (("max", np.less_equal), ("min", np.greater_equal)):
        parts = partial_contributions(value, op, 3, np.random.default_rng(1))
        for p in parts:
            assert cmp(p[finite], value[finite]).all()
        held = sum((p == value).astype(int) for p in parts)
        assert (held[finite] >= 1).all()  # each element is held by some contribution


def test_contributions_are_deterministic_per_generator():
    value = _value(F32)
    a = partial_contributions(value, "sum", 3, np.random.default_rng(7))
    b = partial_contributions(value, "sum", 3, np.random.default_rng(7))
    c = partial_contributions(value, "sum", 3, np.random.default_rng(8))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


# -- blocks ----------------------------------------------------------------------------------------
def _stitch(blk: dict, value: np.ndarray, mesh_shape: tuple, placements: tuple) -> np.ndarray:
    """The global array ``blk`` holds: per combination of Partial coordinates the shards put
    together (replicas must agree), then the Partial mesh dims reduced, innermost first."""
    pdims = [m for m, p in enumerate(placements) if p.is_partial()]
    plain = tuple(Replicate() if p.is_partial() else p for p in placements)
    parts: dict[tuple, np.ndarray] = {}
    seen: dict[tuple, np.ndarray] = {}
    for coord in np.ndindex(*mesh_shape):
        key = tuple(coord[m] for m in pdims)
        sl = local_slices(value.shape, mesh_shape, plain, coord)
        block = blk[coord]
        assert block.shape == value[sl].shape and block.dtype == value.dtype
        assert block.flags.c_contiguous and not np.shares_memory(block, value)
        out = parts.setdefault(key, np.zeros(value.shape, value.dtype))
        mask = seen.setdefault(key, np.zeros(value.shape, bool))
        if mask[sl].any():  # a replica: the values of the first holder
            np.testing.assert_array_equal(out[sl], block)
        out[sl] = block
        mask[sl] = True
    assert all(m.all() for m in seen.values()), "the blocks do not cover the value"
    for i in reversed(range(len(pdims))):  # the innermost Partial mesh dim first
        grouped: dict[tuple, list] = {}
        for key, arr in sorted(parts.items()):
            grouped.setdefault(key[:i], []).append(arr)
        parts = {k: _reduce(placements[pdims[i]].reduce_op, v) for k, v in grouped.items()}
    return parts[()]


def _placement_combos(mesh_shape):
    per_dim = [Replicate(), Shard(0), Shard(1), Partial("sum"), Partial("avg"), Partial("max"),
               Partial("min")]
    return itertools.product(per_dim, repeat=len(mesh_shape))


@pytest.mark.parametrize("mesh_shape", [(2,), (3,), (2, 2)])
@pytest.mark.parametrize("dtype", [F32, I64, B])
def test_blocks_tile_the_value(mesh_shape, dtype):
    value = _value(dtype, shape=(5, 2))  # dim 1 smaller than a mesh dim of 3: empty shards
    for placements in _placement_combos(mesh_shape):
        if dtype == B and Partial("avg") in placements:
            with pytest.raises(ArgumentError, match="avg"):
                blocks(value, mesh_shape, placements, np.random.default_rng(0))
            continue
        blk = blocks(value, mesh_shape, placements, np.random.default_rng(0))
        assert set(blk) == set(np.ndindex(*mesh_shape))
        got = _stitch(blk, value, mesh_shape, placements)
        if dtype.kind == "f":
            np.testing.assert_allclose(got, value, rtol=1e-5, atol=1e-5)
        else:
            np.testing.assert_array_equal(got, value)
        if any(p.is_partial() for p in placements):  # real contributions, not copies
            assert any(not np.array_equal(b, value[local_slices(
                value.shape, mesh_shape, tuple(Replicate() if p.is_partial() else p
                                               for p in placements), c)])
                for c, b in blk.items()), placements


def test_blocks_are_the_same_for_the_same_seed():
    value = _value(F32)
    pl = (Partial("sum"), Shard(1))
    a = blocks(value, (2, 2), pl, np.random.default_rng(3))
    b = blocks(value, (2, 2), pl, np.random.default_rng(3))
    assert all(np.array_equal(a[c], b[c]) for c in a)


# -- distribute_random -------------------------------------------------------------------------------
def test_distribute_random_keeps_this_ranks_block():
    mesh = dt.init_device_mesh((1,))
    value = _value(F32)
    for pl in ([Replicate()], [Shard(0)], [Partial("max")]):
        x = distribute_random(value, mesh, pl, seed=5)
        assert isinstance(x, dt.DTensor) and x.placements == tuple(pl)
        assert x.shape == value.shape and x.dtype == value.dtype
        want = blocks(value, (1,), pl, np.random.default_rng(5))[(0,)]
        np.testing.assert_array_equal(x.to_local().numpy(), want)
        np.testing.assert_array_equal(x.full_tensor().numpy(), value)


# -- errors ------------------------------------------------------------------------------------------
def test_errors_name_the_problem():
    rng = np.random.default_rng(0)
    with pytest.raises(ArgumentError, match="partial_contributions: unknown reduce op 'mean'"):
        partial_contributions(_value(F32), "mean", 2, rng)
    with pytest.raises(ArgumentError, match="partial_contributions: k must be at least 1, got 0"):
        partial_contributions(_value(F32), "sum", 0, rng)
    with pytest.raises(ArgumentError, match=r"partial_contributions: P\(avg\) of a bool array"):
        partial_contributions(_value(B), "avg", 2, rng)
    mesh = dt.init_device_mesh((1,))
    with pytest.raises(ArgumentError, match=r"distribute_random: \[R, R\] has 2 placements for "
                                            r"a 1-D mesh \(1,\)"):
        distribute_random(_value(F32), mesh, [Replicate(), Replicate()])


def test_distribute_random_outside_the_mesh_is_named():
    class Outside:  # a mesh this process is not part of
        ndim = 1
        shape = (2,)

        def get_coordinate(self):
            return None

    with pytest.raises(ArgumentError, match=r"distribute_random: this rank is not in the mesh "
                                            r"\(2,\)"):
        distribute_random(_value(F32), Outside(), [Replicate()])  # type: ignore[arg-type]
