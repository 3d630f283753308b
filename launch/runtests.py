"""The one test command: ``python -m launch test``.

This module owns running the whole test suite as a list of *stages*: the plain pytest
folders (``tests/unit``, and ``tests/sim`` when present) in one process, then
``tests/mpi`` under ``mpiexec -n K`` for K in 1, 2, 3, 4, every stage with a timeout
that kills its whole process group; all of it first with the compiled fast path
(``DTENSOR_FASTPATH=1``) and again on the Python path (``DTENSOR_FASTPATH=0``). The MPI
stages of the Python path also send every exchange of pooled buffers through node-shared
memory (:data:`SHARED_ALWAYS`), which by default only tensors of 1 MiB and more take, so
that every MPI test runs over both transports. A plain suite's tests marked
``mode_independent`` run in the first mode's stage only (see :class:`Stage`). On a
machine of two cores or more, the second mode's unit stage runs beside the first mode's
(one pytest process each; its output is printed at its turn in the order above;
``--serial`` runs every stage after the one before).

Every stage lists its skips (``-rs``); the test folders' conftests fail a stage on a skip
that ``tests/skips.py`` does not expect, and write the stage's counts and the path its ops
took to a JSON file (``DTENSOR_TEST_REPORT``). From it the summary table gets its
``passed`` and ``skipped`` columns, marks a stage in which every test skipped
(``all-skipped``) and fails one that ran on another path than its mode asks for
(``wrong-mode``). The run ends with that table and the line ``N passed, N failed``
(counting stages) and exits non-zero when any stage failed. With ``DTENSOR_REQUIRE_EXT=1``
a missing compiled extension fails the run before any stage starts. SIGINT (Ctrl-C),
SIGTERM or SIGHUP stops the whole run: the running stage's job is killed (its process
group, and the job of a stage running beside it), the runner names the stage, prints
the table so far and exits with ``128 + signal``; no later stage starts.

Each suite folder holds one package per layer of the project (``tests/unit/local``,
``tests/mpi/ops``, ...), which pytest collects recursively; the runner names the suite
folders only.

Stages run with the ``tests`` folder as working directory, so the packages under test
are the installed ones (with their compiled extension), not the source tree next to
the tests; when the packages are not installed, the source tree is put on
``PYTHONPATH`` instead and the runner says so.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ._mpiexec import (
    TIMEOUT_EXIT_CODE,
    JobInterrupted,
    find_mpiexec,
    interruptible,
    rank_env,
    run_job,
    stop_job,
)

__all__ = [
    "REPEAT_MARKERS",
    "Outcome",
    "Stage",
    "classify",
    "find_tests_dir",
    "main",
    "stage_environment",
]

PLAIN_SUITES = ("unit", "sim")
MPI_SUITE = "mpi"
#: Mode name -> value of DTENSOR_FASTPATH.
MODES = {"fastpath": "1", "python": "0"}
#: Extra environment of the Python path's MPI stages: every buffer from the pool (so in a
#: shared segment) and every exchange tried through shared memory.
SHARED_ALWAYS = {"DTENSOR_SHM_MIN_BYTES": "0", "DTENSOR_POOL_MIN_BYTES": "1"}
#: Statuses that count as a passed stage.
OK_STATUSES = frozenset({"passed", "all-skipped", "empty", "deselected"})
#: Mode name -> how its stage headers name it.
MODE_TITLES = {
    "fastpath": "compiled fast path (DTENSOR_FASTPATH=1)",
    "python": "Python path (DTENSOR_FASTPATH=0)",
}
#: The path a stage of each mode must report (the start of its ``fastpath`` header line).
MODE_PATHS = {"fastpath": "compiled", "python": "python path"}
#: Environment variable naming the file in which a stage's pytest writes its counts.
REPORT_ENV = "DTENSOR_TEST_REPORT"
#: Options of every stage's pytest: quiet, with the reason of each skip, no cache folder.
PYTEST_OPTIONS = ("-q", "-rs", "-p", "no:cacheprovider")
#: pytest's marker expression of a stage when an earlier stage of the run (the other mode's,
#: same suite and rank count) already ran the suite's tests marked ``mode_independent``.
REPEAT_MARKERS = ("-m", "not mode_independent")
#: pytest's exit status when it collected (or selected) no test.
NO_TESTS_EXIT_CODE = 5

_PROBE = """\
import fastpath
print(int(fastpath.AVAILABLE))
print(fastpath.__file__)
print(fastpath.IMPORT_ERROR or "")
"""


@dataclass(frozen=True)
class Stage:
    """One pytest run: a suite folder, a rank count (``None``: no mpiexec) and a mode.

    ``repeat`` marks a stage in the second mode of a run: the tests marked
    ``mode_independent`` (whose outcome ``DTENSOR_FASTPATH`` cannot change: rules, plans,
    the redistribute executor, the runner and launcher themselves) ran in the first mode's
    stage of the same suite and rank count, and are left out.
    """

    suite: str
    ranks: int | None
    mode: str
    path: Path
    repeat: bool = False


@dataclass(frozen=True)
class Outcome:
    """How a stage ended: a status (see :func:`classify`), its wall time and the counts
    its pytest reported (None when it wrote none: it crashed or ran past its timeout)."""

    stage: Stage
    status: str
    seconds: float
    report: dict | None = None

    @property
    def ok(self) -> bool:
        return self.status in OK_STATUSES


def find_tests_dir(start: Path) -> Path | None:
    """The ``tests`` folder of the checkout that contains ``start`` (or of this file).

    **Local.** Looks for ``<dir>/tests`` holding ``unit`` or ``mpi`` in ``start`` and its
    parents, then next to the ``launch`` package (an editable install or a checkout).
    """
    here = Path(__file__).resolve().parent.parent
    for folder in (start.resolve(), *start.resolve().parents, here):
        tests = folder / "tests"
        if (tests / "unit").is_dir() or (tests / MPI_SUITE).is_dir():
            return tests
    return None


def _has_tests(folder: Path) -> bool:
    return any(folder.rglob("test_*.py")) or any(folder.rglob("*_test.py"))


def classify(returncode: int, stage: Stage, keyword: str | None, report: dict | None = None) -> str:
    """Status of a stage from pytest's exit status and the counts it reported.

    **Local.** For status 0: ``wrong-mode`` when ``report`` says the stage ran on another
    path than its mode asks for, ``all-skipped`` when every test skipped (for reasons
    ``tests/skips.py`` expects, or pytest would not have passed), else ``passed``;
    ``timeout`` (124); for pytest's "no tests" status 5: ``empty`` when the folder holds
    no test files, ``deselected`` when ``-k`` selected none of them, else ``failed`` (test
    files that yield no test are a broken stage); ``failed`` for anything else.
    """
    if returncode == 0:
        if report is not None and not report["fastpath"].startswith(MODE_PATHS[stage.mode]):
            return "wrong-mode"
        if report is not None and report["skipped"] and not report["passed"]:
            return "all-skipped"
        return "passed"
    if returncode == TIMEOUT_EXIT_CODE:
        return "timeout"
    if returncode == NO_TESTS_EXIT_CODE:
        if not _has_tests(stage.path):
            return "empty"
        if keyword:
            return "deselected"
    return "failed"


def _stages(tests_dir: Path, modes: Sequence[str], ranks: Sequence[int]) -> list[Stage]:
    stages = []
    for i, mode in enumerate(modes):
        for suite in PLAIN_SUITES:
            if (tests_dir / suite).is_dir():
                stages.append(Stage(suite, None, mode, tests_dir / suite, repeat=i > 0))
        if (tests_dir / MPI_SUITE).is_dir():
            mpi = tests_dir / MPI_SUITE
            stages += [Stage(MPI_SUITE, k, mode, mpi, repeat=i > 0) for k in ranks]
    return stages


def stage_environment(stage: Stage, env: dict[str, str]) -> dict[str, str]:
    """The environment ``stage`` runs in: ``env`` plus its mode's settings. **Local**."""
    out = dict(env, DTENSOR_FASTPATH=MODES[stage.mode])
    if stage.mode == "python" and stage.ranks is not None:
        out.update(SHARED_ALWAYS)
    if stage.ranks is not None and stage.ranks > (os.cpu_count() or 1):
        # oversubscribed: MPICH's busy-polling ranks starve each other; yield instead
        out.setdefault("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1")
    return out


def _merge_markers(pytest_args: Sequence[str]) -> tuple[tuple[str, ...], list[str]]:
    """A repeat stage's marker expression joined with the user's ``-m EXPR`` (pytest keeps
    only the last ``-m``, so ``-- -m "not torch"`` would otherwise bring the
    ``mode_independent`` tests back), and the other arguments."""
    rest, user = [], []
    args = list(pytest_args)
    i = 0
    while i < len(args):
        if args[i] == "-m" and i + 1 < len(args):
            user.append(args[i + 1])
            i += 2
            continue
        rest.append(args[i])
        i += 1
    expr = " and ".join([f"({e})" for e in user] + [REPEAT_MARKERS[1]])
    return ("-m", expr), rest


def _command(stage: Stage, mpiexec: str, pytest_args: Sequence[str]) -> list[str]:
    pytest = [sys.executable, "-m", "pytest", str(stage.path), *PYTEST_OPTIONS]
    marks: tuple[str, ...] = ()
    if stage.repeat:
        marks, pytest_args = _merge_markers(pytest_args)
    if stage.ranks is None:
        return [*pytest, *marks, *pytest_args]
    return [mpiexec, "-n", str(stage.ranks), *pytest, "--with-mpi", *marks, *pytest_args]


def _probe(tests_dir: Path, env: dict[str, str]) -> tuple[bool, str, str] | None:
    """(extension available, fastpath location, import error), or None if not importable."""
    out = subprocess.run(
        [sys.executable, "-c", _PROBE],
        cwd=tests_dir,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if out.returncode != 0:
        return None
    available, location, error = (out.stdout.splitlines() + ["", "", ""])[:3]
    return available == "1", location, error


def _parse_ranks(text: str) -> list[int]:
    try:
        ranks = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ranks takes e.g. 1,2,4; got {text!r}") from None
    if not ranks or min(ranks) < 1:
        raise argparse.ArgumentTypeError(f"--ranks needs counts >= 1; got {text!r}")
    return ranks


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m launch test",
        description="Run tests/unit (and tests/sim), then tests/mpi under mpiexec with 1, "
        "2, 3 and 4 ranks, with the compiled fast path and again with DTENSOR_FASTPATH=0. "
        "Arguments after `--` go to every pytest run.",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="one mode only (the fast path if built, else the Python path)",
    )
    p.add_argument(
        "--serial",
        action="store_true",
        help="run every stage after the one before (by default, on two cores or more, the "
        "second mode's unit stage runs beside the first mode's)",
    )
    p.add_argument(
        "--ranks",
        type=_parse_ranks,
        default=[1, 2, 3, 4],
        metavar="1,2,3,4",
        help="rank counts of the MPI stages (default 1,2,3,4)",
    )
    p.add_argument(
        "-k",
        dest="keyword",
        default=None,
        metavar="EXPR",
        help="only tests matching EXPR (passed to pytest)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=1500.0,
        metavar="S",
        help="time limit of each stage in seconds (default 1500)",
    )
    p.add_argument(
        "--tests-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="the tests folder (default: ./tests of the checkout)",
    )
    return p


def _read_report(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _summary(outcomes: Sequence[Outcome]) -> str:
    rows = [("stage", "ranks", "mode", "result", "passed", "skipped", "seconds")]
    rows += [
        (
            o.stage.suite,
            "-" if o.stage.ranks is None else str(o.stage.ranks),
            o.stage.mode,
            o.status,
            "-" if o.report is None else str(o.report["passed"]),
            "-" if o.report is None else str(o.report["skipped"]),
            f"{o.seconds:.1f}",
        )
        for o in outcomes
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(
            cell.rjust(w) if i >= 4 else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths))
        ).rstrip()
        for row in rows
    ]
    passed = sum(o.ok for o in outcomes)
    return "\n".join(
        ["== test summary (stages) ==", *lines, f"{passed} passed, {len(outcomes) - passed} failed"]
    )


def _stage_name(stage: Stage) -> str:
    ranks = "" if stage.ranks is None else f", {stage.ranks} rank" + "s" * (stage.ranks > 1)
    return f"{stage.suite}{ranks}, {MODE_TITLES[stage.mode]}"


class _Beside:
    """A stage run in a thread beside the stages before it, its output kept in a file until
    its turn in the run's order (see :func:`_beside_index`)."""

    def __init__(self, cmd: list[str], env: dict[str, str], cwd: Path, timeout: float,
                 output: Path) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.rc: int | None = None
        self.error: BaseException | None = None
        self.seconds = 0.0
        self.output = output
        self._args = (cmd, env, cwd, timeout)
        self.thread = threading.Thread(target=self._run, name="beside-stage", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        cmd, env, cwd, timeout = self._args
        start = time.perf_counter()
        try:
            with open(self.output, "wb") as out:
                self.rc = run_job(cmd, env=env, cwd=cwd, timeout=timeout, output=out,
                                  started=self._started)
        except BaseException as exc:  # noqa: BLE001 - reported at the stage's turn
            self.error = exc
        self.seconds = time.perf_counter() - start

    def _started(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc

    def wait(self) -> None:
        while self.thread.is_alive():  # a join that a signal to the runner can interrupt
            self.thread.join(0.2)

    def stop(self) -> None:
        """End the stage's job (its whole process group) and wait for the thread."""
        if self.thread.is_alive() and self.proc is not None:
            stop_job(self.proc)
        self.wait()


def _beside_index(stages: Sequence[Stage], opts: argparse.Namespace) -> int | None:
    """The stage that runs beside the first one, when the machine has two cores or more and
    ``--serial`` was not given: the second mode's run of the first stage's suite when both
    are plain (unit) suites, one process each, so each keeps a core. None otherwise."""
    if opts.serial or (os.cpu_count() or 1) < 2 or not stages:
        return None
    first = stages[0]
    if first.ranks is not None:
        return None
    for i, stage in enumerate(stages[1:], 1):
        if stage.suite == first.suite and stage.ranks is None and stage.mode != first.mode:
            return i
    return None


def _run_stages(
    tests_dir: Path,
    modes: Sequence[str],
    opts: argparse.Namespace,
    env: dict[str, str],
    mpiexec: str,
    pytest_args: Sequence[str],
    outcomes: list[Outcome],
) -> None:
    """Run every stage, appending each one's outcome to ``outcomes`` in the run's order; the
    stage being run when the runner is interrupted is appended with the status
    ``interrupted`` before :class:`JobInterrupted` (or KeyboardInterrupt) goes on. The
    second mode's unit stage runs beside the first mode's (:func:`_beside_index`); its
    output is printed at its turn, and an interruption ends it too. **Local**."""
    with tempfile.TemporaryDirectory(prefix="dtensor-test-reports-") as reports:
        stages = _stages(tests_dir, modes, opts.ranks)
        beside_at = _beside_index(stages, opts)
        beside: _Beside | None = None

        def setup(i: int, stage: Stage) -> tuple[list[str], dict[str, str], Path]:
            cmd = _command(stage, mpiexec, pytest_args)
            report_path = Path(reports) / f"stage{i}.json"
            stage_env = dict(stage_environment(stage, env), **{REPORT_ENV: str(report_path)})
            return cmd, stage_env, report_path

        try:
            if beside_at is not None:
                cmd, stage_env, _ = setup(beside_at, stages[beside_at])
                beside = _Beside(cmd, stage_env, tests_dir, opts.timeout,
                                 Path(reports) / f"stage{beside_at}.out")
            for i, stage in enumerate(stages):
                cmd, stage_env, report_path = setup(i, stage)
                print(f"\n== {_stage_name(stage)} ==\n$ {shlex.join(cmd)}", flush=True)
                start = time.perf_counter()
                if i == beside_at and beside is not None:
                    print("(ran beside the first stage; its output follows)", flush=True)
                    try:
                        beside.wait()
                    except (JobInterrupted, KeyboardInterrupt):
                        outcomes.append(Outcome(stage, "interrupted",
                                                time.perf_counter() - start))
                        raise
                    sys.stdout.flush()
                    sys.stdout.buffer.write(beside.output.read_bytes())
                    sys.stdout.flush()
                    if beside.error is not None:
                        raise beside.error
                    rc, seconds = beside.rc, beside.seconds
                else:
                    try:
                        rc = run_job(cmd, env=stage_env, cwd=tests_dir, timeout=opts.timeout)
                    except (JobInterrupted, KeyboardInterrupt):
                        outcomes.append(Outcome(stage, "interrupted",
                                                time.perf_counter() - start))
                        raise
                    seconds = time.perf_counter() - start
                report = _read_report(report_path)
                status = classify(rc, stage, opts.keyword, report)
                if status == "wrong-mode":
                    print(f"the {stage.mode} stage ran with fastpath: {report['fastpath']}")
                outcomes.append(Outcome(stage, status, seconds, report))
        finally:
            if beside is not None:
                beside.stop()


def _interrupted(outcomes: Sequence[Outcome]) -> str:
    """Which stage an interruption stopped, for the runner's last message."""
    if outcomes and outcomes[-1].status == "interrupted":
        return f"stage {_stage_name(outcomes[-1].stage)} was interrupted (its job killed)"
    if outcomes:
        return f"after stage {_stage_name(outcomes[-1].stage)}"
    return "before the first stage"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the test stages and print the summary; return 0 only when every stage passed
    (``128 + signal`` when a signal stopped the run).

    **Local** (each MPI stage starts its own ``mpiexec`` job).

    Parameters
    ----------
    argv : sequence of str, optional
        The runner's command line (after ``test``); default ``sys.argv[1:]``.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    pytest_args: list[str] = []
    if "--" in args:
        cut = args.index("--")
        args, pytest_args = args[:cut], args[cut + 1 :]
    parser = _parser()
    opts = parser.parse_args(args)
    tests_dir = opts.tests_dir.resolve() if opts.tests_dir else find_tests_dir(Path.cwd())
    if tests_dir is None or not tests_dir.is_dir():
        parser.error("no tests folder found (run from the checkout, or pass --tests-dir)")
    try:
        mpiexec = find_mpiexec()
    except FileNotFoundError as exc:
        parser.error(str(exc))
    if opts.keyword:
        pytest_args = ["-k", opts.keyword, *pytest_args]

    env = rank_env()
    probe = _probe(tests_dir, env)
    source_root = tests_dir.parent
    if probe is None and (source_root / "fastpath").is_dir():
        env["PYTHONPATH"] = str(source_root) + (
            ":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""
        )
        probe = _probe(tests_dir, env)
        print(f"packages are not installed: testing the source tree {source_root}")
    if probe is None:
        parser.error(f"cannot import the fastpath package from {tests_dir}")
    available, location, error = probe
    if not available and os.environ.get("DTENSOR_REQUIRE_EXT") == "1":
        print(
            f"launch test: DTENSOR_REQUIRE_EXT=1 but the compiled extension of "
            f"{Path(location).parent} is not built ({error}); no stage was run",
            file=sys.stderr,
        )
        return 1
    print(f"python:   {sys.executable}")
    print(f"mpiexec:  {mpiexec}")
    print(f"packages: {Path(location).parent.parent}")
    if available:
        print("fastpath: compiled extension built; stages run with it and without it")
        modes = ["fastpath"] if opts.quick else list(MODES)
    else:
        print(
            f"fastpath: compiled extension NOT BUILT ({error}); its tests skip and only "
            "the Python path (DTENSOR_FASTPATH=0) runs"
        )
        modes = ["python"]

    outcomes: list[Outcome] = []
    try:
        with interruptible():
            _run_stages(tests_dir, modes, opts, env, mpiexec, pytest_args, outcomes)
    except (JobInterrupted, KeyboardInterrupt) as exc:
        stop = exc if isinstance(exc, JobInterrupted) else JobInterrupted(signal.SIGINT)
        print("\n" + _summary(outcomes), flush=True)
        print(f"launch test: {stop}; {_interrupted(outcomes)}; no further stage runs",
              file=sys.stderr, flush=True)
        return stop.status
    matched = not opts.keyword or any(o.status not in ("empty", "deselected") for o in outcomes)
    if not matched:
        print(f"\nno test matched -k {opts.keyword!r}")
    print("\n" + _summary(outcomes), flush=True)
    return 0 if matched and outcomes and all(o.ok for o in outcomes) else 1
