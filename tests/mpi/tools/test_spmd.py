"""SPMD divergence detection (``dt.debug.check_spmd()`` / ``DTENSOR_CHECK_SPMD=1``).

With the check on, results and the observed collectives are those of an unchecked run;
ranks that enter different collectives, or the same collective with different arguments,
all raise :class:`CommError` naming every rank's fingerprint (including the dispatched op
and the redistribute step) instead of hanging.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import numpy as np
import pytest
from helpers.mpi import data, meshes
from mpi4py import MPI

import dtensor as dt
from dtensor.debug._spmd import check_spmd
from dtensor.errors import CommError
from redistribute import comm as _comm
from redistribute.comm import spmd as _spmd

WORLD = MPI.COMM_WORLD
R, S, P = dt.Replicate(), dt.Shard, dt.Partial


def dist(arr, mesh, placements):
    return dt.distribute_tensor(arr, mesh, placements)


def program(mesh):
    """A few ops and redistributes with communication; returns numpy results."""
    a, b = data((7, 5)), data((5, 3), 1)
    rest = [R] * (mesh.ndim - 1)
    x = dist(a, mesh, [S(0), *rest])
    w = dist(b, mesh, [S(0), *rest])
    y = (x @ w).relu()
    z = y.sum(dim=0)
    t = x.redistribute(mesh, [S(1), *rest])
    return [y.full_tensor().numpy(), z.full_tensor().numpy(), t.full_tensor().numpy()]


@pytest.mark.mpi(min_size=1)
def test_checked_run_matches_unchecked_run_and_adds_no_observed_collectives():
    for mesh in meshes():
        with check_spmd(False), dt.debug.CommDebugMode() as plain_mode:
            assert not _comm.check_spmd_enabled()
            plain = program(mesh)
        with check_spmd(), dt.debug.CommDebugMode() as checked_mode:
            assert _comm.check_spmd_enabled()
            checked = program(mesh)
        a, b = data((7, 5)), data((5, 3), 1)
        y = np.maximum(a @ b, 0)
        want = [y, y.sum(axis=0), a]  # numpy of program()
        for p, c, w in zip(plain, checked, want):
            np.testing.assert_array_equal(p, c)
            np.testing.assert_allclose(c, w, rtol=1e-5, atol=1e-6)
        assert plain_mode.get_comm_counts() == checked_mode.get_comm_counts()
        assert plain_mode.get_total_counts() > 0


@pytest.mark.mpi(min_size=1)
def test_context_manager_nests_and_restores():
    outside = _comm.check_spmd_enabled()  # True in a run with DTENSOR_CHECK_SPMD=1
    with check_spmd():
        with check_spmd(False):
            assert not _comm.check_spmd_enabled()
        assert _comm.check_spmd_enabled()
    assert _comm.check_spmd_enabled() == outside


@pytest.mark.mpi(min_size=2)
def test_different_collectives_make_every_rank_raise():
    mesh = dt.init_device_mesh((WORLD.size,))
    x = dist(data((6, 4)), mesh, [S(0)])
    with check_spmd(), pytest.raises(CommError) as info:
        if WORLD.rank == 0:
            x.sum().full_tensor()  # all-reduce
        else:
            x.full_tensor()  # all-gather
    msg = str(info.value)
    assert "SPMD divergence" in msg
    assert "all_reduce" in msg and "all_gather" in msg
    assert "(this rank)" in msg and "differs from this rank" in msg
    for r in range(WORLD.size):
        assert f"world rank {r}:" in msg
    # the job goes on: the next collectives agree again
    with check_spmd():
        np.testing.assert_array_equal(x.full_tensor().numpy(), data((6, 4)))


@pytest.mark.mpi(min_size=2)
def test_divergent_api_calls_name_the_api_call():
    # from_local's shape exchange on some ranks, distribute_tensor's on the others
    mesh = dt.init_device_mesh((WORLD.size,))
    with check_spmd(), pytest.raises(CommError) as info:
        if WORLD.rank == 0:
            dt.DTensor.from_local(dt.ones(2, 3), mesh, [S(0)])
        else:
            dist(data((4, 3)), mesh, [S(0)])
    msg = str(info.value)
    assert "DTensor.from_local: local shapes" in msg
    assert "distribute_tensor" in msg


@pytest.mark.mpi(min_size=2)
def test_divergent_specs_raise_and_name_op_and_step():
    mesh = dt.init_device_mesh((WORLD.size,))
    n = 2 * WORLD.size
    a = data((n, n))
    # rank 0 believes x is sharded on dim 0, the others on dim 1: only the others
    # redistribute an input of the add; rank 0 goes straight to the gather of the result
    if WORLD.rank == 0:
        x = dt.DTensor.from_local(a[:2], mesh, [S(0)], shape=(n, n))
    else:
        x = dt.DTensor.from_local(a[:, :2], mesh, [S(1)], shape=(n, n))
    y = dist(a, mesh, [S(0)])
    with check_spmd(), pytest.raises(CommError) as info:
        (x + y).full_tensor()
    msg = str(info.value)
    assert "SPMD divergence" in msg
    assert "redistribute step 1/1 S(0) -> R" in msg  # rank 0's gather of the result
    assert "op add" in msg  # the others' redistribution inside the dispatched add


@pytest.mark.mpi(min_size=2)
def test_different_reduce_ops_raise():
    mesh = dt.init_device_mesh((WORLD.size,))
    op = "sum" if WORLD.rank == 0 else "max"
    p = dt.DTensor.from_local(dt.ones(3), mesh, [P(op)])
    with check_spmd(), pytest.raises(CommError, match="op sum") as info:
        p.full_tensor()
    assert "op max" in str(info.value)


@pytest.mark.mpi(min_size=4)
def test_divergence_on_a_mesh_dim_communicator_of_a_2d_mesh():
    mesh = dt.init_device_mesh((2, 2))
    x = dist(data((4, 6)), mesh, [R, S(0)])
    i, j = mesh.get_coordinate()
    with check_spmd(), pytest.raises(CommError, match="mesh dim 1") as info:
        if j == 0:
            x.full_tensor()  # all-gather on mesh dim 1
        else:
            x.sum().full_tensor()  # all-reduce on mesh dim 1
    msg = str(info.value)
    # only the two ranks of this row's communicator are compared
    assert msg.count("world rank") == 2
    assert f"world rank {mesh.mesh[i, 1 - j]}:" in msg


@pytest.mark.mpi(min_size=1)
def test_comm_methods_take_a_description():
    comm = _comm.world()
    with check_spmd():
        comm.barrier(what="test barrier")
        got = comm.allgather_ints([WORLD.rank], what=("test", "ints"))
        assert got[:, 0].tolist() == list(range(WORLD.size))
    if WORLD.size > 1:
        with check_spmd(), pytest.raises(CommError, match="test barrier|test ints"):
            if WORLD.rank == 0:
                comm.barrier(what="test barrier")
            else:
                comm.allgather_ints([1], what=("test", "ints"))


def _wait_for(condition, what: str, limit_s: float = 60.0) -> None:
    """Poll ``condition()`` until it holds; fail after ``limit_s`` seconds."""
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"waited {limit_s} s for {what}"
        time.sleep(0.01)


@pytest.mark.mpi(min_size=2)
def test_watchdog_context_manager_reports_a_late_rank(capsys):
    from dtensor.debug._watchdog import watchdog

    comm = _comm.world()
    marks = WORLD.bcast(tempfile.mkdtemp(prefix="dtensor-late-") if WORLD.rank == 0 else None)
    try:
        with watchdog(0.5):
            wd = _comm.HOOKS.watchdog
            state = wd._state_path(WORLD.rank)
            _wait_for(lambda: os.path.exists(state), "this rank's watchdog state")
            WORLD.Barrier()  # MPI's own, unwatched: every rank's state is readable now
            if WORLD.rank == 1:  # arrives late: once every other rank's watchdog reported
                _wait_for(lambda: len(os.listdir(marks)) == WORLD.size - 1, "the reports")
            else:
                report = wd._report

                def report_then_mark(slot):
                    report(slot)
                    open(os.path.join(marks, str(WORLD.rank)), "w").close()

                wd._report = report_then_mark
            comm.barrier(what="late barrier")
    finally:
        WORLD.Barrier()
        if WORLD.rank == 0:
            shutil.rmtree(marks)
    # stopped on leaving the block (or back to the one DTENSOR_WATCHDOG configures)
    assert _comm.HOOKS.watchdog is None or _comm.HOOKS.watchdog.from_env
    err = capsys.readouterr().err
    if WORLD.rank != 1:  # every rank waiting for rank 1 reports
        assert f"[dtensor watchdog] world rank {WORLD.rank}" in err and "late barrier" in err
        assert "stuck for" in err and "world rank 1: not in a dtensor collective" in err
    else:
        assert "[dtensor watchdog]" not in err


@pytest.mark.mpi(min_size=2)
def test_watchdog_names_the_op_and_phase_of_a_backward_collective(capsys):
    """A collective of backward reads ``"matmul (backward)"`` in the watchdog's report (and
    the SPMD check's fingerprints), as in CommDebugMode, instead of the op of the formula's
    inner call or none."""
    from dtensor.debug._watchdog import watchdog

    mesh = dt.init_device_mesh((WORLD.size,))
    rng = np.random.default_rng(0)
    x = dt.distribute_tensor(rng.standard_normal((4 * WORLD.size, 3)).astype(np.float32),
                             mesh, [dt.Shard(0)])
    w = dt.distribute_tensor(rng.standard_normal((3, 2)).astype(np.float32), mesh,
                             [dt.Replicate()]).requires_grad_()
    loss = (x @ w).sum()
    slots = []
    with watchdog(3600.0):
        wd = _comm.HOOKS.watchdog
        enter = wd.enter

        def keep(comm, kind, fp):
            enter(comm, kind, fp)
            slots.append(wd.slot)

        wd.enter = keep
        with dt.debug.CommDebugMode() as mode:
            loss.backward()
        backward = [s for s in slots if "(backward)" in _spmd.fingerprint(s[3])]
        assert backward, [_spmd.fingerprint(s[3]) for s in slots]
        wd._report(backward[0])  # what a hang there would print
    labels = {r.label for r in mode.records}
    assert "matmul (backward)" in labels, labels
    err = capsys.readouterr().err
    assert "op matmul (backward)" in err, err
