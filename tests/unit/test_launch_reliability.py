"""The launcher under hostile conditions: its own SIGKILL, ranks killed by signals, its folder.

Each test starts real 2-rank jobs through ``python -m launch`` in a subprocess (a session
of its own, killed when it outlives its limit) and checks:

- SIGKILL of the launcher ends every rank of its job (no rank keeps running under init);
- a rank killed by signal ``s`` makes the job exit with ``128 + s`` and the launcher names
  the signal, while ``sys.exit(s)`` stays ``s``;
- the ranks get a private (0700) folder for the watchdog's state in
  ``DTENSOR_WATCHDOG_DIR``, which the launcher removes when the job ends, aborted or not.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from _jobs import child_env, run_group

#: Hard limit of one job, and of the waits below (a broken feature fails, never hangs).
LIMIT_S = 60

pytestmark = [
    pytest.mark.mode_independent,  # see tests/unit/conftest.py
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
