"""Redistribute planner, cost model and explain output.

The planner is checked with a pure NumPy simulator: every mesh coordinate's local array lives
in one dict, each plan step is applied with its documented semantics, and the result (and
every intermediate state) must be the layout of the global data under the step's placements.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import re
import secrets

import numpy as np
import pytest

from placements import (
    DTensorSpec,
    MeshShape,
    Partial,
    Replicate,
    Shard,
    local_slices,
    shard_range,
)
from placements.errors import DTensorError, PlacementError
from redistribute import (
    AllGather,
    AllReduce,
    AllToAll,
    CostModel,
    LocalChunk,
    PartitionPartial,
    ReduceScatter,
    explain_plan,
    plan,
    plan_cost,
    redistribute_cost,
    set_default_cost_model,
    step_bytes,
    step_cost,
)
from redistribute.cost import default_cost_model
from redistribute.plan import _search

pytestmark = pytest.mark.mode_independent  # see tests/conftest.py

R = Replicate()
S0, S1 = Shard(0), Shard(1)
PSUM, PMAX, PAVG, PMIN, PPROD = (Partial(op) for op in ("sum", "max", "avg", "min", "prod"))

# ---------------------------------------------------------------------------------------------
# The simulator


def _reduce(arrays: list[np.ndarray], op: str) -> np.ndarray:
    stack = np.stack(arrays)
    if op == "sum":
        return stack.sum(0)
    if op == "avg":
        return stack.sum(0) / len(arrays)
    if op == "max":
        return stack.max(0)
    if op == "min":
        return stack.min(0)
    return stack.prod(0)


def _chunk(a: np.ndarray, dim: int, k: int, i: int) -> np.ndarray:
    start, length = shard_range(a.shape[dim], k, i)
    index = [slice(None)] * a.ndim
    index[dim] = slice(start, start + length)
    return a[tuple(index)]


def _split_partial(value: np.ndarray, k: int, op: str, rng: np.random.Generator) -> list:
    """k integer-valued contributions whose reduction by ``op`` is exactly ``value``."""
    if op in ("sum", "avg"):
        parts = [rng.integers(-5, 6, value.shape).astype(value.dtype) for _ in range(k - 1)]
        total = value * (k if op == "avg" else 1)
        return parts + [total - sum(parts, np.zeros_like(value))]
    if op == "prod":
        signs = [rng.choice([-1.0, 1.0], value.shape) for _ in range(k - 1)]
        return signs + [value * np.prod(signs, axis=0)] if signs else [value]
    holder = rng.integers(0, k, value.shape)
    step = -1 if op == "max" else 1
    return [
        np.where(holder == i, value, value + step * rng.integers(1, 4, value.shape))
        for i in range(k)
    ]


def distribute(glob, mesh_shape, placements, rng) -> dict:
    """Local arrays of every coordinate: mesh dim 0 distributes the global value first, and
    each mesh dim distributes what the previous ones left to its sub-mesh."""
    out = {}

    def rec(value, m, prefix):
        if m == len(mesh_shape):
            out[prefix] = value
            return
        p, k = placements[m], mesh_shape[m]
        if p.is_shard():
            pieces = [_chunk(value, p.dim, k, i) for i in range(k)]
        elif p.is_replicate():
            pieces = [value] * k
        else:
            pieces = _split_partial(value, k, p.reduce_op, rng)
        for i, piece in enumerate(pieces):
            rec(piece, m + 1, prefix + (i,))

    rec(glob, 0, ())
    return out


def assemble(local, mesh_shape, placements) -> np.ndarray:
    """The global value the local arrays represent (inverse of :func:`distribute`); checks that
    Replicate mesh dims hold equal values."""

    def rec(m, prefix):
        if m == len(mesh_shape):
            return local[prefix]
        subs = [rec(m + 1, prefix + (i,)) for i in range(mesh_shape[m])]
        p = placements[m]
        if p.is_shard():
            return np.concatenate(subs, axis=p.dim)
        if p.is_replicate():
            assert all(np.array_equal(s, subs[0]) for s in subs[1:]), placements
            return subs[0]
        return _reduce(subs, p.reduce_op)

    return rec(0, ())


def _sim_all_gather(arrays, step, k):
    return [np.concatenate(arrays, axis=step.tensor_dim)] * k


def _sim_reduce_scatter(arrays, step, k):
    full = _reduce(arrays, step.reduce_op)
    return [_chunk(full, step.tensor_dim, k, i) for i in range(k)]


def _sim_all_reduce(arrays, step, k):
    return [_reduce(arrays, step.reduce_op)] * k


def _sim_all_to_all(arrays, step, k):
    full = np.concatenate(arrays, axis=step.src_dim)
    return [_chunk(full, step.dst_dim, k, i) for i in range(k)]


def _sim_local_chunk(arrays, step, k):
    return [_chunk(a, step.tensor_dim, k, i) for i, a in enumerate(arrays)]


def _sim_partition(arrays, step, k):
    fill = {"sum": 0.0, "prod": 1.0}.get(step.reduce_op)
    if fill is None:
        return list(arrays)
    return [a if i == 0 else np.full_like(a, fill) for i, a in enumerate(arrays)]


_SIM = {
    "all_gather": _sim_all_gather,
    "reduce_scatter": _sim_reduce_scatter,
    "all_reduce": _sim_all_reduce,
    "all_to_all": _sim_all_to_all,
    "local_chunk": _sim_local_chunk,
    "partition_partial": _sim_partition,
}


def apply_step(local: dict, step, mesh_shape) -> dict:
    """Apply one step to every group of the step's mesh dim (coords in increasing order)."""
    m, k = step.mesh_dim, mesh_shape[step.mesh_dim]
    out = {}
    for coord in local:
        if coord[m]:
            continue
        members = [coord[:m] + (i,) + coord[m + 1 :] for i in range(k)]
        for c, a in zip(members, _SIM[step.kind]([local[c] for c in members], step, k)):
            out[c] = a
    return out


@functools.cache
def _target_slices(shape, mesh_shape, placements) -> dict:
    return {
        coord: local_slices(shape, mesh_shape, placements, coord)
        for coord in itertools.product(*map(range, mesh_shape))
    }


def check_layout(local, glob, mesh_shape, placements):
    """``local`` is a valid layout of ``glob`` under ``placements``: every coordinate holds a
    block of the layout's shape; without Partial it is exactly the layout's slice of the
    global data, with Partial the blocks reduce back to the global data."""
    partial = any(p.is_partial() for p in placements)
    for coord, index in _target_slices(glob.shape, mesh_shape, tuple(placements)).items():
        expected = glob[index]
        assert local[coord].shape == expected.shape, (coord, placements)
        assert partial or np.array_equal(local[coord], expected), (coord, placements)
    if partial:
        assert np.array_equal(assemble(local, mesh_shape, placements), glob), placements


def simulate(glob, mesh_shape, src, dst, rng, local=None):
    """Plan src -> dst, run it in the simulator, check every state; return the steps."""
    spec = DTensorSpec(MeshShape(mesh_shape), src, glob.shape, glob.dtype)
    steps = plan(spec, dst)
    if local is None:
        local = distribute(glob, mesh_shape, spec.placements, rng)
    current = spec.placements
    for step in steps:
        assert step.before == current
        assert all(
            (a == b) == (m != step.mesh_dim)
            for m, (a, b) in enumerate(zip(step.before, step.after))
        ), step
        local = apply_step(local, step, mesh_shape)
        check_layout(local, glob, mesh_shape, step.after)
        current = step.after
    assert current == spec.with_placements(dst).placements
    return steps


# ---------------------------------------------------------------------------------------------
# Every source/target pair

OPTIONS = [S0, S1, R, PSUM, PMAX, PAVG]
SHAPES = [(8, 8), (6, 5), (3, 1)]  # even; uneven; empty shards (3 rows over 4, 1 column)


def _every_pair(mesh_shape, shapes, seed, targets_per_source=None):
    """Simulate every (source, target) pair of OPTIONS placements; pair i uses shape
    ``shapes[i % len(shapes)]``. With ``targets_per_source``, every source runs against
    that many targets drawn with ``seed``."""
    rng = np.random.default_rng(seed)
    globs = [rng.integers(-9, 10, shape).astype(np.float64) for shape in shapes]
    all_placements = list(itertools.product(OPTIONS, repeat=len(mesh_shape)))
    for i, src in enumerate(all_placements):
        sources = [distribute(glob, mesh_shape, src, rng) for glob in globs]
        for glob, local in zip(globs, sources):
            check_layout(local, glob, mesh_shape, src)
        targets = range(len(all_placements))
        if targets_per_source is not None:
            targets = sorted(rng.choice(len(all_placements), targets_per_source, replace=False))
        for j in targets:
            n = (i + j) % len(globs)
            simulate(globs[n], mesh_shape, src, all_placements[j], rng, local=sources[n])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_every_pair_simulates_to_target_layout(mesh_shape, shape):
    _every_pair(mesh_shape, [shape], seed=0)


def test_every_source_on_a_2x2x2_mesh_simulates_to_target_layouts():
    # 216 x 216 pairs: every source runs against 40 targets drawn per session (all 216 with
    # HYPOTHESIS_PROFILE=long), the shapes taking turns; DTENSOR_TEST_SEED repeats a draw.
    seed = int(os.environ.get("DTENSOR_TEST_SEED", secrets.randbits(32)))
    per_source = None if os.environ.get("HYPOTHESIS_PROFILE") == "long" else 40
    try:
        _every_pair((2, 2, 2), SHAPES, seed=seed, targets_per_source=per_source)
    except AssertionError as e:
        raise AssertionError(f"reproduce with DTENSOR_TEST_SEED={seed}") from e


@pytest.mark.parametrize("mesh_shape", [(3,), (2, 3), (3, 2)])
def test_pairs_with_min_prod_and_odd_meshes(mesh_shape):
    rng = np.random.default_rng(1)
    glob = rng.integers(1, 4, (5, 7)).astype(np.float64)
    options = [S0, S1, R, PSUM, PMIN, PPROD]
    all_placements = list(itertools.product(options, repeat=len(mesh_shape)))
    for src in all_placements:
        local = distribute(glob, mesh_shape, src, rng)
        for dst in all_placements:
            simulate(glob, mesh_shape, src, dst, rng, local=local)


def test_prod_partition_below_a_partial_sum_reduces_that_sum_first():
    # The ones that non-holders of a prod partition hold would be summed by P(sum) on mesh
    # dim 1, so the plan must reduce mesh dim 1 before partitioning mesh dim 0.
    rng = np.random.default_rng(2)
    glob = rng.integers(1, 5, (4, 4)).astype(np.float64)
    steps = simulate(glob, (2, 2), [R, PSUM], [PPROD, PSUM], rng)
    assert [s.kind for s in steps] == ["all_reduce", "partition_partial", "partition_partial"]
    assert [s.mesh_dim for s in steps] == [1, 0, 1]


def test_mixed_partials_reduce_from_the_highest_mesh_dim():
    rng = np.random.default_rng(3)
    glob = rng.integers(-9, 10, (4, 6)).astype(np.float64)
    steps = simulate(glob, (2, 2), [PSUM, PMAX], [R, R], rng)
    assert [(s.kind, s.mesh_dim, s.reduce_op) for s in steps] == [
        ("all_reduce", 1, "max"),
        ("all_reduce", 0, "sum"),
    ]
    # sum and avg commute, so either order is valid; the cheaper/first one is taken.
    steps = simulate(glob, (2, 2), [PSUM, PAVG], [R, R], rng)
    assert sorted(s.mesh_dim for s in steps) == [0, 1]


# ---------------------------------------------------------------------------------------------
# Shape of plans


def _spec(mesh_shape, placements, shape=(8, 6), dtype=np.float32):
    return DTensorSpec(MeshShape(mesh_shape), placements, shape, dtype)


@pytest.mark.parametrize(
    ("src", "dst", "expected"),
    [
        ([S0], [R], AllGather(mesh_dim=0, before=(S0,), after=(R,), tensor_dim=0)),
        ([R], [S0], LocalChunk(mesh_dim=0, before=(R,), after=(S0,), tensor_dim=0)),
        ([S0], [S1], AllToAll(mesh_dim=0, before=(S0,), after=(S1,), src_dim=0, dst_dim=1)),
        (
            [PSUM],
            [S0],
            ReduceScatter(mesh_dim=0, before=(PSUM,), after=(S0,), tensor_dim=0, reduce_op="sum"),
        ),
        ([PAVG], [R], AllReduce(mesh_dim=0, before=(PAVG,), after=(R,), reduce_op="avg")),
        ([R], [PMAX], PartitionPartial(mesh_dim=0, before=(R,), after=(PMAX,), reduce_op="max")),
    ],
)
def test_simple_plans_are_single_steps(src, dst, expected):
    assert plan(_spec((4,), src), dst) == (expected,)


def test_indirect_transitions_go_through_replicate():
    assert [s.kind for s in plan(_spec((4,), [S1]), [PSUM])] == ["all_gather", "partition_partial"]
    assert [s.kind for s in plan(_spec((4,), [PSUM]), [PMAX])] == [
        "all_reduce",
        "partition_partial",
    ]


def test_nested_shard_is_gathered_from_the_highest_mesh_dim():
    steps = plan(_spec((2, 2), [S0, S0]), [R, S0])
    assert [(type(s), s.mesh_dim) for s in steps] == [
        (AllGather, 1),
        (AllGather, 0),
        (LocalChunk, 1),
    ]
    assert steps[0].before == (S0, S0) and steps[-1].after == (R, S0)


def test_plans_never_gather_more_than_the_target_needs():
    # Only mesh dim 1 changes: one gather on it, nothing on mesh dim 0.
    assert [(s.kind, s.mesh_dim) for s in plan(_spec((2, 2), [S0, S0]), [S0, R])] == [
        ("all_gather", 1)
    ]
    # Chunk first (free), then gather the smaller block.
    steps = plan(_spec((2, 2), [S0, R]), [R, S1])
    assert [(s.kind, s.mesh_dim) for s in steps] == [("local_chunk", 1), ("all_gather", 0)]
    # Reduce-scatter instead of all-reduce + chunk.
    steps = plan(_spec((2, 2), [PSUM, S1]), [S0, S1])
    assert [s.kind for s in steps] == ["reduce_scatter"]


def test_plans_are_deterministic_and_cached():
    spec = _spec((2, 2, 2), [S0, PSUM, S0], shape=(7, 5))
    dst = [S1, S0, R]
    first = plan(spec, dst)
    assert plan(spec, dst) is first  # cached
    _search.cache_clear()
    again = plan(_spec((2, 2, 2), [S0, PSUM, S0], shape=(7, 5)), [S1, S0, R])
    assert again == first and again is not first


def test_negative_target_dims_and_placement_errors():
    spec = _spec((2, 2), [S0, R])
    assert plan(spec, [R, Shard(-1)]) == plan(spec, [R, S1])
    assert plan(spec, [S0, R]) == ()
    with pytest.raises(PlacementError, match=r"Shard\(dim=2\) is out of range"):
        plan(spec, [R, Shard(2)])
    with pytest.raises(PlacementError, match="need one per mesh dim"):
        plan(spec, [R])


def test_steps_are_frozen_and_hashable():
    step = plan(_spec((4,), [S0]), [R])[0]
    with pytest.raises(AttributeError):
        step.mesh_dim = 1
    assert hash(step) == hash(AllGather(mesh_dim=0, before=(S0,), after=(R,), tensor_dim=0))
    assert step.communicates and not LocalChunk.communicates and not PartitionPartial.communicates


# ---------------------------------------------------------------------------------------------
# Cost model


def test_step_bytes_follow_the_standard_formulas():
    spec = _spec((4,), [S0], shape=(8, 6), dtype=np.float32)  # 192 B global, 48 B per shard
    gather, = plan(spec, [R])
    assert step_bytes(gather, spec) == 3 * 192 // 4
    a2a, = plan(spec, [S1])  # (8, 2) after, 8*2*4 = 64 B > 48 B before
    assert step_bytes(a2a, spec) == 3 * 64 // 4
    spec_p = _spec((4,), [PSUM], shape=(8, 6), dtype=np.float64)
    all_reduce, = plan(spec_p, [R])
    assert step_bytes(all_reduce, spec_p) == 2 * 3 * 384 // 4
    reduce_scatter, = plan(spec_p, [S0])
    assert step_bytes(reduce_scatter, spec_p) == 3 * 384 // 4
    chunk, = plan(_spec((4,), [R]), [S0])
    assert step_bytes(chunk, spec) == 0


def test_step_bytes_use_the_largest_shard():
    spec = _spec((4,), [R], shape=(5, 3), dtype=np.int64)  # S(0): rows 2, 2, 1, 0
    gather, = plan(_spec((4,), [S0], shape=(5, 3), dtype=np.int64), [R])
    assert step_bytes(gather, spec) == round(3 / 4 * 5 * 3 * 8)
    # nested: S(0),S(0) on (2, 2) over 5 rows -> largest block is 2 rows; gather mesh dim 1
    nested = _spec((2, 2), [S0, S0], shape=(5, 3), dtype=np.int64)
    first = plan(nested, [S0, R])[0]
    assert step_bytes(first, nested) == round(1 / 2 * 3 * 3 * 8)


def test_step_cost_is_alpha_plus_bytes_over_beta():
    model = CostModel(1e-5, 1e9, local_s=2e-7)
    spec = _spec((4,), [S0])
    gather, = plan(spec, [R], model)
    assert step_cost(gather, spec, model) == pytest.approx(1e-5 + step_bytes(gather, spec) / 1e9)
    chunk, = plan(_spec((4,), [R]), [S0], model)
    assert step_cost(chunk, spec, model) == 2e-7
    nested = _spec((2, 2), [S0, S0])
    steps = plan(nested, [R, S0], model)
    total = plan_cost(steps, nested, model)
    assert total == pytest.approx(sum(step_cost(s, nested, model) for s in steps))
    assert redistribute_cost(nested, [R, S0], model) == pytest.approx(total)
    assert redistribute_cost(spec, [S0], model) == 0.0
    # a mesh dim of size 1 moves nothing
    one = _spec((1, 4), [S0, R])
    gather1, = plan(one, [R, R], model)
    assert step_cost(gather1, one, model) == 2e-7


def test_cost_model_overrides_per_kind_and_mesh_dim():
    model = CostModel(
        1e-6,
        1e10,
        per_kind={"all_gather": {"alpha_s": 2e-6}},
        per_mesh_dim={1: {"default": {"beta_bytes_per_s": 1e9}, "all_reduce": {"alpha_s": 9e-6}}},
    )
    assert model.params("all_gather", 0) == (2e-6, 1e10)
    assert model.params("all_gather", 1) == (2e-6, 1e9)
    assert model.params("all_reduce", 1) == (9e-6, 1e9)
    assert model.params("all_to_all", 0) == (1e-6, 1e10)
    assert model.params("all_to_all") == (1e-6, 1e10)
    assert CostModel.from_dict(json.loads(json.dumps(model.to_dict()))) == model
    assert hash(CostModel.from_dict(model.to_dict())) == hash(model)
    with pytest.raises(DTensorError, match="unknown collective kind 'gather'"):
        CostModel(per_kind={"gather": {"alpha_s": 1.0}})
    with pytest.raises(DTensorError, match="beta_bytes_per_s=0"):
        CostModel(1e-6, 0)
    with pytest.raises(DTensorError, match=r"unknown key\(s\) \['alpha'\]"):
        CostModel.from_dict({"alpha": 1.0})


def test_cost_model_changes_the_chosen_plan():
    spec = _spec((4,), [S0])
    slow_a2a = CostModel(per_kind={"all_to_all": {"alpha_s": 1.0}})
    assert [s.kind for s in plan(spec, [S1])] == ["all_to_all"]
    assert [s.kind for s in plan(spec, [S1], slow_a2a)] == ["all_gather", "local_chunk"]


def test_default_cost_model_from_env_file_and_inline(tmp_path, monkeypatch):
    path = tmp_path / "cost.json"
    saved = CostModel(3e-6, 7e9, per_kind={"all_reduce": {"alpha_s": 4e-6}})
    saved.save(path)
    try:
        monkeypatch.setenv("DTENSOR_COST_MODEL", str(path))
        set_default_cost_model(None)
        assert default_cost_model() == saved
        monkeypatch.setenv("DTENSOR_COST_MODEL", '{"alpha_s": 1e-6}')
        set_default_cost_model(None)
        assert default_cost_model() == CostModel(1e-6)
        monkeypatch.setenv("DTENSOR_COST_MODEL", str(tmp_path / "missing.json"))
        set_default_cost_model(None)
        with pytest.raises(DTensorError, match=r"missing\.json"):
            default_cost_model()
        monkeypatch.delenv("DTENSOR_COST_MODEL")
        set_default_cost_model(None)
        assert default_cost_model() == CostModel()
        assert (CostModel().alpha_s, CostModel().beta_bytes_per_s) == (5e-6, 5e9)
    finally:
        set_default_cost_model(None)


# ---------------------------------------------------------------------------------------------
# explain


def test_explain_one_line_per_step_and_a_total():
    model = CostModel(5e-6, 5e9)
    spec = _spec((2, 2), [S0, R], shape=(1024, 1024), dtype=np.float32)  # 4 MiB global
    text = explain_plan(spec, [R, R], model)
    assert text.splitlines() == [
        "S(0),R -> R,R: all_gather(mesh dim 0, tensor dim 0, 4.0 MiB, ~0.42 ms)",
        "total: 1 step, 4.0 MiB, ~0.42 ms",
    ]
    lines = explain_plan(_spec((2, 2), [S0, S0]), [R, S0], model).splitlines()
    assert len(lines) == 4
    assert re.fullmatch(r"S\(0\),S\(0\) -> S\(0\),R: all_gather\(mesh dim 1, tensor dim 0, "
                        r"96 B, ~5\.0 us\)", lines[0])
    assert lines[2] == "R,R -> R,S(0): local_chunk(mesh dim 1, tensor dim 0, no communication)"
    assert lines[3] == "total: 3 steps, 288 B, ~10.1 us"


def test_explain_other_kinds_and_empty_plan():
    model = CostModel()
    assert explain_plan(_spec((2,), [S0]), [Shard(-2)], model) == "S(0) -> S(0): no communication"
    text = explain_plan(_spec((2,), [PSUM]), [S1], model)
    assert text.startswith("P(sum) -> S(1): reduce_scatter(mesh dim 0, tensor dim 1, sum, 192 B")
    text = explain_plan(_spec((2,), [S0]), [S1], model)
    assert text.startswith("S(0) -> S(1): all_to_all(mesh dim 0, tensor dim 0 -> 1, ")
    text = explain_plan(_spec((2,), [PMAX]), [PAVG], model).splitlines()
    assert text[0].startswith("P(max) -> R: all_reduce(mesh dim 0, max, ")
    assert text[1] == "R -> P(avg): partition_partial(mesh dim 0, avg, no communication)"
