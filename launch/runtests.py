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
machine of two cores or more the stages of one process each (the plain suites and the
1-rank MPI stages) run side by side, up to one per core, before the MPI stages of several
ranks, which each take the whole machine (see :func:`_start_order`); the first mode's plain
suite is then run as two stages, its ``mode_independent`` tests (most of which start MPI
jobs or pytest runs of their own) and the rest, so that its two halves share the cores.
Every stage's output is printed at its turn in the order above (the stage whose turn it is
as it comes); ``--serial`` runs every stage after the one before, each suite in one stage.

Every stage lists its skips (``-rs``); the test folders' conftests fail a stage on a skip
that ``tests/skips.py`` does not expect, and write the stage's counts and the path its ops
took to a JSON file (``DTENSOR_TEST_REPORT``). From it the summary table gets its
``passed`` and ``skipped`` columns, marks a stage in which every test skipped
(``all-skipped``) and fails one that ran on another path than its mode asks for
(``wrong-mode``); its ``cpu`` column is the CPU time (user + system) of the stage's
processes, every rank and every job its tests started included (see
:mod:`launch._cputime`). The run ends with that table and the line ``N passed, N failed``
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
    "STAGE_ENV_DROPPED",
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
    stage of the same suite and rank count, and are left out. ``part`` splits a first-mode
    suite in two stages: ``"independent"`` runs only its ``mode_independent`` tests,
    ``"dependent"`` the others (empty: the whole suite).
    """

    suite: str
    ranks: int | None
    mode: str
    path: Path
    repeat: bool = False
    part: str = ""


@dataclass(frozen=True)
class Outcome:
    """How a stage ended: a status (see :func:`classify`), its wall time, the counts its
    pytest reported (None when it wrote none: it crashed or ran past its timeout) and the
    CPU seconds of its processes (None when unknown: it was interrupted)."""

    stage: Stage
    status: str
    seconds: float
    report: dict | None = None
    cpu: float | None = None

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
        if keyword or stage.part:
            return "deselected"
    return "failed"


#: ``Stage.part`` -> pytest's marker expression of that part of a suite.
PART_MARKERS = {"independent": "mode_independent", "dependent": "not mode_independent"}


def _stages(tests_dir: Path, modes: Sequence[str], ranks: Sequence[int],
            split: bool = False) -> list[Stage]:
    """The run's stages in their order. With ``split`` (and two modes), the first mode's
    plain suites are two stages each (``Stage.part``), so that they can run side by side."""
    stages = []
    for i, mode in enumerate(modes):
        for suite in PLAIN_SUITES:
            if not (tests_dir / suite).is_dir():
                continue
            if split and i == 0 and len(modes) > 1:
                stages += [Stage(suite, None, mode, tests_dir / suite, part=part)
                           for part in PART_MARKERS]
            else:
                stages.append(Stage(suite, None, mode, tests_dir / suite, repeat=i > 0))
        if (tests_dir / MPI_SUITE).is_dir():
            mpi = tests_dir / MPI_SUITE
            stages += [Stage(MPI_SUITE, k, mode, mpi, repeat=i > 0) for k in ranks]
    return stages


#: Variables a stage's environment drops: with ``PYTHONDONTWRITEBYTECODE`` set (as some
#: machine images do) no process keeps the bytecode it compiles, so every process of a run
#: (each rank of each MPI stage, each job or pytest run a test starts) compiled the test
#: modules (pytest's assertion rewriting included) and an editable install's source tree
#: anew: about 2.8 s of CPU per pytest process over ``tests/mpi`` and 7 s over
#: ``tests/unit``. Without it they write Python's default ``__pycache__`` folders, which
#: ``.gitignore`` lists, and read them from then on (a mutation of ``python -m launch
#: mutate`` is compiled from its patched source, never from a cached file).
STAGE_ENV_DROPPED = ("PYTHONDONTWRITEBYTECODE",)


def stage_environment(stage: Stage, env: dict[str, str]) -> dict[str, str]:
    """The environment ``stage`` runs in: ``env`` without :data:`STAGE_ENV_DROPPED`, plus its
    mode's settings. **Local**."""
    out = {k: v for k, v in env.items() if k not in STAGE_ENV_DROPPED}
    out["DTENSOR_FASTPATH"] = MODES[stage.mode]
    if stage.mode == "python" and stage.ranks is not None:
        out.update(SHARED_ALWAYS)
    if stage.ranks is not None and stage.ranks > (os.cpu_count() or 1):
        # oversubscribed: MPICH's busy-polling ranks starve each other; yield instead
        out.setdefault("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1")
    return out


def _merge_markers(pytest_args: Sequence[str],
                   own: str = REPEAT_MARKERS[1]) -> tuple[tuple[str, ...], list[str]]:
    """A stage's own marker expression (a repeat stage's, or a part's) joined with the
    user's ``-m EXPR`` (pytest keeps only the last ``-m``, so ``-- -m "not torch"`` would
    otherwise bring the ``mode_independent`` tests back), and the other arguments."""
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
    expr = " and ".join([f"({e})" for e in user] + [own])
    return ("-m", expr), rest


def _command(stage: Stage, mpiexec: str, pytest_args: Sequence[str]) -> list[str]:
    pytest = [sys.executable, "-m", "pytest", str(stage.path), *PYTEST_OPTIONS]
    marks: tuple[str, ...] = ()
    if stage.repeat:
        marks, pytest_args = _merge_markers(pytest_args)
    elif stage.part:
        marks, pytest_args = _merge_markers(pytest_args, PART_MARKERS[stage.part])
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
        help="run every stage after the one before, each suite in one stage (by default, on "
        "two cores or more, the stages of one process run side by side, the first mode's "
        "unit suite as two stages)",
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


def _read_cpu(path: Path) -> float | None:
    try:
        return float(path.read_text())
    except (OSError, ValueError):
        return None


def _timed(cmd: list[str], cpu_file: Path) -> list[str]:
    """``cmd`` run by :mod:`launch._cputime` (as a script: it imports nothing of the project),
    which writes its CPU seconds to ``cpu_file``."""
    return [sys.executable, str(Path(__file__).with_name("_cputime.py")), str(cpu_file), *cmd]


def _summary(outcomes: Sequence[Outcome]) -> str:
    rows = [("stage", "ranks", "mode", "result", "passed", "skipped", "seconds", "cpu")]
    rows += [
        (
            _suite_label(o.stage),
            "-" if o.stage.ranks is None else str(o.stage.ranks),
            o.stage.mode,
            o.status,
            "-" if o.report is None else str(o.report["passed"]),
            "-" if o.report is None else str(o.report["skipped"]),
            f"{o.seconds:.1f}",
            "-" if o.cpu is None else f"{o.cpu:.1f}",
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


def _suite_label(stage: Stage) -> str:
    """The summary table's name of a stage's suite: ``unit``, or ``unit[independent]``."""
    return f"{stage.suite}[{stage.part}]" if stage.part else stage.suite


def _stage_name(stage: Stage) -> str:
    ranks = "" if stage.ranks is None else f", {stage.ranks} rank" + "s" * (stage.ranks > 1)
    part = f" ({PART_MARKERS[stage.part]} tests)" if stage.part else ""
    return f"{stage.suite}{part}{ranks}, {MODE_TITLES[stage.mode]}"


class _Beside:
    """A stage run in a thread (beside other stages), its output written to a file, which the
    runner prints at the stage's turn in the run's order (see :func:`_start_order`)."""

    def __init__(self, cmd: list[str], env: dict[str, str], cwd: Path, timeout: float,
                 output: Path) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.rc: int | None = None
        self.error: BaseException | None = None
        self.seconds = 0.0
        self.output = output
        self._args = (cmd, env, cwd, timeout)
        # set when the stage has ended: Thread.is_alive() can answer False for a live thread
        # once a join() of it was interrupted by a signal's exception (as the runner's are)
        self.done = threading.Event()
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
        self.done.set()

    def _started(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc

    def wait(self, seconds: float | None = None) -> bool:
        """Wait for the stage to end (at most ``seconds``); whether it has. A signal to the
        runner can interrupt the wait."""
        deadline = None if seconds is None else time.monotonic() + seconds
        while not self.done.wait(0.2):
            if deadline is not None and time.monotonic() >= deadline:
                return False
        return True

    def stop(self) -> None:
        """End the stage's job (its whole process group) and wait for the thread."""
        while not self.done.is_set():
            if self.proc is not None:  # (None for a moment, while the job starts)
                stop_job(self.proc)
                break
            time.sleep(0.02)
        self.wait()


def _parallel(opts: argparse.Namespace) -> bool:
    """Whether stages may run side by side: two cores or more, and no ``--serial``."""
    return not opts.serial and (os.cpu_count() or 1) >= 2


def _cores(stage: Stage) -> int:
    """The cores a stage takes: one per process (a plain suite: 1), at most the machine's."""
    return min(stage.ranks or 1, os.cpu_count() or 1)


def _start_order(stages: Sequence[Stage], opts: argparse.Namespace) -> list[int]:
    """The order in which the stages start (indexes into ``stages``, which stay the order
    of their output and of the summary).

    **Local.** Serially (one core, or ``--serial``): the stages' own order. Otherwise the
    stages of one process go first, the plain suites before the 1-rank MPI stages (the
    longest first, so that the cores end together), then the MPI stages of several ranks
    in their order; a stage starts once the cores it takes (:func:`_cores`) are free.
    """
    order = list(range(len(stages)))
    if not _parallel(opts):
        return order
    single = [i for i in order if _cores(stages[i]) == 1]
    single.sort(key=lambda i: stages[i].ranks is not None)  # stable: plain suites first
    return single + [i for i in order if _cores(stages[i]) > 1]


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
    stage whose turn it is when the runner is interrupted is appended with the status
    ``interrupted`` before :class:`JobInterrupted` (or KeyboardInterrupt) goes on, and every
    stage then running is ended. Stages start in :func:`_start_order`, as many at once as
    the cores allow (:func:`_cores`); each one's output goes to a file, printed at its turn
    (as it comes while it runs). **Local**."""
    with tempfile.TemporaryDirectory(prefix="dtensor-test-reports-") as reports:
        parallel = _parallel(opts)
        stages = _stages(tests_dir, modes, opts.ranks, split=parallel)
        starts = _start_order(stages, opts)
        capacity = (os.cpu_count() or 1) if parallel else 1
        running: dict[int, _Beside] = {}
        freed: set[int] = set()
        free = capacity
        started = 0  # how many of ``starts`` have started

        def start_what_fits() -> None:
            nonlocal free, started
            while started < len(starts):
                i = starts[started]
                need = min(_cores(stages[i]), capacity)
                if need > free:
                    return
                stage_env = dict(stage_environment(stages[i], env),
                                 **{REPORT_ENV: str(Path(reports) / f"stage{i}.json")})
                output = Path(reports) / f"stage{i}.out"
                output.touch()
                cmd = _timed(_command(stages[i], mpiexec, pytest_args),
                             Path(reports) / f"stage{i}.cpu")
                running[i] = _Beside(cmd, stage_env, tests_dir, opts.timeout, output)
                free -= need
                started += 1

        def release_ended() -> None:
            nonlocal free
            for i, job in running.items():
                if i not in freed and job.done.is_set():
                    freed.add(i)
                    free += min(_cores(stages[i]), capacity)

        try:
            for turn, stage in enumerate(stages):
                cmd = _command(stage, mpiexec, pytest_args)
                print(f"\n== {_stage_name(stage)} ==\n$ {shlex.join(cmd)}", flush=True)
                begin = time.perf_counter()
                before = set(running)
                if turn not in before:
                    release_ended()
                    start_what_fits()
                if turn in before and parallel:
                    print("(ran beside the stages before it; its output follows)", flush=True)
                job = running.get(turn)
                try:
                    while job is None:  # its cores are still taken by stages that run beside
                        time.sleep(0.2)
                        release_ended()
                        start_what_fits()
                        job = running.get(turn)
                    with open(job.output, "rb") as out:
                        while not job.wait(0.2):  # its output as it comes
                            _copy_new(out)
                            release_ended()
                            start_what_fits()
                        _copy_new(out)
                except (JobInterrupted, KeyboardInterrupt):
                    outcomes.append(Outcome(stage, "interrupted", time.perf_counter() - begin))
                    raise
                release_ended()
                if job.error is not None:
                    raise job.error
                report = _read_report(Path(reports) / f"stage{turn}.json")
                status = classify(job.rc, stage, opts.keyword, report)
                if status == "wrong-mode":
                    print(f"the {stage.mode} stage ran with fastpath: {report['fastpath']}")
                cpu = _read_cpu(Path(reports) / f"stage{turn}.cpu")
                outcomes.append(Outcome(stage, status, job.seconds, report, cpu))
        finally:
            for job in running.values():
                job.stop()


def _copy_new(out) -> None:
    """Write what was added to the open file ``out`` since the last call to stdout."""
    data = out.read()
    if data:
        sys.stdout.flush()
        sys.stdout.buffer.write(data)
        sys.stdout.flush()


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
