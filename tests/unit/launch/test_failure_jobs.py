"""Failure handling of real dtensor jobs: a raising rank, SPMD divergence, the watchdog.

Each test starts a 2-rank ``mpiexec`` job in a subprocess (its own process group, killed
when it outlives its limit, which fails the test) whose ranks use dtensor collectives, and
checks that the job ends by itself with the expected exit status and messages instead of
hanging:

- one rank raises while the other waits in a collective: under ``python -m launch`` and
  under ``mpiexec -n 2 python -m mpi4py script.py`` the job aborts with that traceback;
- ranks that diverge (one enters an all-reduce, the other an all-gather) with
  ``DTENSOR_CHECK_SPMD=1`` or ``dt.debug.check_spmd()``: every rank raises ``CommError``
  showing both ranks' fingerprints;
- a rank that never arrives, with ``DTENSOR_WATCHDOG``: the waiting rank reports the
  collective it is stuck in and where the late rank is, then aborts the job
  (``DTENSOR_WATCHDOG_ABORT=1``) or, without abort, carries on once the rank arrives.

The ``mpiexec`` is the launcher's (:func:`launch._mpiexec.find_mpiexec`); the tests skip
only when there is none.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers.jobs import child_env, run_group

from launch._mpiexec import find_mpiexec

try:
    MPIEXEC, NO_MPIEXEC = find_mpiexec(), None
except FileNotFoundError as exc:
    MPIEXEC, NO_MPIEXEC = "mpiexec", str(exc)
#: Hard limit of one job (a job that hangs is killed and the test fails).
LIMIT_S = 60

# A prologue shared by the scripts: a 2-rank mesh and a sharded tensor.
PROLOGUE = """\
import sys, time
import numpy as np
import dtensor as dt
from dtensor.errors import CommError
mesh = dt.init_device_mesh((2,))
me = mesh.get_coordinate()[0]
x = dt.distribute_tensor(np.arange(12.0, dtype=np.float32).reshape(6, 2), mesh, [dt.Shard(0)])
"""

pytestmark = pytest.mark.skipif(NO_MPIEXEC is not None, reason=str(NO_MPIEXEC))


def _job(
    tmp_path: Path, body: str, cmd: list[str], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Write ``PROLOGUE + body`` to ``job.py`` and run ``cmd + [job.py]`` in ``tmp_path``;
    the test fails if the job is still running after ``LIMIT_S``."""
    script = tmp_path / "job.py"
    script.write_text(PROLOGUE + textwrap.dedent(body))
    extra = {"OMP_NUM_THREADS": "1", **(env or {})}
    extra["DTENSOR_WATCHDOG_DIR"] = str(tmp_path / "watchdog")
    full_env = child_env(
        extra, drop=["DTENSOR_CHECK_SPMD", "DTENSOR_WATCHDOG", "DTENSOR_WATCHDOG_ABORT"]
    )
    return run_group([*cmd, str(script)], tmp_path, LIMIT_S, full_env)


LAUNCH = [sys.executable, "-m", "launch", "-n", "2"]
MPI4PY_RUNNER = [MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py"]

RAISE_ON_RANK_1 = """\
def fail():
    raise ValueError("deliberate failure on rank 1")

if me == 1:
    fail()
print(x.full_tensor().numpy().sum())  # rank 0 would wait here forever
"""


@pytest.mark.parametrize("runner", [LAUNCH, MPI4PY_RUNNER], ids=["launch", "mpi4py"])
def test_raising_rank_ends_the_job_with_its_traceback(tmp_path, runner):
    out = _job(tmp_path, RAISE_ON_RANK_1, runner)
    assert out.returncode != 0
    assert "Traceback (most recent call last):" in out.stderr
    assert "ValueError: deliberate failure on rank 1" in out.stderr
    assert "in fail" in out.stderr


RAISE_DURING_ASYNC = """\
def fail():
    raise ValueError("deliberate failure on rank 1")

y = x.redistribute(mesh, [dt.Replicate()], async_op=True)  # both ranks: completes
if me == 1:
    fail()
z = y.redistribute(mesh, [dt.Shard(1)], async_op=True)  # rank 1 never starts its side
print(z.to_local().numpy().sum())  # rank 0 would wait here forever
"""


def test_raising_rank_during_an_async_redistribute_ends_the_job(tmp_path):
    out = _job(tmp_path, RAISE_DURING_ASYNC, LAUNCH)
    assert out.returncode != 0
    assert "ValueError: deliberate failure on rank 1" in out.stderr


def test_pending_redistributes_left_at_exit_end_cleanly(tmp_path):
    body = """\
    big = dt.distribute_tensor(np.ones((700, 500), np.float32), mesh, [dt.Shard(0)])
    for _ in range(3):  # dropped, and never waited for: exit lets them finish
        x.redistribute(mesh, [dt.Replicate()], async_op=True)
        big.redistribute(mesh, [dt.Shard(1)], async_op=True)
    print("done", flush=True)
    """
    out = _job(tmp_path, body, LAUNCH)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("done") == 2


DIVERGE_CAUGHT = """\
try:
    if me == 0:
        x.sum().full_tensor()    # an all-reduce of the partial sum
    else:
        x.full_tensor()          # an all-gather of the shards
except CommError as e:
    text = str(e).replace("\\n", " | ")
    print(f"rank {me} raised CommError: {text}\\n", end="", flush=True)  # one write
    sys.exit(0)
print(f"rank {me} did not raise", flush=True)
sys.exit(3)
"""


def test_divergence_under_env_makes_every_rank_raise(tmp_path):
    out = _job(tmp_path, DIVERGE_CAUGHT, MPI4PY_RUNNER, {"DTENSOR_CHECK_SPMD": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [ln for ln in out.stdout.splitlines() if "raised CommError" in ln]
    assert sorted(ln.split()[1] for ln in lines) == ["0", "1"], out.stdout
    for line in lines:
        assert "SPMD divergence" in line
        # every rank shows both fingerprints: its own all-reduce or all-gather and the other's
        assert "all_reduce" in line and "all_gather" in line
        assert "world rank 0" in line and "world rank 1" in line
        assert "(this rank)" in line and "differs from this rank" in line


def test_divergence_with_context_manager_and_uncaught_ends_the_job(tmp_path):
    body = """\
    from dtensor.debug._spmd import check_spmd
    with check_spmd():
        if me == 0:
            x.sum().full_tensor()
        else:
            x.full_tensor()
    """
    out = _job(tmp_path, body, LAUNCH)
    assert out.returncode != 0
    assert "CommError: SPMD divergence" in out.stderr


@pytest.mark.parametrize("check", [False, True])
def test_same_sized_divergence_is_only_caught_by_the_check(tmp_path, check):
    # both ranks all-reduce 2 float32 values, but with different reduce ops: MPI does not
    # notice (the result is undefined); the check does
    body = """\
    op = "sum" if me == 0 else "max"
    p = dt.DTensor.from_local(dt.ones(2), mesh, [dt.Partial(op)])
    try:
        p.full_tensor()
        print(f"rank {me} ran\\n", end="", flush=True)
    except CommError as e:
        print(f"rank {me} raised: {str(e).splitlines()[0]}\\n", end="", flush=True)
    """
    env = {"DTENSOR_CHECK_SPMD": "1"} if check else {}
    out = _job(tmp_path, body, MPI4PY_RUNNER, env)
    assert out.returncode == 0, out.stderr
    if check:
        assert out.stdout.count("raised: SPMD divergence") == 2, out.stdout
    else:
        assert out.stdout.count(" ran") == 2, out.stdout


def test_watchdog_reports_and_aborts(tmp_path):
    body = """\
    import threading
    if me == 1:
        threading.Event().wait()  # never arrives: only the abort ends the job
    x.full_tensor()
    """
    env = {"DTENSOR_WATCHDOG": "1.5", "DTENSOR_WATCHDOG_ABORT": "1"}
    out = _job(tmp_path, body, MPI4PY_RUNNER, env)
    assert out.returncode != 0
    err = out.stderr
    assert "[dtensor watchdog] world rank 0" in err
    assert "in all_gather" in err and "mesh dim 0" in err
    assert "S(0) -> R" in err  # the redistribute step being run
    assert "world rank 1: not in a dtensor collective" in err
    assert "aborting the job" in err


def test_watchdog_without_abort_reports_and_carries_on(tmp_path):
    body = """\
    import os
    from redistribute import comm as C
    if me == 0:  # once its watchdog has reported, rank 0 says so in a file
        report = C.HOOKS.watchdog._report
        def report_then_mark(slot):
            report(slot)
            open("reported", "w").close()
        C.HOOKS.watchdog._report = report_then_mark
    else:  # rank 1 arrives late: after that report (or, failing it, after 40 s)
        deadline = time.monotonic() + 40
        while not os.path.exists("reported") and time.monotonic() < deadline:
            time.sleep(0.05)
    print(f"sum {x.full_tensor().numpy().sum()}\\n", end="", flush=True)
    """
    out = _job(tmp_path, body, MPI4PY_RUNNER, {"DTENSOR_WATCHDOG": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("sum 66.0") == 2
    assert "[dtensor watchdog] world rank 0" in out.stderr
    assert "stuck for" in out.stderr
    # rank 1 was never stuck
    assert "[dtensor watchdog] world rank 1" not in out.stderr


def test_watchdog_shows_where_the_other_rank_is_stuck(tmp_path):
    # rank 0 gathers on the mesh's communicator, rank 1 waits in a barrier of the world:
    # both hang, and each watchdog names the other rank's collective
    body = """\
    from redistribute.comm import world
    if me == 0:
        x.full_tensor()
    else:
        world().barrier(what="rank one's barrier")
    """
    env = {"DTENSOR_WATCHDOG": "1.5", "DTENSOR_WATCHDOG_ABORT": "1"}
    out = _job(tmp_path, body, MPI4PY_RUNNER, env)
    assert out.returncode != 0
    err = out.stderr
    assert "stuck for" in err
    # whichever watchdog fires first reports the other rank's position
    assert ("world rank 1: in #" in err and "rank one's barrier" in err) or (
        "world rank 0: in #" in err and "S(0) -> R" in err
    ), err
