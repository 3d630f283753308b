"""The launcher (``python -m launch``), its rank bootstrap, the MPI test harness and the runner.

Most tests start real ``mpiexec`` jobs through the launcher in a subprocess, each with a
hard timeout, and check exit statuses, output and that a failing rank ends the job at
once instead of leaving the other ranks blocked.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import skips
from helpers import TESTS
from helpers.jobs import run_group

import fastpath
from launch import _cputime, runtests
from launch.__main__ import _split
from launch._mpiexec import (
    RANK_ENV_DEFAULTS,
    TIMEOUT_EXIT_CODE,
    _flavor,
    find_mpiexec,
    host_args,
    job_command,
    rank_env,
)

pytestmark = pytest.mark.mode_independent  # see tests/conftest.py

MPI_CONFTEST = TESTS / "mpi" / "conftest.py"
UNIT_CONFTEST = TESTS / "unit" / "conftest.py"
#: The skip policy the conftests register (they import it from the tests folder).
SKIPS = TESTS / "skips.py"
#: The mode of a ``--quick`` run here, and the path its stages report.
QUICK_MODE, QUICK_PATH = (
    ("fastpath", "compiled, used") if fastpath.AVAILABLE else ("python", "python path")
)
#: Upper bound for jobs that must end promptly (they hang forever when the feature breaks).
PROMPT_S = 60


def _write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def _run(cmd: list[str], cwd: Path, limit: float = PROMPT_S) -> subprocess.CompletedProcess:
    """Run ``cmd`` (this process's environment) in its own process group; kill the group and
    fail if it outlives ``limit``."""
    return run_group(cmd, cwd, limit)


def _launch(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``python -m launch *args``, its job limited to PROMPT_S (a later --timeout wins)."""
    return _run([sys.executable, "-m", "launch", "--timeout", str(PROMPT_S), *args], cwd)


# --- command line -------------------------------------------------------------------------


def test_split_stops_at_the_script():
    own, program = _split(["-n", "2", "--timeout", "5", "s.py", "-n", "9", "--timeout", "x"])
    assert own == ["-n", "2", "--timeout", "5"]
    assert program == ["s.py", "-n", "9", "--timeout", "x"]


def test_split_module_and_separator():
    assert _split(["-n", "3", "-m", "pkg.mod", "-v"]) == (["-n", "3", "-m", "pkg.mod"], ["-v"])
    assert _split(["--timeout=4", "--", "-odd.py", "a"]) == (["--timeout=4"], ["-odd.py", "a"])
    assert _split(["-n", "2"]) == (["-n", "2"], [])


def test_job_command_runs_the_rank_bootstrap():
    cmd = job_command("/x/mpiexec", 3, ["s.py", "a"], ["-hosts", "h1"])
    assert cmd == [
        "/x/mpiexec",
        "-hosts",
        "h1",
        "-n",
        "3",
        sys.executable,
        "-m",
        "launch._rank",
        "s.py",
        "a",
    ]


def test_rank_env_fills_only_what_is_unset():
    env = rank_env({"OMP_NUM_THREADS": "4", "KEEP": "1"}, EXTRA="x")
    assert env["OMP_NUM_THREADS"] == "4"
    assert env["OPENBLAS_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "1"
    assert env["KEEP"] == "1" and env["EXTRA"] == "x"
    assert set(RANK_ENV_DEFAULTS) <= set(env)


# --- finding mpiexec ------------------------------------------------------------------------


def _fake_mpiexec(folder: Path, version_text: str) -> Path:
    path = _write(folder, "mpiexec", f"#!/bin/sh\necho '{version_text}'\n")
    path.chmod(0o755)
    return path


def test_find_mpiexec_default_is_next_to_python_or_on_path(monkeypatch):
    monkeypatch.delenv("DTENSOR_MPIEXEC", raising=False)
    found = Path(find_mpiexec())
    assert found.name in ("mpiexec", "mpirun")
    assert os.access(found, os.X_OK)
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.is_file():
        assert found == beside


def test_find_mpiexec_overrides(monkeypatch, tmp_path):
    fake = _fake_mpiexec(tmp_path, "x")
    monkeypatch.setenv("DTENSOR_MPIEXEC", str(fake))
    assert find_mpiexec() == str(fake)
    other = _fake_mpiexec(tmp_path / "other", "x")
    assert find_mpiexec(str(other)) == str(other)  # --mpiexec beats the variable
    monkeypatch.setenv("DTENSOR_MPIEXEC", str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="DTENSOR_MPIEXEC"):
        find_mpiexec()


def test_find_mpiexec_reports_absence(monkeypatch, tmp_path):
    monkeypatch.delenv("DTENSOR_MPIEXEC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setattr("sysconfig.get_path", lambda name: str(tmp_path))
    with pytest.raises(FileNotFoundError, match="pip install mpich"):
        find_mpiexec()


def test_host_args_follow_the_mpiexec_flavour(tmp_path):
    hydra = str(_fake_mpiexec(tmp_path / "h", "HYDRA build details:"))
    ompi = str(_fake_mpiexec(tmp_path / "o", "mpiexec (Open MPI) 5.0.3"))
    other = str(_fake_mpiexec(tmp_path / "u", "something else"))
    assert host_args(hydra, None, None) == []
    assert host_args(hydra, "a,b", "hf") == ["-hosts", "a,b", "-f", "hf"]
    assert host_args(ompi, "a,b", "hf") == ["--host", "a,b", "--hostfile", "hf"]
    with pytest.raises(ValueError, match="--mpiexec-arg"):
        host_args(other, "a", None)


# --- running jobs ---------------------------------------------------------------------------


def test_runs_script_with_its_args_and_env(tmp_path):
    _write(
        tmp_path,
        "show.py",
        """\
        import os, sys
        from mpi4py import MPI
        c = MPI.COMM_WORLD
        print("rank", c.rank, "of", c.size, sys.argv[1:], os.environ["OMP_NUM_THREADS"],
              sys.path[0] == os.path.dirname(os.path.realpath(__file__)), __name__)
        """,
    )
    out = _launch("-n", "2", "show.py", "-n", "7", "--timeout", "x", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    for rank in (0, 1):
        assert f"rank {rank} of 2 ['-n', '7', '--timeout', 'x'] 1 True __main__" in out.stdout


def test_mpiexec_args_reach_mpiexec(tmp_path):
    if _flavor(find_mpiexec()) != "hydra":
        pytest.skip("uses Hydra's -genv")
    _write(tmp_path, "env.py", "import os\nprint('VALUE', os.environ['DTENSOR_T'])\n")
    args = ["--mpiexec-arg=-genv", "--mpiexec-arg=DTENSOR_T", "--mpiexec-arg=from-mpiexec"]
    out = _launch("-n", "2", *args, "env.py", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("VALUE from-mpiexec") == 2


def test_runs_module_with_dash_m(tmp_path):
    _write(tmp_path, "pkg/__init__.py", "")
    _write(
        tmp_path,
        "pkg/tool.py",
        """\
        import sys
        from mpi4py import MPI
        if __name__ == "__main__":
            print("tool on rank", MPI.COMM_WORLD.rank, sys.argv[1:])
        """,
    )
    out = _launch("-n", "2", "-m", "pkg.tool", "a", "--b", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    for rank in (0, 1):
        assert f"tool on rank {rank} ['a', '--b']" in out.stdout


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("sys.exit(0)", 0),
        ("sys.exit(3)", 3),  # every rank exits 3
        ("sys.exit(5) if c.rank == 1 else c.Barrier()", 5),  # rank 0 would wait forever
    ],
)
def test_exit_status_is_forwarded(tmp_path, body, expected):
    _write(
        tmp_path,
        "ex.py",
        f"""\
        import sys
        from mpi4py import MPI
        c = MPI.COMM_WORLD
        {body}
        c.Barrier()
        """,
    )
    out = _launch("-n", "2", "ex.py", cwd=tmp_path)
    assert out.returncode == expected, out.stderr


def test_raising_rank_aborts_the_job_with_its_traceback(tmp_path):
    _write(
        tmp_path,
        "boom.py",
        """\
        from mpi4py import MPI
        c = MPI.COMM_WORLD

        def fail():
            raise ValueError(f"boom from rank {c.rank}")

        if c.rank == 1:
            fail()
        c.Barrier()  # ranks 0 and 2 would wait here forever
        """,
    )
    out = _launch("-n", "3", "boom.py", cwd=tmp_path)
    assert out.returncode == 1
    err = out.stderr
    assert "[rank 1] Traceback (most recent call last):" in err
    assert '[rank 1]   File "boom.py", line 8, in <module>' in err
    assert "[rank 1] ValueError: boom from rank 1" in err
    assert err.count("Traceback") == 1
    assert "runpy" not in err and "_rank.py" not in err


def test_timeout_kills_the_whole_job(tmp_path):
    _write(
        tmp_path,
        "sleepy.py",
        """\
        import os, threading
        from mpi4py import MPI
        with open(f"pid{MPI.COMM_WORLD.rank}", "w") as f:
            f.write(str(os.getpid()))
        threading.Event().wait()  # never ends by itself
        """,
    )
    out = _launch("-n", "2", "--timeout", "5", "sleepy.py", cwd=tmp_path)
    assert out.returncode == TIMEOUT_EXIT_CODE
    assert "timeout of 5 s" in out.stderr
    for rank in (0, 1):
        pid = int((tmp_path / f"pid{rank}").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_bad_command_lines_exit_2(tmp_path):
    assert _launch("-n", "2", "missing.py", cwd=tmp_path).returncode == 2
    assert _launch("-n", "0", "-m", "x", cwd=tmp_path).returncode == 2
    assert _launch("-n", "2", cwd=tmp_path).returncode == 2


# --- the MPI test harness (tests/mpi/conftest.py) ------------------------------------------


def _mpi_harness(folder: Path) -> None:
    """Put the MPI conftest, and the skip policy it imports, into ``folder``."""
    shutil.copy(MPI_CONFTEST, folder / "conftest.py")
    shutil.copy(SKIPS, folder)


def test_failing_rank_aborts_the_pytest_job(tmp_path):
    _mpi_harness(tmp_path)
    _write(
        tmp_path,
        "test_fails_on_rank1.py",
        """\
        import pytest
        from mpi4py import MPI

        @pytest.mark.mpi(min_size=2)
        def test_rank1_fails():
            comm = MPI.COMM_WORLD
            assert comm.rank != 1, "deliberate failure on rank 1"
            comm.Barrier()  # the other ranks would wait here forever
        """,
    )
    cmd = [find_mpiexec(), "-n", "3", sys.executable, "-m", "pytest", str(tmp_path)]
    out = _run([*cmd, "--with-mpi", "-q", "-p", "no:cacheprovider"], tmp_path)
    assert out.returncode != 0
    assert "[rank 1] FAILED test_fails_on_rank1.py::test_rank1_fails (call)" in out.stderr
    assert "[rank 1] E       AssertionError: deliberate failure on rank 1" in out.stderr
    assert "DTENSOR_TEST_SEED=" in out.stderr


def test_skips_are_listed_once_and_each_rank_checks_its_own(tmp_path):
    _mpi_harness(tmp_path)
    _write(
        tmp_path,
        "test_sizes.py",
        """\
        import pytest

        @pytest.mark.mpi(min_size=3)
        def test_needs_three():
            pass

        @pytest.mark.mpi(min_size=1)
        def test_any_size():
            pass
        """,
    )
    cmd = [find_mpiexec(), "-n", "2", sys.executable, "-m", "pytest", str(tmp_path)]
    cmd += ["--with-mpi", "-q", "-rs", "-p", "no:cacheprovider"]
    out = _run(cmd, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    # only rank 0 prints pytest's report, with the reason of the (expected) skip
    assert out.stdout.count("Test requires 3 MPI processes, only 2 MPI processes") == 1
    assert "fastpath: " in out.stdout

    # a skip that depends on the rank fails the job on the rank that skipped
    _write(
        tmp_path,
        "test_rank_skip.py",
        """\
        import pytest
        from mpi4py import MPI

        @pytest.mark.mpi(min_size=2)
        def test_skips_on_rank1():
            if MPI.COMM_WORLD.rank == 1:
                pytest.skip("deliberately skipped on rank 1")
        """,
    )
    out = _run(cmd, tmp_path)
    assert out.returncode != 0
    assert (
        "[rank 1] unexpected skip: test_rank_skip.py::test_skips_on_rank1: "
        "deliberately skipped on rank 1"
    ) in out.stderr


# --- the skip policy (tests/skips.py), in one process --------------------------------------


def _pytest(folder: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pytest", str(folder), "-q", "-rs", "-p", "no:cacheprovider"]
    return _run([*cmd, *args], folder)


def test_unexpected_skip_fails_the_session_and_names_the_test(tmp_path):
    shutil.copy(UNIT_CONFTEST, tmp_path / "conftest.py")
    shutil.copy(SKIPS, tmp_path)
    _write(
        tmp_path,
        "test_skips.py",
        """\
        import pytest

        def test_runs():
            pass

        @pytest.mark.skipif(True, reason="needs fork")
        def test_expected():
            pass

        def test_unexpected():
            pytest.skip("some reason nobody listed")
        """,
    )
    out = _pytest(tmp_path)
    assert out.returncode == 1, out.stdout
    assert "UNEXPECTED SKIP test_skips.py::test_unexpected: some reason nobody listed" in out.stdout
    assert out.stdout.count("UNEXPECTED SKIP") == 1
    out = _pytest(tmp_path, "-k", "not test_unexpected")
    assert out.returncode == 0, out.stdout
    assert "needs fork" in out.stdout  # -rs lists the expected skip
    assert "every test skipped" not in out.stdout
    # every selected test skipped, for an expected reason: reported, not failed
    out = _pytest(tmp_path, "-k", "test_expected")
    assert out.returncode == 0, out.stdout
    assert "every test skipped" in out.stdout and "1 x needs fork" in out.stdout


def test_an_entry_allows_its_reason_only_where_its_condition_holds(monkeypatch):
    reason = "fastpath extension not built: no module named fastpath._strides"
    monkeypatch.setattr(skips.fastpath, "AVAILABLE", False)
    monkeypatch.setenv("DTENSOR_REQUIRE_EXT", "0")
    assert skips.expected(reason).why == "extension not built"
    monkeypatch.setenv("DTENSOR_REQUIRE_EXT", "1")
    assert skips.expected(reason) is None
    monkeypatch.setattr(skips.fastpath, "AVAILABLE", True)
    monkeypatch.setenv("DTENSOR_REQUIRE_EXT", "0")
    assert skips.expected(reason) is None  # built after all: the skip is wrong
    assert skips.expected("fastpath extension not built") is None  # the whole reason matches


# --- the test runner (python -m launch test) -----------------------------------------------


def test_classify_pytest_statuses(tmp_path):
    empty = runtests.Stage("unit", None, "python", tmp_path / "empty")
    empty.path.mkdir()
    full = runtests.Stage("mpi", 2, "python", tmp_path / "full")
    _write(full.path, "test_x.py", "def test_x():\n    pass\n")
    assert runtests.classify(0, full, None) == "passed"
    assert runtests.classify(1, full, None) == "failed"
    assert runtests.classify(TIMEOUT_EXIT_CODE, full, None) == "timeout"
    assert runtests.classify(5, empty, None) == "empty"
    assert runtests.classify(5, full, None) == "failed"
    assert runtests.classify(5, full, "nomatch") == "deselected"
    # what the stage's pytest reported: its counts and the path its ops took
    ran = {"passed": 3, "skipped": 1, "fastpath": "python path (DTENSOR_FASTPATH=0 at import)"}
    assert runtests.classify(0, full, None, ran) == "passed"
    assert runtests.classify(0, full, None, dict(ran, passed=0)) == "all-skipped"
    assert runtests.classify(0, full, None, dict(ran, fastpath="compiled, used")) == "wrong-mode"
    assert runtests.classify(1, full, None, dict(ran, passed=0)) == "failed"


def test_cputime_counts_the_command_and_what_it_waited_for(tmp_path):
    """``launch._cputime`` writes the CPU seconds of the command and its waited-for children
    (here a shell that runs two busy Python processes one after the other) and passes the
    exit status on (``128 + s`` for a signal)."""
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"
    out = tmp_path / "cpu"
    cmd = ["sh", "-c", '"$0" -c "$1"; "$0" -c "$1"; exit 3', sys.executable, burn]
    assert _cputime.main([str(out), *cmd]) == 3
    assert 0.6 <= float(out.read_text()) < 5
    assert _cputime.main([str(out), "sh", "-c", "kill -TERM $$"]) == 128 + signal.SIGTERM
    assert _cputime.main([str(out)]) == 2


def test_stage_environments(tmp_path):
    """The Python path's MPI stages force every exchange through shared memory; the
    fast path's and the plain stages keep the defaults."""
    base = {"KEEP": "1"}
    fast_mpi = runtests.stage_environment(runtests.Stage("mpi", 2, "fastpath", tmp_path), base)
    py_mpi = runtests.stage_environment(runtests.Stage("mpi", 2, "python", tmp_path), base)
    py_unit = runtests.stage_environment(runtests.Stage("unit", None, "python", tmp_path), base)
    assert fast_mpi["DTENSOR_FASTPATH"] == "1" and py_mpi["DTENSOR_FASTPATH"] == "0"
    assert py_mpi["DTENSOR_SHM_MIN_BYTES"] == "0" and py_mpi["DTENSOR_POOL_MIN_BYTES"] == "1"
    assert "DTENSOR_SHM_MIN_BYTES" not in fast_mpi and "DTENSOR_SHM_MIN_BYTES" not in py_unit
    assert all(e["KEEP"] == "1" for e in (fast_mpi, py_mpi, py_unit)) and base == {"KEEP": "1"}
    # every stage keeps the bytecode it compiles, whatever the caller's environment says
    quiet = dict(base, PYTHONDONTWRITEBYTECODE="1")
    for stage in (runtests.Stage("mpi", 3, "python", tmp_path),
                  runtests.Stage("unit", None, "fastpath", tmp_path)):
        env = runtests.stage_environment(stage, quiet)
        assert "PYTHONDONTWRITEBYTECODE" not in env and env["KEEP"] == "1"
    assert quiet["PYTHONDONTWRITEBYTECODE"] == "1"


def test_mode_independent_tests_run_in_the_first_mode_only(tmp_path):
    """The second mode's stages (plain and MPI) deselect the tests marked
    ``mode_independent`` (``-m "not mode_independent"``); the first mode keeps them. The marker
    goes on the stage's command line, so pytest runs that tests start themselves (the
    mutation check's) still select such tests."""
    (tmp_path / "unit").mkdir()
    (tmp_path / "mpi").mkdir()
    stages = runtests._stages(tmp_path, ["fastpath", "python"], [2])
    assert [(s.suite, s.mode, s.repeat) for s in stages] == [
        ("unit", "fastpath", False),
        ("mpi", "fastpath", False),
        ("unit", "python", True),
        ("mpi", "python", True),
    ]
    marks = [runtests.REPEAT_MARKERS[1] in runtests._command(s, "mpiexec", ["-x"]) for s in stages]
    assert marks == [False, False, True, True]
    assert runtests._command(stages[2], "mpiexec", ["-x"])[-1] == "-x"
    mpi = runtests._command(stages[3], "mpiexec", ["-x"])
    assert mpi[:3] == ["mpiexec", "-n", "2"] and mpi[-3:] == [*runtests.REPEAT_MARKERS, "-x"]
    # the user's -m joins the repeat stage's (pytest keeps only the last -m)
    user = ["-m", "not torch", "-x"]
    assert runtests._command(stages[0], "mpiexec", user)[-3:] == user
    assert runtests._command(stages[2], "mpiexec", user)[-3:] == [
        "-m", "(not torch) and not mode_independent", "-x"]
    # pytest's side: this module is marked, so its tests are deselected, not skipped
    cmd = [sys.executable, "-m", "pytest", "unit/launch/test_launch.py",
           "unit/local/test_allocator.py", "--collect-only", "-q",
           "-p", "no:cacheprovider"]  # fmt: skip
    env = dict(os.environ, DTENSOR_FASTPATH="0")
    run = {"cwd": TESTS, "env": env, "capture_output": True, "text": True, "timeout": 120}
    both = subprocess.run(cmd, check=False, **run)
    cmd += runtests.REPEAT_MARKERS
    second = subprocess.run(cmd, check=False, **run)
    assert "unit/launch/test_launch.py::" in both.stdout, both.stdout[-2000:]
    assert "unit/launch/test_launch.py::" not in second.stdout, second.stdout[-2000:]
    assert "unit/local/test_allocator.py::" in second.stdout
    assert re.search(r"\d+ deselected", second.stdout), second.stdout[-500:]


def _run_runner(
    tests_dir: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``python -m launch test`` on ``tests_dir`` (this environment plus ``env``): at most 3
    stages of at most PROMPT_S each."""
    runner = [sys.executable, "-m", "launch", "test", "--tests-dir", str(tests_dir)]
    cmd = [*runner, "--timeout", str(PROMPT_S), *args]
    return run_group(cmd, tests_dir, 4 * PROMPT_S, dict(os.environ, **(env or {})))


def test_runner_stages_and_summary(tmp_path):
    tests = tmp_path / "tests"
    # the stages write bytecode caches even where the caller's environment says not to
    _write(tests, "unit/test_ok.py",
           "import sys\n\ndef test_ok():\n    assert not sys.dont_write_bytecode\n")
    _write(
        tests,
        "mpi/test_world.py",
        """\
        import sys

        import pytest
        from mpi4py import MPI

        @pytest.mark.mpi(min_size=1)
        def test_world(comm):
            assert comm.allreduce(1) == MPI.COMM_WORLD.size
            assert not sys.dont_write_bytecode
        """,
    )
    _mpi_harness(tests / "mpi")
    out = _run_runner(tests, "--quick", "--ranks", "1,2", env={"PYTHONDONTWRITEBYTECODE": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[-1] == "3 passed, 0 failed"
    rows = [line.split() for line in lines[-4:-1]]
    assert [(r[0], r[1], r[3]) for r in rows] == [
        ("unit", "-", "passed"),
        ("mpi", "1", "passed"),
        ("mpi", "2", "passed"),
    ]
    # the cpu column: every process of the stage (at least pytest's start-up per rank)
    assert lines[-5].split()[-2:] == ["seconds", "cpu"]
    cpu = [float(r[-1]) for r in rows]
    assert all(c > 0.2 for c in cpu) and cpu[2] > cpu[1], rows

    # A failing test fails its stage and the run; -k that matches nothing fails the run.
    _write(tests, "unit/test_bad.py", "def test_bad():\n    assert False\n")
    out = _run_runner(tests, "--quick", "--ranks", "2")
    assert out.returncode == 1
    assert out.stdout.strip().splitlines()[-1] == "1 passed, 1 failed"
    out = _run_runner(tests, "--quick", "--ranks", "2", "-k", "no_such_test")
    assert out.returncode == 1
    assert "no test matched" in out.stdout


BESIDE_UNIT = """\
import os
import time
from pathlib import Path


def test_stage_of_this_mode():
    here = Path(__file__).parent
    mode = os.environ["DTENSOR_FASTPATH"]
    (here / f"started-{mode}").write_text("")
    if mode == "1":  # ends only once the Python path's unit stage has started beside it
        deadline = time.monotonic() + 60
        while not (here / "started-0").exists():
            assert time.monotonic() < deadline, "the second unit stage did not run beside"
            time.sleep(0.05)
"""


def test_second_unit_stage_runs_beside_the_first(tmp_path):
    """With both modes (the extension built) on two cores or more, the Python path's unit
    stage runs while the compiled path's runs (the first stage waits for the second to
    start), the compiled path's unit suite is two stages (its mode_independent tests, here
    none, and the others), and the output keeps the stages' order: the second unit stage's
    pytest output comes under its own header, after the first mode's MPI stages."""
    tests = tmp_path / "tests"
    _write(tests, "unit/test_beside.py", BESIDE_UNIT)
    _write(tests, "mpi/test_world.py", "def test_world():\n    assert True\n")
    _mpi_harness(tests / "mpi")
    out = _run_runner(tests, "--ranks", "1")
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    if not fastpath.AVAILABLE:  # one mode: nothing runs beside
        assert "ran beside" not in text and text.strip().endswith("2 passed, 0 failed")
        return
    headers = re.findall(r"^== (.+) ==$", text, re.MULTILINE)
    assert headers[:5] == [
        "unit (mode_independent tests), compiled fast path (DTENSOR_FASTPATH=1)",
        "unit (not mode_independent tests), compiled fast path (DTENSOR_FASTPATH=1)",
        "mpi, 1 rank, compiled fast path (DTENSOR_FASTPATH=1)",
        "unit, Python path (DTENSOR_FASTPATH=0)",
        "mpi, 1 rank, Python path (DTENSOR_FASTPATH=0)",
    ], headers
    second = text.split("== unit, Python path", 1)[1].split("== mpi, 1 rank, Python", 1)[0]
    assert "(ran beside the stages before it; its output follows)" in second
    assert re.search(r"^1 passed", second, re.MULTILINE), second
    rows = [line.split() for line in text.strip().splitlines()[-6:-1]]
    assert [(r[0], r[3]) for r in rows] == [
        ("unit[independent]", "deselected"), ("unit[dependent]", "passed"), ("mpi", "passed"),
        ("unit", "passed"), ("mpi", "passed")], rows
    assert text.strip().endswith("5 passed, 0 failed")


def test_which_stages_run_beside(tmp_path, monkeypatch):
    """On two cores or more (and without ``--serial``) the stages of one process start first,
    the plain suites before the 1-rank MPI stages, then the MPI stages of several ranks in
    their order; the first mode's unit suite is split in its mode_independent tests and the
    others; a stage that ends early stops its job."""
    root = tmp_path
    (root / "unit").mkdir()
    (root / "mpi").mkdir()
    opts = runtests._parser().parse_args([])
    serial = runtests._parser().parse_args(["--serial"])
    stages = runtests._stages(root, ["fastpath", "python"], [1, 2, 4], split=True)
    assert [(s.suite, s.ranks, s.mode, s.part, s.repeat) for s in stages] == [
        ("unit", None, "fastpath", "independent", False),
        ("unit", None, "fastpath", "dependent", False),
        ("mpi", 1, "fastpath", "", False),
        ("mpi", 2, "fastpath", "", False),
        ("mpi", 4, "fastpath", "", False),
        ("unit", None, "python", "", True),
        ("mpi", 1, "python", "", True),
        ("mpi", 2, "python", "", True),
        ("mpi", 4, "python", "", True),
    ]
    assert runtests._command(stages[0], "mpiexec", ["-m", "not torch"])[-2:] == [
        "-m", "(not torch) and mode_independent"]
    assert runtests._command(stages[1], "mpiexec", [])[-2:] == list(runtests.REPEAT_MARKERS)
    # one mode: nothing to split
    assert len(runtests._stages(root, ["fastpath"], [1], split=True)) == 2
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert runtests._start_order(stages, opts) == [0, 1, 5, 2, 6, 3, 4, 7, 8]
    assert [runtests._cores(s) for s in stages] == [1, 1, 1, 2, 2, 1, 1, 2, 2]
    assert runtests._start_order(stages, serial) == list(range(9))
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    assert runtests._start_order(stages, opts) == list(range(9))
    monkeypatch.undo()
    # a stage's job ended early: its process group goes, the thread ends promptly
    job = runtests._Beside([sys.executable, "-c", "import time; time.sleep(120)"],
                           dict(os.environ), root, 300.0, root / "job.out")
    deadline = time.monotonic() + 30
    while job.proc is None:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    job.stop()
    assert not job.thread.is_alive() and job.rc is not None and job.rc != 0
    assert job.seconds < 30


def test_runner_accepts_an_empty_mpi_folder(tmp_path):
    tests = tmp_path / "tests"
    _write(tests, "unit/test_ok.py", "def test_ok():\n    pass\n")
    (tests / "mpi").mkdir()
    out = _run_runner(tests, "--quick", "--ranks", "2")
    assert out.returncode == 0, out.stdout + out.stderr
    assert " empty " in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "2 passed, 0 failed"


def test_runner_fails_without_the_extension_when_it_is_required(tmp_path):
    tests = tmp_path / "tests"
    _write(tests, "unit/test_ok.py", "def test_ok():\n    pass\n")
    # a stand-in fastpath package found first from the tests folder: not built
    _write(tests, "fastpath/__init__.py", "AVAILABLE = False\nIMPORT_ERROR = 'a stand-in'\n")
    out = _run_runner(tests, env={"DTENSOR_REQUIRE_EXT": "1"})
    assert out.returncode == 1
    assert "DTENSOR_REQUIRE_EXT=1 but the compiled extension" in out.stderr
    assert "a stand-in" in out.stderr and "== unit" not in out.stdout
    out = _run_runner(tests, env={"DTENSOR_REQUIRE_EXT": "0"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "== unit, Python path (DTENSOR_FASTPATH=0) ==" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "1 passed, 0 failed"


def _policy_unit_folder(tests: Path, conftest: str | None = None) -> None:
    """``tests/unit`` with the unit conftest (or ``conftest``) and the skip policy."""
    (tests / "unit").mkdir(parents=True)
    shutil.copy(SKIPS, tests)
    if conftest is None:
        shutil.copy(UNIT_CONFTEST, tests / "unit")
    else:
        _write(tests, "unit/conftest.py", conftest)


def test_runner_counts_skips_and_fails_a_stage_on_an_unexpected_one(tmp_path):
    tests = tmp_path / "tests"
    _policy_unit_folder(tests)
    _write(
        tests,
        "unit/test_some.py",
        """\
        import pytest

        def test_ok():
            pass

        @pytest.mark.skipif(True, reason="needs fork")
        def test_expected():
            pass
        """,
    )
    out = _run_runner(tests, "--quick")
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"fastpath: {QUICK_PATH}" in out.stdout  # the stage's own header, from dtensor
    assert re.search(r"SKIPPED \[1\] unit/test_some.py:\d+: needs fork", out.stdout), out.stdout
    lines = out.stdout.strip().splitlines()
    assert lines[-3].split()[3:6] == ["result", "passed", "skipped"]
    assert lines[-2].split()[:6] == ["unit", "-", QUICK_MODE, "passed", "1", "1"]

    _write(tests, "unit/test_odd.py", "import pytest\n\ndef test_odd():\n    pytest.skip('odd')\n")
    out = _run_runner(tests, "--quick")
    assert out.returncode == 1
    assert "UNEXPECTED SKIP unit/test_odd.py::test_odd: odd" in out.stdout
    assert out.stdout.strip().splitlines()[-2].split()[3] == "failed"


def test_runner_reports_a_stage_in_which_every_test_skipped(tmp_path):
    tests = tmp_path / "tests"
    _policy_unit_folder(tests)
    _write(
        tests,
        "unit/test_skipped.py",
        """\
        import pytest

        @pytest.mark.skipif(True, reason="needs fork")
        def test_expected():
            pass
        """,
    )
    out = _run_runner(tests, "--quick")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "every test skipped" in out.stdout
    assert out.stdout.strip().splitlines()[-2].split()[3:6] == ["all-skipped", "0", "1"]


@pytest.mark.skipif(not fastpath.AVAILABLE, reason="compiled extension not built")
def test_runner_fails_a_stage_that_runs_on_the_other_path(tmp_path):
    tests = tmp_path / "tests"
    # this conftest turns the compiled path off before dtensor is imported
    conftest = """\
    import os
    os.environ["DTENSOR_FASTPATH"] = "0"
    import skips

    def pytest_configure(config):
        skips.register(config)
    """
    _policy_unit_folder(tests, conftest)
    _write(tests, "unit/test_ok.py", "def test_ok():\n    pass\n")
    out = _run_runner(tests, "--quick")
    assert out.returncode == 1
    assert "the fastpath stage ran with fastpath: python path" in out.stdout
    assert out.stdout.strip().splitlines()[-2].split()[3] == "wrong-mode"
