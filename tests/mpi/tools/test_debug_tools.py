"""dt.debug tools under MPI: CommDebugMode on known programs, ``explain`` agreeing with
what CommDebugMode then records, strict mode, and the tap they share restoring the
dispatcher (fast path included) when done.

Run: ``mpiexec -n K python -m pytest tests/mpi/tools/test_debug_tools.py --with-mpi`` (K = 1..4).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from helpers.mpi import data, dist, meshes
from mpi4py import MPI

import dtensor as dt
from dtensor.debug import ImplicitRedistributeError, explain, no_implicit_redistribute
from dtensor.dispatch import dispatcher as _dispatch
from placements.errors import ShardingError

WORLD = MPI.COMM_WORLD
R, S, P = dt.Replicate(), dt.Shard, dt.Partial
F4 = 4  # bytes per float32


def fast_modes():
    """The dispatch paths to test in: the current one, and the other when available."""
    set_fp = getattr(dt.debug, "set_fastpath", None)
    return [None] if set_fp is None else [True, False]


def in_mode(mode):
    if mode is not None:
        try:
            dt.debug.set_fastpath(mode)
        except RuntimeError:
            pytest.skip("the compiled fast path is not available")


@pytest.fixture(autouse=True)
def _restore_fastpath():
    status = getattr(dt.debug, "fastpath_status", None)
    before = status()["active"] if status is not None else None
    yield
    assert not _dispatch._listeners, "a debugging tool left its listener installed"
    if before is not None:
        dt.debug.set_fastpath(before)


def observed(mode, dispatched_only=False):
    """Multiset of (op, kind, mesh dim) of the recorded collectives."""
    return Counter(
        (r.op, r.kind, r.mesh_dim)
        for r in mode.records
        if not dispatched_only or r.op != "redistribute"
    )


def predicted(expl):
    return Counter((c.op, c.kind, c.mesh_dim) for c in expl.collectives())


# --- CommDebugMode on known programs -------------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_comm_mode_counts_and_bytes_of_known_redistributes():
    n = WORLD.size
    mesh = dt.init_device_mesh((n,))
    a = data((8, 4))
    x = dist(a, mesh, [S(0)])
    with dt.debug.CommDebugMode() as mode:
        x.redistribute(mesh, [R])  # all-gather: this rank ends with the whole (8, 4)
    assert mode.get_comm_counts() == {"all_gather": 1}
    assert mode.records[0].mesh_dim == 0 and mode.records[0].op == "redistribute"
    assert mode.get_total_bytes() == 8 * 4 * F4
    p = dt.DTensor.from_local(dt.from_numpy(a), mesh, [P("sum")])
    with dt.debug.CommDebugMode() as mode:
        y = p.redistribute(mesh, [R])  # all-reduce of this rank's (8, 4) block
    assert mode.get_comm_counts() == {"all_reduce": 1}
    assert mode.get_total_bytes() == 8 * 4 * F4
    np.testing.assert_allclose(y.to_local().numpy(), a * n, rtol=1e-6)
    import json

    doc = json.loads(mode.to_json())
    assert doc["total_counts"] == 1 and doc["by_op"] == {"redistribute": {"all_reduce": 1}}


@pytest.mark.mpi(min_size=2)
def test_comm_mode_attributes_collectives_to_the_op():
    mesh = dt.init_device_mesh((WORLD.size,))
    x = dist(data((6, 8)), mesh, [S(1)])
    w = dist(data((8, 3), 1), mesh, [R])
    with dt.debug.CommDebugMode() as mode:
        y = (x @ w).relu()  # matmul gives P(sum); relu forces its reduction
    counts = mode.get_comm_counts_by_op()
    assert set(counts) == {"relu"} and sum(counts["relu"].values()) == 1
    assert y.placements[0] != P("sum")


# --- explain agrees with CommDebugMode -----------------------------------------------------

CASES = [
    # (name, op, argument placements per mesh ndim, shapes)
    ("matmul S(1) @ R", "matmul", {1: ([S(1)], [R]), 2: ([S(0), S(1)], [R, R])}),
    ("matmul S(0) @ S(0)", "matmul", {1: ([S(0)], [S(0)]), 2: ([S(0), S(0)], [S(0), R])}),
    ("add S(0) + S(1)", "add", {1: ([S(0)], [S(1)]), 2: ([S(0), R], [S(1), S(0)])}),
    ("sum P(sum)", "sum", {1: ([P("sum")],), 2: ([P("sum"), S(0)],)}),
    ("softmax over the sharded dim", "softmax", {1: ([S(1)],), 2: ([S(1), S(0)],)}),
]
SHAPES = {"matmul": [(6, 8), (8, 5)], "add": [(6, 8), (6, 8)], "sum": [(6, 8)], "softmax": [(6, 8)]}
KWARGS = {"softmax": {"dim": 1}, "sum": {"dim": 0}}


def _args(op, placements, mesh):
    out = []
    for i, (shape, pl) in enumerate(zip(SHAPES[op], placements)):
        a = data(shape, i)
        if any(p.is_partial() for p in pl):
            out.append(dt.DTensor.from_local(dt.from_numpy(a), mesh, pl))
        else:
            out.append(dist(a, mesh, pl))
    return out


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("fast", fast_modes())
@pytest.mark.parametrize(("name", "op", "layouts"), CASES, ids=[c[0] for c in CASES])
def test_explain_op_predicts_what_runs(fast, name, op, layouts):
    in_mode(fast)
    fn = getattr(dt, op)
    for mesh in meshes():
        args = _args(op, layouts[mesh.ndim], mesh)
        kwargs = KWARGS.get(op, {})
        stats = dt.debug.prop_cache_stats()
        with dt.debug.CommDebugMode() as quiet:
            expl = explain(fn, *args, **kwargs)
        assert quiet.get_total_counts() == 0  # explaining an op communicates nothing
        assert dt.debug.prop_cache_stats() == stats  # ... and leaves the cache alone
        with dt.debug.CommDebugMode() as mode:
            out = fn(*args, **kwargs)
        if mesh.size() > 1:  # on one rank the executor may still call a 1-rank collective
            assert observed(mode) == predicted(expl), f"{name}\n{expl}\n{mode.table()}"
            assert expl.comm_counts() == mode.get_comm_counts()
        (o,) = expl.ops
        assert o.op == op
        assert o.output_placements[0] == "[" + ", ".join(p.short() for p in out.placements) + "]"
        assert o.candidates and o.candidates[0][1] == pytest.approx(o.cost_s)
        assert all(
            o.candidates[i][1] <= o.candidates[i + 1][1] for i in range(len(o.candidates) - 1)
        )
        text = str(expl)
        assert text.startswith(f"{op}(") and "strategy:" in text
        # by name and as a bound method it is the same decision
        assert str(explain(op, *args, **kwargs)) == text
        assert str(explain(getattr(args[0], op), *args[1:], **kwargs)) == text


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("fast", fast_modes())
def test_explain_trace_of_a_function_matches_the_run(fast):
    in_mode(fast)

    def block(x, w1, w2):
        h = (x @ w1).relu()
        return (h @ w2).sum(dim=1)

    for mesh in meshes():
        rest = [R] * (mesh.ndim - 1)
        x = dist(data((8, 6)), mesh, [S(1), *rest])
        w1 = dist(data((6, 10), 1), mesh, [R, *rest])
        w2 = dist(data((10, 4), 2), mesh, [S(1), *rest])
        with dt.debug.CommDebugMode() as mode:
            expl = explain(block, x, w1, w2)
        assert expl.traced
        assert [o.op for o in expl.ops] == ["matmul", "relu", "matmul", "sum"]
        if mesh.size() > 1:
            assert predicted(expl) == observed(mode, dispatched_only=True), (
                f"{expl}\n{mode.table()}"
            )
        expected = (np.maximum(data((8, 6)) @ data((6, 10), 1), 0) @ data((10, 4), 2)).sum(1)
        got = expl.result.full_tensor().numpy()
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
        again = explain(block, x, w1, w2)
        assert all(o.cache == "hit" for o in again.ops)


@pytest.mark.mpi(min_size=1)
def test_explain_redistribute_matches_the_run():
    for mesh in meshes():
        a = data((7, 5))
        pairs = [([S(0)], [R]), ([S(0)], [S(1)]), ([R], [S(1)])]
        if mesh.ndim == 2:
            pairs = [([S(0), S(1)], [R, R]), ([S(0), R], [R, S(0)]), ([S(0), S(0)], [S(1), R])]
        for src, dst in pairs:
            x = dist(a, mesh, src)
            expl = explain(x, dst)
            with dt.debug.CommDebugMode() as mode:
                y = x.redistribute(mesh, dst)
            if mesh.size() > 1:
                assert observed(mode) == predicted(expl), f"{expl}\n{mode.table()}"
                if WORLD.rank == 0:  # coordinate 0 holds the largest block: bytes agree exactly
                    got = sorted(r.nbytes for r in mode.records)
                    want = sorted(c.nbytes for c in expl.collectives() if c.communicates)
                    assert got == want, f"{expl}\n{mode.table()}"
            assert expl.redistribute.splitlines()[-1].startswith(("total:", "R"))
            np.testing.assert_array_equal(y.full_tensor().numpy(), a)
    with pytest.raises(TypeError, match="exactly the target placements"):
        explain(x, dst, dst)


# --- strict mode ---------------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("fast", fast_modes())
def test_strict_mode_raises_on_implicit_moves_only(fast):
    in_mode(fast)
    mesh = dt.init_device_mesh((WORLD.size,))
    a, b = data((4, 6)), data((4, 6), 1)
    x0, y0, y1 = dist(a, mesh, [S(0)]), dist(b, mesh, [S(0)]), dist(b, mesh, [S(1)])
    for _ in range(2):  # once to fill the caches, once served from them
        x0 + y1
    with no_implicit_redistribute():
        with dt.debug.CommDebugMode() as mode:
            z = x0 + y0  # same placements: allowed
            with pytest.raises(ImplicitRedistributeError) as err:
                x0 + y1
            moved = y1.redistribute(mesh, [S(0)])  # explicit: allowed
            w = x0 + moved
        assert mode.get_comm_counts() == {"all_to_all": 1}  # only the explicit one ran
    msg = str(err.value)
    assert msg.startswith("add: input 1") and "from [S(1)] to [S(0)]" in msg
    assert "no_implicit_redistribute" in msg
    assert isinstance(err.value, ShardingError)
    np.testing.assert_allclose(w.full_tensor().numpy(), a + b, rtol=1e-6)
    np.testing.assert_allclose(z.full_tensor().numpy(), a + b, rtol=1e-6)
    np.testing.assert_allclose((x0 + y1).full_tensor().numpy(), a + b, rtol=1e-6)  # after


@pytest.mark.mpi(min_size=2)
def test_strict_mode_local_moves_and_reentry():
    mesh = dt.init_device_mesh((WORLD.size,))
    x = dist(data((6, 8)), mesh, [S(1)])
    w = dist(data((8, 3), 1), mesh, [R])  # x @ w chunks w locally (R -> S(0))
    match = r"matmul: input 1 .* from \[R\] to"
    with pytest.raises(ImplicitRedistributeError, match=match), no_implicit_redistribute():
        x @ w
    with no_implicit_redistribute(allow_local=True):
        y = x @ w
    assert y.placements == (P("sum"),)
    mode = no_implicit_redistribute()
    with mode, pytest.raises(RuntimeError, match="already active"), mode:
        pass
    assert _dispatch.run_entry.__module__ == "dtensor.dispatch.dispatcher"


@pytest.mark.mpi(min_size=1)
def test_explain_rejects_unknown_ops_and_objects():
    with pytest.raises(NotImplementedError, match="'matmull' is not an op.*closest is 'matmul'"):
        explain("matmull")
    with pytest.raises(TypeError, match="expected a DTensor, an op or a callable"):
        explain(42)
