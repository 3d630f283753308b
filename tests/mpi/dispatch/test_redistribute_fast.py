"""``DTensor.redistribute`` from compiled code against the Python method.

One-step plans run from compiled code (``fastpath._redist.redistribute_kinds`` counts
them by kind): small all-gathers (S(d) -> R at any dim: straight into the output or
staged and unpacked; persistent or not), all-reduces (P -> R), reduce-scatters (P ->
S(d)), all-to-alls (S(i) -> S(j), and gathers above the all-gather size) and local chunks
(R -> S(d)), uneven and empty shards included, and a gather over one dim of a 2-D mesh.
Every other plan, a non-contiguous local shard where the step communicates, and every call
while CommDebugMode (or another communication observer) is on, runs the Python method.
Both must give bytewise the same DTensors. An op's input moves of one step take the same
compiled forms.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import dtensor as dt
import fastpath
from dtensor.debug import CommDebugMode
from dtensor.errors import MeshError, PlacementError
from dtensor.testing import distribute_random
from redistribute import comm as rcomm

WORLD = MPI.COMM_WORLD
S, R, P = dt.Shard, dt.Replicate(), dt.Partial

needs_front = pytest.mark.skipif(
    not fastpath.ENABLED, reason="compiled fast path not enabled (not built or disabled)"
)

F32, F64, I32 = np.float32, np.float64, np.int32
# (global shape, dtype, source placements, target placements, kind run from compiled code
# at 2+ ranks, or None: the Python method; at one rank every plan of one step is local)
CASES = [
    ((8, 8), F32, [S(0)], [R], "gather"),
    ((5, 3), F32, [S(0)], [R], "gather"),  # uneven (Allgatherv) at 2-4 ranks, one empty at 4
    ((0, 4), F32, [S(0)], [R], "gather"),
    ((64, 64), F32, [S(0)], [R], "gather"),  # a 16 KiB output: pooled
    ((8, 6), F32, [S(1)], [R], "gather"),  # blocks not contiguous in the output: staged
    ((5, 7), F64, [S(1)], [R], "gather"),  # staged, uneven
    ((3, 2, 5), I32, [S(1)], [R], "gather"),  # a middle dim, empty blocks at 3-4 ranks
    ((256, 128), F32, [S(0)], [R], "all_to_all"),  # above the all-gather size
    ((6, 4), F32, [P("sum")], [R], "all_reduce"),
    ((5, 3), F64, [P("avg")], [R], "all_reduce"),
    ((0, 3), F32, [P("max")], [R], "all_reduce"),
    ((6, 4), F32, [P("sum")], [S(0)], "reduce_scatter"),  # even at 2-3, an empty shard at 4
    ((5, 6), I32, [P("sum")], [S(1)], "reduce_scatter"),  # packed, uneven at 4
    ((6, 4), F32, [R], [S(0)], "local"),
    ((6, 5), F32, [R], [S(1)], "local"),
    ((8, 6), F32, [S(0)], [S(1)], "all_to_all"),
    ((5, 7), F64, [S(1)], [S(0)], "all_to_all"),  # staged receives, uneven
    ((4, 3, 5), I32, [S(2)], [S(0)], "all_to_all"),  # packed sends, staged receives
    ((6, 4), F32, [R], [P("sum")], None),
    ((6, 4), F32, [S(0)], [S(0)], None),  # the same placements: the input itself
    ((512, 512), F32, [S(1)], [R], None),  # the shared-memory size: the Python method's path
]


def _describe(x):
    loc = x.to_local()
    return (tuple(x.shape), str(x.dtype), tuple(x.placements), tuple(loc.shape), loc.stride(),
            loc.numpy().tobytes())  # fmt: skip


def _source(shape, placements, mesh, dtype=np.float32):
    n = int(np.prod(shape))
    data = (np.arange(n, dtype=np.float64).reshape(shape) * 0.37 - 3).astype(dtype)
    if any(p.is_partial() for p in placements):
        return distribute_random(data, mesh, placements, seed=n), data
    return dt.distribute_tensor(data, mesh, placements), data


def _kinds():
    return dt.debug.fastpath_status()["fast_redistribute_kinds"]


def _moved():
    return dt.debug.fastpath_status()["fast_moved_ops"]


@pytest.fixture(autouse=True)
def _front_back_on():
    yield
    if fastpath.ENABLED:
        dt.debug.set_fastpath(True)


@needs_front
@pytest.mark.mpi(min_size=1)
def test_same_dtensors_as_the_python_method():
    mesh = dt.init_device_mesh((WORLD.size,))
    for shape, dtype, src, dst, kind in CASES:
        case = (shape, np.dtype(dtype).name, src, dst)
        x, data = _source(shape, src, mesh, dtype)
        xloc = x.to_local().numpy()
        dt.debug.set_fastpath(False)
        py = x.redistribute(mesh, dst)
        want = _describe(py)
        dt.debug.set_fastpath(True)
        if WORLD.size == 1 and src != dst and not any(p.is_partial() for p in dst):
            kind = "local"  # a collective over one rank moves nothing
        runs = [(False, kind)]
        if kind == "gather":
            runs.append((True, kind))  # persistent all-gathers (or the blocking fallback)
        for persistent, k in runs:
            prev = rcomm.set_persistent(persistent)
            try:
                before = _kinds()
                for _ in range(3):  # the first call fills the entry, the others hit it
                    y = x.redistribute(mesh, list(dst))
                    assert _describe(y) == want, case
                after = _kinds()
            finally:
                rcomm.set_persistent(prev)
            ran = {kd: after[kd] - before[kd] for kd in after if after[kd] != before[kd]}
            assert ran == ({} if k is None else {k: 3}), case
        out = y.to_local().numpy()
        # views and copies as in the Python method
        assert np.shares_memory(out, xloc) == np.shares_memory(py.to_local().numpy(), xloc), case
        if kind not in (None, "local"):
            assert not np.shares_memory(out, x.redistribute(mesh, dst).to_local().numpy()), case
        if not any(p.is_partial() for p in dst):  # contributions add up to data, rounded
            np.testing.assert_allclose(y.full_tensor().numpy(), data, rtol=1e-6, err_msg=str(case))


# (op, operands' global shapes and placements, the kinds its compiled move may take at 2+
# ranks (the strategy chosen depends on the rank count), or None: no move)
OP_MOVES = [
    (lambda a, b: a @ b, [((8, 6), [S(0)]), ((6, 4), [S(0)])], {"all_to_all", "gather"}),
    (lambda a, b: a + b, [((6, 4), [S(0)]), ((6, 4), [S(1)])], {"all_to_all", "gather"}),
    (lambda a: a.sum(dim=0), [((5, 4), [S(1)])], None),  # no move: runs locally
    (lambda a, b: a.matmul(b), [((4, 6), [R]), ((6, 5), [S(0)])], {"local"}),
]


@needs_front
@pytest.mark.mpi(min_size=1)
def test_an_ops_one_step_move_runs_from_compiled_code():
    """An op's input moves of one step take the compiled redistribute's forms (counted by
    kind), and a repeated call runs whole in the compiled front (``fast_moved_ops``); the
    outputs are bytewise those of the executor (the Python path), and under CommDebugMode
    the Python dispatcher and the executor run, so the debug records are unchanged."""
    mesh = dt.init_device_mesh((WORLD.size,))
    for i, (fn, operands, kind) in enumerate(OP_MOVES):
        xs = [_source(shape, pl, mesh)[0] for shape, pl in operands]
        dt.debug.set_fastpath(False)
        before = _kinds()
        want = _describe(fn(*xs))
        assert _kinds() == before, i  # the Python path: the executor
        with CommDebugMode() as mode:
            fn(*xs)
        want_counts = mode.get_comm_counts()
        dt.debug.set_fastpath(True)
        if WORLD.size == 1 and kind is not None:
            kind = {"local"}
        for call in range(2):  # the first call fills the entries, the second hits them
            before, moved = _kinds(), _moved()
            got = fn(*xs)
            after = _kinds()
            assert _describe(got) == want, i
            ran = {kd: after[kd] - before[kd] for kd in after if after[kd] != before[kd]}
            if kind is None:
                assert ran == {}, (i, ran)
            else:
                assert len(ran) == 1 and set(ran) <= kind and sum(ran.values()) == 1, (i, ran)
            # an entry that moves an input runs whole in the compiled front
            assert _moved() - moved == (kind is not None), (i, call)
        before, moved = _kinds(), _moved()
        with CommDebugMode() as mode:
            assert _describe(fn(*xs)) == want, i
        assert _kinds() == before and mode.get_comm_counts() == want_counts, i
        assert _moved() == moved, i


@needs_front
@pytest.mark.mpi(min_size=2)
def test_a_non_contiguous_local_shard_runs_the_python_method():
    mesh = dt.init_device_mesh((WORLD.size,))
    local = dt.from_numpy(np.arange(12, dtype=np.float32).reshape(3, 4) + WORLD.rank).t()
    x = dt.DTensor.from_local(local, mesh, [S(0)])  # a (4, 3) transposed view per rank
    for dst in ([R], [S(1)]):
        dt.debug.set_fastpath(False)
        want = _describe(x.redistribute(mesh, dst))
        dt.debug.set_fastpath(True)
        before = dt.debug.fastpath_status()["fast_redistributes"]
        assert _describe(x.redistribute(mesh, dst)) == want
        assert dt.debug.fastpath_status()["fast_redistributes"] == before


@needs_front
@pytest.mark.mpi(min_size=4)
def test_a_gather_over_one_dim_of_a_2d_mesh():
    mesh = dt.init_device_mesh((2, WORLD.size // 2))
    x, data = _source((6, 5), [S(0), R], mesh)
    dt.debug.set_fastpath(False)
    want = _describe(x.redistribute(mesh, [R, R]))
    dt.debug.set_fastpath(True)
    before = dt.debug.fastpath_status()["fast_redistributes"]
    y = x.redistribute(mesh, [R, R])
    assert _describe(y) == want and dt.debug.fastpath_status()["fast_redistributes"] == before + 1
    np.testing.assert_array_equal(y.full_tensor().numpy(), data)


@needs_front
@pytest.mark.mpi(min_size=2)
def test_comm_debug_mode_sees_every_redistribute():
    mesh = dt.init_device_mesh((WORLD.size,))
    x, data = _source((8, 8), [S(0)], mesh)
    x.redistribute(mesh, [R])
    before = dt.debug.fastpath_status()["fast_redistributes"]
    with CommDebugMode() as mode:
        y = x.redistribute(mesh, [R])
    assert mode.get_total_counts() == 1, mode.table()
    assert dt.debug.fastpath_status()["fast_redistributes"] == before  # the Python method ran
    np.testing.assert_array_equal(y.to_local().numpy(), data)
    before = dt.debug.fastpath_status()["fast_redistributes"]
    prev = rcomm.set_check_spmd(True)  # so does every call while the SPMD check is on
    try:
        z = x.redistribute(mesh, [P("sum")]).redistribute(mesh, [R])
    finally:
        rcomm.set_check_spmd(prev)
    assert dt.debug.fastpath_status()["fast_redistributes"] == before
    np.testing.assert_array_equal(z.to_local().numpy(), data)


@needs_front
@pytest.mark.mpi(min_size=1)
def test_bad_arguments_raise_as_in_the_python_method():
    mesh = dt.init_device_mesh((WORLD.size,))
    other = dt.init_device_mesh((1, WORLD.size))
    x, _ = _source((8, 8), [S(0)], mesh)
    for fast in (False, True):
        dt.debug.set_fastpath(fast)
        x.redistribute(mesh, [R])
        with pytest.raises(PlacementError, match="redistribute: 2 placements"):
            x.redistribute(mesh, [R, R])
        with pytest.raises(PlacementError, match="is not a placement"):
            x.redistribute(mesh, ["R"])
        with pytest.raises(MeshError, match="redistribute: moving a DTensor"):
            x.redistribute(other, [R, R])
        assert x.redistribute(mesh, None).placements == (R,)
        assert x.redistribute(mesh, iter([R])).placements == (R,)  # any iterable
        assert x.redistribute(placements=(R,), async_op=True).placements == (R,)


@needs_front
@pytest.mark.mpi(min_size=2)
def test_persistent_gathers_without_the_mpi_c_functions():
    """Without ``request_c_api`` the compiled path starts and waits through mpi4py."""
    from dtensor.dispatch import compiled

    mesh = dt.init_device_mesh((WORLD.size,))
    x, data = _source((5, 3), [S(1)], mesh)
    prev = rcomm.set_persistent(True)
    try:
        fastpath.redist.install(rcomm.HOOKS, rcomm.BYTES, None)
        before = _kinds()["gather"]
        y = x.redistribute(mesh, [R])
        assert _kinds()["gather"] == before + 1
        np.testing.assert_array_equal(y.to_local().numpy(), data)
    finally:
        compiled.plug_executor()
        rcomm.set_persistent(prev)
