"""The launcher under hostile conditions: its own SIGKILL, ranks killed by signals, its folder.

Each test starts real 2-rank jobs through ``python -m launch`` in a subprocess (a session
of its own, killed when it outlives its limit) and checks:

- SIGKILL of the launcher ends every rank of its job (no rank keeps running under init);
- a rank killed by signal ``s`` makes the job exit with ``128 + s`` and the launcher names
  the signal, while ``sys.exit(s)`` stays ``s``;
- the ranks get a private (0700) folder for the watchdog's state in
  ``DTENSOR_WATCHDOG_DIR``, which the launcher removes when the job ends, aborted or not;
- SIGTERM or SIGINT to the test runner (``python -m launch test``) kills the running
  stage's job and ends the run with ``128 + signal``, no later stage started;
- ranks die with Hydra's proxy when it is killed, and the launcher ends every process of
  the job (a process a rank started in a session of its own) at its end or timeout;
- ``sys.exit(256)`` is a failure (clamped to 255), and output that imitates Hydra's report
  of a signal is not taken for one;
- the folders of launchers killed by SIGKILL are removed by the next launch (never a live
  job's), and an aborted job leaves none of its MPI library's files in ``/dev/shm``.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers.jobs import child_env, run_group

#: Hard limit of one job, and of the waits below (a broken feature fails, never hangs).
LIMIT_S = 60

pytestmark = [
    pytest.mark.mode_independent,  # see tests/conftest.py
    pytest.mark.skipif(sys.platform != "linux", reason="reads /proc"),
]


def _env(tmp_path: Path) -> dict:
    """The jobs' environment; the launcher's temporary folders go under ``tmp_path/tmp``
    (a launcher killed by SIGKILL cannot remove its own)."""
    (tmp_path / "tmp").mkdir(exist_ok=True)
    extra = {"OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path / "tmp")}
    return child_env(extra, drop=["DTENSOR_WATCHDOG_DIR"])


def _launch(tmp_path: Path, body: str, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "job.py").write_text(textwrap.dedent(body))
    cmd = [sys.executable, "-m", "launch", "--timeout", str(LIMIT_S), "-n", "2", "job.py", *args]
    return run_group(cmd, tmp_path, LIMIT_S + 10, _env(tmp_path))


def _start_time(pid: int) -> str | None:
    """Field 22 of ``/proc/pid/stat`` (start time), or None when ``pid`` is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]


def _poll(condition, what: str) -> None:
    deadline = time.monotonic() + LIMIT_S
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {LIMIT_S} s")
        time.sleep(0.05)


SLEEPER = """\
import os, sys, time
from mpi4py import MPI
path = os.path.join(sys.argv[1], f"pid{MPI.COMM_WORLD.Get_rank()}")
with open(path + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(path + ".tmp", path)
time.sleep(300)
"""


def test_sigkill_of_the_launcher_ends_every_rank(tmp_path):
    (tmp_path / "job.py").write_text(SLEEPER)
    cmd = [sys.executable, "-m", "launch", "--timeout", "300", "-n", "2", "job.py", str(tmp_path)]
    launcher = subprocess.Popen(cmd, cwd=tmp_path, env=_env(tmp_path), start_new_session=True)
    ranks: dict[int, str] = {}  # pid -> start time
    try:
        files = [tmp_path / f"pid{r}" for r in (0, 1)]

        def up() -> bool:
            return all(f.exists() for f in files) or launcher.poll() is not None

        _poll(up, "the ranks did not start")
        assert launcher.poll() is None, "the job ended before it was killed"
        for f in files:
            pid = int(f.read_text())
            ranks[pid] = _start_time(pid)
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()

        def survivors() -> list[int]:
            return [p for p, start in ranks.items() if start and _start_time(p) == start]

        _poll(lambda: not survivors(), "the ranks did not end after the launcher's SIGKILL")
    finally:
        for pid, start in ranks.items():  # only our ranks, by id
            if start and _start_time(pid) == start:
                os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()


KILL_RANK_1 = """\
import os, signal, sys
from mpi4py import MPI
c = MPI.COMM_WORLD
if c.rank == 1:
    {action}
c.Barrier()  # rank 0 would wait here forever
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_rank_killed_by_a_signal_exits_128_plus_signal(tmp_path, sig):
    out = _launch(tmp_path, KILL_RANK_1.format(action=f"os.kill(os.getpid(), {int(sig)})"))
    assert out.returncode == 128 + sig, out.stdout + out.stderr
    assert f"killed by signal {int(sig)} ({sig.name})" in out.stderr
    assert f"exit status {128 + sig}" in out.stderr


def test_exit_with_a_signal_number_is_an_exit_status(tmp_path):
    out = _launch(tmp_path, KILL_RANK_1.format(action="sys.exit(9)"))
    assert out.returncode == 9, out.stdout + out.stderr
    assert "killed by signal" not in out.stderr


@pytest.mark.parametrize("end", ["c.Barrier()", "sys.exit(4) if c.rank == 1 else c.Barrier()"])
def test_ranks_get_a_private_folder_that_the_launcher_removes(tmp_path, end):
    body = f"""\
    import os, stat, sys
    from mpi4py import MPI
    c = MPI.COMM_WORLD
    folder = os.environ["DTENSOR_WATCHDOG_DIR"]
    st = os.lstat(folder)
    print(f"rank {{c.rank}} folder {{folder}} dir={{stat.S_ISDIR(st.st_mode)}} "
          f"mode={{oct(st.st_mode & 0o777)}} mine={{st.st_uid == os.geteuid()}}", flush=True)
    c.Barrier()
    {end}
    """
    out = _launch(tmp_path, body)
    assert out.returncode == (0 if end == "c.Barrier()" else 4), out.stderr
    lines = sorted(ln for ln in out.stdout.splitlines() if " folder " in ln)
    assert len(lines) == 2, out.stdout
    folders = {ln.split()[3] for ln in lines}
    assert len(folders) == 1  # one folder per job, shared by its ranks
    for line in lines:
        assert line.endswith("dir=True mode=0o700 mine=True"), line
    folder = Path(folders.pop())
    assert folder.parent == tmp_path / "tmp"
    assert not folder.exists()


BLOCKING_STAGE = """\
import os, subprocess, sys

def test_blocks():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    print(f"STAGE-PIDS {os.getpid()} {child.pid}", flush=True)
    child.wait()
"""
SECOND_STAGE = """\
from pathlib import Path

Path(__file__).with_name("second-stage-started").touch()

def test_second():
    pass
"""


def _sigint_as_at_a_terminal() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _read_until(proc: subprocess.Popen, marker: bytes, deadline: float) -> bytes:
    """What ``proc`` wrote to its stdout up to the first line holding ``marker``."""
    seen = b""
    while marker not in seen or not seen.split(marker, 1)[1].count(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
            pytest.fail(f"no {marker!r} line within {LIMIT_S} s: {seen!r}")
        chunk = os.read(proc.stdout.fileno(), 65536)
        if not chunk:
            pytest.fail(f"the runner ended before printing {marker!r}: {seen!r}")
        seen += chunk
    return seen


def _gone(pid: int, start: str | None, deadline: float) -> bool:
    """Whether process ``pid`` (started at ``start``) has ended by ``deadline``: waits on a
    pidfd, which becomes readable when the process ends."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        if _start_time(pid) != start:  # ended (a zombie, or the pid is another's now)
            return True
        return bool(select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0])
    finally:
        os.close(fd)


@pytest.mark.parametrize("serial", [True, False], ids=["serial", "side-by-side"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_signal_to_the_test_runner_stops_the_whole_run(tmp_path, sig, serial):
    # python -m launch test on a fake suite: the first stage blocks (with a child process of
    # its own); the runner gets ``sig`` while it runs. The stage's job dies (its whole
    # process group), the runner names the stage and exits with 128 + sig, and the second
    # stage's output never shows; with --serial the second stage never starts (side by side,
    # on two cores or more, the 1-rank MPI stage starts beside the first: it ends at once).
    tests = tmp_path / "tests"
    (tests / "unit").mkdir(parents=True)
    (tests / "mpi").mkdir()
    (tests / "unit" / "test_block.py").write_text(BLOCKING_STAGE)
    (tests / "mpi" / "test_second.py").write_text(SECOND_STAGE)
    cmd = [sys.executable, "-m", "launch", "test", "--tests-dir", str(tests), "--quick",
           "--ranks", "1", "--timeout", str(LIMIT_S), *(["--serial"] if serial else []),
           "--", "-s"]
    # a shell without job control starts background jobs with SIGINT ignored, and Python then
    # keeps it ignored: the runner gets Ctrl-C's default here, as at a terminal
    runner = subprocess.Popen(cmd, cwd=tmp_path, env=_env(tmp_path), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, start_new_session=True,
                              preexec_fn=_sigint_as_at_a_terminal)  # noqa: PLW1509 (one syscall)
    pids: dict[int, str | None] = {}
    try:
        deadline = time.monotonic() + LIMIT_S
        seen = _read_until(runner, b"STAGE-PIDS", deadline)
        line = seen.split(b"STAGE-PIDS", 1)[1].split(b"\n", 1)[0]
        pids = {int(p): _start_time(int(p)) for p in line.split()}
        assert all(pids.values()), f"the stage's processes are not running: {pids}"
        os.kill(runner.pid, sig)
        out, err = runner.communicate(timeout=LIMIT_S)
        out, err = (seen + out).decode(), err.decode()
        assert runner.returncode == 128 + sig, out + err
        survivors = [p for p, start in pids.items() if not _gone(p, start, deadline)]
        assert not survivors, f"processes of the interrupted stage survived: {survivors}"
        assert f"interrupted by {sig.name}" in err and "stage unit" in err, err
        assert "== mpi" not in out, out
        if serial or (os.cpu_count() or 1) < 2:
            assert not (tests / "mpi" / "second-stage-started").exists()
    finally:
        for pid, start in pids.items():  # only the stage's processes, by id
            if start and _start_time(pid) == start:
                os.kill(pid, signal.SIGKILL)
        if runner.poll() is None:
            os.killpg(runner.pid, signal.SIGKILL)
            runner.wait()


def _ranks_up(tmp_path: Path, launcher: subprocess.Popen, n: int = 2) -> dict[int, str]:
    """Wait for the ``pid<r>`` files of :data:`SLEEPER`; ``{pid: start time}`` of the ranks."""
    files = [tmp_path / f"pid{r}" for r in range(n)]
    _poll(lambda: all(f.exists() for f in files) or launcher.poll() is not None,
          "the ranks did not start")
    assert launcher.poll() is None, "the job ended early"
    return {int(f.read_text()): _start_time(int(f.read_text())) for f in files}


def _kill_survivors(procs: dict[int, str | None]) -> None:
    for pid, start in procs.items():  # only the processes of this test, by id
        if start and _start_time(pid) == start:
            os.kill(pid, signal.SIGKILL)


def test_ranks_die_with_their_proxy(tmp_path):
    # each rank has a session of its own: when Hydra's proxy is killed outright, nothing
    # else ended them (the parent-death signal of the rank bootstrap does)
    (tmp_path / "job.py").write_text(SLEEPER)
    cmd = [sys.executable, "-m", "launch", "--timeout", "300", "-n", "2", "job.py", str(tmp_path)]
    launcher = subprocess.Popen(cmd, cwd=tmp_path, env=_env(tmp_path), start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ranks: dict[int, str | None] = {}
    try:
        ranks = _ranks_up(tmp_path, launcher)
        with open(f"/proc/{next(iter(ranks))}/stat") as f:
            proxy = int(f.read().rsplit(")", 1)[1].split()[1])
        assert "proxy" in Path(f"/proc/{proxy}/cmdline").read_text(), "not Hydra's proxy"
        os.kill(proxy, signal.SIGKILL)
        _poll(lambda: all(_start_time(p) != st for p, st in ranks.items()),
              "the ranks did not end with their proxy")
        _poll(lambda: launcher.poll() is not None, "the launcher did not end")
    finally:
        _kill_survivors(ranks)
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()


DETACHED = """\
import os, subprocess, sys, time
from mpi4py import MPI
if MPI.COMM_WORLD.Get_rank() == 0:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                             start_new_session=True, stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(os.path.join(sys.argv[1], "child.tmp"), "w") as f:
        f.write(str(child.pid))
    os.replace(os.path.join(sys.argv[1], "child.tmp"), os.path.join(sys.argv[1], "child"))
{end}
"""


@pytest.mark.parametrize("end", ["time.sleep(300)", "MPI.COMM_WORLD.Barrier()"],
                         ids=["timeout", "normal end"])
def test_the_launcher_ends_every_process_of_the_job(tmp_path, end):
    # a process a rank started in a session of its own outlived the job (its --timeout
    # killed mpiexec's process group only); the launcher ends it by the job's token
    (tmp_path / "job.py").write_text(DETACHED.format(end=end))
    cmd = [sys.executable, "-m", "launch", "--timeout", "8", "-n", "2", "job.py", str(tmp_path)]
    child: dict[int, str | None] = {}
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(tmp_path), start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _poll(lambda: (tmp_path / "child").exists() or proc.poll() is not None,
              "the job did not start its process")
        pid = int((tmp_path / "child").read_text())
        child = {pid: _start_time(pid)}
        out, err = proc.communicate(timeout=LIMIT_S)
        assert proc.returncode == (124 if "sleep" in end else 0), out + err
        _poll(lambda: _start_time(pid) != child[pid], "the job's process outlived the job")
    finally:
        _kill_survivors(child)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.parametrize("code,status", [(256, 255), (512 + 7, 255), (-1, 1), (255, 255)])
def test_exit_status_is_clamped_to_a_failure(tmp_path, code, status):
    out = _launch(tmp_path, KILL_RANK_1.format(action=f"sys.exit({code})"))
    assert out.returncode == status, out.stdout + out.stderr


FAKE_REPORT = """\
import os, socket, sys
from mpi4py import MPI
c = MPI.COMM_WORLD
if c.rank == 1:
    pid = {pid}
    print("=" * 83)
    print("=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES")
    print(f"=   PID {{pid}} RUNNING AT {{socket.gethostname()}}")
    print("=   EXIT CODE: 9")
    print("=" * 83)
    print("YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Killed (signal 9)")
    print("This typically refers to a problem with your application.")
    print("Please see the FAQ page for debugging suggestions", flush=True)
    sys.exit(9)
c.Barrier()
"""


@pytest.mark.parametrize("pid", ["os.getpid()", "1"], ids=["own pid", "no rank's pid"])
def test_printed_signal_report_is_not_taken_for_a_signal(tmp_path, pid):
    # the launcher read "killed by signal 9" from the output's last lines, which a program
    # prints too (a job that reports a sub-job's end): the ranks' records tell
    out = _launch(tmp_path, FAKE_REPORT.format(pid=pid))
    assert out.returncode == 9, out.stdout + out.stderr
    assert "killed by signal" not in out.stderr


def test_folders_of_killed_launchers_are_removed_by_the_next_launch(tmp_path):
    import fcntl

    tmp = tmp_path / "tmp"
    (tmp_path / "job.py").write_text(SLEEPER)
    cmd = [sys.executable, "-m", "launch", "--timeout", "300", "-n", "2", "job.py", str(tmp_path)]
    launcher = subprocess.Popen(cmd, cwd=tmp_path, env=_env(tmp_path), start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ranks: dict[int, str | None] = {}
    try:
        ranks = _ranks_up(tmp_path, launcher)
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        _poll(lambda: all(_start_time(p) != st for p, st in ranks.items()), "ranks survived")
    finally:
        _kill_survivors(ranks)
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    (dead,) = tmp.glob("dtensor-job-*")  # a SIGKILLed launcher cannot remove its own
    # a live job's folder (its lock held) and one without a lock stay
    live, lockless = tmp / "dtensor-job-live", tmp / "dtensor-job-nolock"
    live.mkdir(mode=0o700)
    lockless.mkdir(mode=0o700)
    with open(live / "lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        out = _launch(tmp_path, "print('ok')\n")
        assert out.returncode == 0, out.stderr
        assert not dead.exists()
        assert live.exists() and lockless.exists()
    assert sorted(p.name for p in tmp.iterdir()) == ["dtensor-job-live", "dtensor-job-nolock"]


SHM_JOB = """\
import sys
from mpi4py import MPI
paths = sorted({line.split(None, 5)[5].strip() for line in open("/proc/self/maps")
                if "/dev/shm/" in line and "(deleted)" not in line})
print("SHM", MPI.COMM_WORLD.rank, *paths, flush=True)
MPI.COMM_WORLD.Barrier()
if MPI.COMM_WORLD.rank == 1:
    raise RuntimeError("abort the job")
MPI.COMM_WORLD.Barrier()
"""


def test_an_aborted_job_leaves_no_shared_memory_files(tmp_path):
    out = _launch(tmp_path, SHM_JOB)
    assert out.returncode == 1, out.stdout + out.stderr
    paths = {p for line in out.stdout.splitlines() if line.startswith("SHM ")
             for p in line.split()[2:]}
    assert paths, "the MPI library mapped no /dev/shm file (nothing to check)"
    left = [p for p in paths if os.path.exists(p)]
    assert not left, f"the aborted job left {left}"
