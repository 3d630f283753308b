"""The mutation check: ``python -m launch mutate``.

This module owns running the mutations of :mod:`launch.mutations` one at a time and reporting
which test run caught ("killed") each. No mutation names its tests: :mod:`launch._select`
derives them from the module the mutation changes (the test files that import it, use the
names it defines, or sit in its layer's test folder), and the runs go cheapest first: the
best-matching unit file alone and the best-matching MPI file alone under ``mpiexec -n 2``
(the *lead* runs), then the other unit files in one pytest process (a rule mutation's
strategy-validator groups run with the lead unit file), the other MPI files under
``mpiexec -n 2``, then every MPI file under ``mpiexec -n 3``. Each run is a pytest process
with the plugin :mod:`launch._mutant` loaded and ``DTENSOR_MUTATION`` naming the mutation,
``-x`` (it stops at the first failure); the first run that fails kills the mutation and the
later runs are skipped.

Every mutation has a time budget (``--budget``, default 180 s) over all its runs, of which
each lead run may take :data:`LEAD_SHARE` and the unit run :data:`UNIT_SHARE` when MPI runs
follow: a run still making progress when
its time is spent is stopped (a unit run's MPI runs still follow, in what is left), and a
mutation that no run killed counts as survived (the report says where time ran out). A run whose output
does not grow for ``--stall`` seconds (default 90) is stopped and counts as a kill (a test
hung: the suite noticed).

A mutation is *invalid*, reported as an error and never counted as killed, when it cannot be
applied (its rule is not registered, its snippet is not in its module exactly once), when it
never fired (it changed no rule answer or plan, or its mutated line never ran, in any process
of its runs: the selection does not exercise it), when no test file was selected, or when a
run failed although it had not fired (a broken run, not a catch).

It prints one row per mutation (name, layer, kind, seconds, result), the survivors with the
analysis recorded in their ``note``, the invalid ones, a table of killed / total per layer, and
ends with the line ``mutations: <killed>/<total> killed``; it exits non-zero when fewer than
:data:`TARGET` of the mutations are killed or any is invalid. SIGINT, SIGTERM or SIGHUP stops
it: the running test job is killed (its process group) and it exits with ``128 + signal``.

Runs use the ``tests`` folder as working directory, like :mod:`launch.runtests`, with the
checkout that holds this package first on ``PYTHONPATH``, so that the test processes import
the mutations and the packages of this tree. Test processes that the tests start themselves
(launcher jobs of ``helpers.jobs``) do not load the plugin and run unmutated.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from . import _mutant, _select
from ._mpiexec import (
    TIMEOUT_EXIT_CODE,
    JobInterrupted,
    find_mpiexec,
    interruptible,
    job_command,
    rank_env,
    run_job,
    stop_job,
)
from .mutations import FAMILIES, KINDS, LAYERS, MUTATIONS, Mutation, RulePatch, Run
from .runtests import MODES, NO_TESTS_EXIT_CODE, Stage, find_tests_dir, stage_environment

__all__ = ["TARGET", "Result", "RunOutcome", "layer_table", "main", "runs_for", "summary_line"]

#: The kill ratio below which the command fails.
TARGET = 0.95
#: MPI rank counts of the MPI runs, in order (2: even shards, 3: uneven ones).
MPI_RANKS = (2, 3)
#: The share of a mutation's budget its unit run may take when MPI runs follow it.
UNIT_SHARE = 2 / 3
#: The share of a mutation's budget each lead run (one file alone) may take.
LEAD_SHARE = 1 / 6
#: The strategy validator's parametrized test, whose groups a run may select by op.
VALIDATOR_FILE = "unit/ops/test_validator.py"
VALIDATOR_TEST = "test_every_candidate_of_every_rule"
#: pytest's exit status for a command-line usage error (a mutation that cannot be applied).
USAGE_EXIT_CODE = 4

_ROOT = Path(__file__).resolve().parent.parent
_FAILED = re.compile(r"^(?:\[rank \d+\] )?(?:FAILED|ERROR) (\S+)", re.MULTILINE)
#: Imports the validator test (its module name as argument, run in the ``tests`` folder).
_GROUPS_PROBE = """\
import importlib, json, sys
t = importlib.import_module(sys.argv[1])
print(json.dumps({op: i for i, group in enumerate(t._GROUPS) for op in group}))
"""


def _module_name(path: str) -> str:
    """The module name of a test file given relative to the ``tests`` folder, which is the
    folder on ``sys.path`` (``unit/ops/test_validator.py``: ``unit.ops.test_validator``)."""
    return path.removesuffix(".py").replace("/", ".")


@dataclass(frozen=True)
class RunOutcome:
    """How one run of a mutation ended.

    ``status``: ``passed``, ``killed``, ``timeout`` (stalled: no output for ``--stall``
    seconds), ``budget`` (stopped when the mutation's budget ran out), ``skipped`` (none of
    its files exist, or no budget was left), ``empty`` (pytest selected no test) or ``error``
    (the mutation could not be applied).
    """

    run: Run
    status: str
    fired: bool
    seconds: float
    failed_test: str = ""
    notes: tuple[str, ...] = ()
    errors: tuple[str, ...] = ()


@dataclass(frozen=True)
class Result:
    """A mutation's outcome: ``killed``, ``survived`` or ``invalid`` (with the reason)."""

    mutation: Mutation
    status: str
    detail: str
    seconds: float
    notes: tuple[str, ...] = ()


def summary_line(results: Sequence[Result]) -> str:
    """The report's last line: ``mutations: <killed>/<total> killed``. **Local**."""
    killed = sum(r.status == "killed" for r in results)
    return f"mutations: {killed}/{len(results)} killed"


def passes(results: Sequence[Result]) -> bool:
    """Whether the check passes: no invalid mutation and at least TARGET killed. **Local**."""
    if not results or any(r.status == "invalid" for r in results):
        return False
    return sum(r.status == "killed" for r in results) >= TARGET * len(results)


def conclude(mutation: Mutation, outcomes: Sequence[RunOutcome], seconds: float) -> Result:
    """The result of a mutation from its runs' outcomes (in order; the last one decided).

    **Local.** See the module docstring for what makes a mutation invalid.
    """
    notes = tuple(n for o in outcomes for n in o.notes)
    for o in outcomes:
        if o.errors:
            msg = "; ".join(o.errors)
            return Result(mutation, "invalid", f"cannot apply: {msg}", seconds, notes)
        if o.status in ("killed", "timeout"):
            if not o.fired:
                return Result(
                    mutation, "invalid", f"{o.run.label} failed but the mutation never fired",
                    seconds, notes,
                )
            if o.status == "timeout":
                how = f"{o.run.label} (stalled: no output)"
            elif o.failed_test:
                how = f"{o.run.label.split()[0]} {o.failed_test}"
            else:
                how = o.run.label
            return Result(mutation, "killed", how, seconds, notes)
    if not any(o.fired for o in outcomes):
        ran = [o for o in outcomes if o.status not in ("skipped", "empty")]
        why = "never fired" if ran else "no test ran"
        cut = [o for o in outcomes if o.status == "budget"]
        if cut:
            why += f" (time ran out in {cut[-1].run.label})"
        return Result(mutation, "invalid", why, seconds, notes)
    cut = [o for o in outcomes if o.status == "budget"]
    how = f"SURVIVED (budget spent in {cut[0].run.label})" if cut else "SURVIVED"
    return Result(mutation, "survived", how, seconds, notes)


class _Context:
    """What every run of one invocation shares: folders, mpiexec, environment, timeout."""

    def __init__(self, tests_dir: Path, log_dir: Path, mode: str, budget: float,
                 stall: float = 90.0) -> None:
        self.tests_dir = tests_dir
        self.log_dir = log_dir
        self.mode = mode
        self.budget = budget
        self.stall = stall
        self.mpiexec = ""  # found by main() when a selected run needs it
        path = os.environ.get("PYTHONPATH")
        self.env = rank_env(PYTHONPATH=str(_ROOT) + (":" + path if path else ""),
                            PYTHONUNBUFFERED="1")
        self._groups: dict[str, int] | None = None

    def validator_groups(self) -> dict[str, int]:
        """Op name -> index of its group in the validator test (empty when unknown)."""
        if self._groups is None:
            out = subprocess.run(
                [sys.executable, "-c", _GROUPS_PROBE, _module_name(VALIDATOR_FILE)],
                cwd=self.tests_dir, env=self.env, capture_output=True, text=True, timeout=300,
                check=False,
            )
            self._groups = json.loads(out.stdout) if out.returncode == 0 else {}
        return self._groups

    def resolve(self, run: Run) -> tuple[list[str], list[str]]:
        """The pytest paths of ``run`` that exist, and notes on what was left out."""
        paths, notes = [], []
        for p in run.paths:
            if (self.tests_dir / p.split("::")[0]).exists():
                paths.append(p)
            else:
                notes.append(f"{p} missing")
        if run.validate:
            groups = self.validator_groups()
            if not (self.tests_dir / VALIDATOR_FILE).exists():
                notes.append(f"{VALIDATOR_FILE} missing")
            elif any(op in groups for op in run.validate):  # an in-place twin may have none
                ids = sorted({groups[op] for op in run.validate if op in groups})
                paths += [f"{VALIDATOR_FILE}::{VALIDATOR_TEST}[{i}]" for i in ids]
            else:
                notes.append(f"validator groups unknown: all of {VALIDATOR_FILE}")
                paths.append(VALIDATOR_FILE)
        return paths, notes

    def command(self, run: Run, paths: list[str]) -> list[str]:
        pytest = ["-m", "pytest", *paths, "-q", "-x", "-p", "no:cacheprovider",
                  "-p", "launch._mutant"]
        if run.ranks is None:
            return [sys.executable, *pytest]
        return job_command(self.mpiexec, run.ranks, [*pytest, "--with-mpi"])


def runs_for(tests_dir: Path, mutation: Mutation) -> tuple[Run, ...]:
    """The runs that judge ``mutation``, in order. **Local**.

    First the *lead* runs: the best-matching unit file alone (with a rule mutation's
    validator groups, instead of the whole validator file), then the best-matching MPI file
    alone at the first of :data:`MPI_RANKS`; then the other unit files in one run, the
    other MPI files at that rank count, and every MPI file at each further rank count. A
    lead run is cheap (one file) and the selection puts the likeliest judge first, so a
    mutation that only an MPI file reaches is judged before the broad unit run spends the
    budget; a suite with one file has no lead run of its own."""
    unit, mpi = _select.select(tests_dir, mutation.module)
    ops: tuple[str, ...] = ()
    if isinstance(mutation.patch, RulePatch):
        ops = mutation.patch.ops
        unit = [p for p in unit if p != VALIDATOR_FILE]
    first, *others = MPI_RANKS
    runs: list[Run] = []
    lead_unit, lead_mpi = len(unit) > 1, len(mpi) > 1
    if lead_unit:
        runs.append(Run(tuple(unit[:1]), validate=ops, lead=True))
    if lead_mpi:
        runs.append(Run(tuple(mpi[:1]), ranks=first, lead=True))
    if unit or (ops and not lead_unit):
        rest = unit[1:] if lead_unit else unit
        runs.append(Run(tuple(rest), validate=() if lead_unit else ops))
    if mpi:
        runs.append(Run(tuple(mpi[1:] if lead_mpi else mpi), ranks=first))
        runs += [Run(tuple(mpi), ranks=k) for k in others]
    return tuple(runs)


class _Watch:
    """Stops a job whose output file has not grown for ``stall`` seconds."""

    def __init__(self, out: Path, stall: float) -> None:
        self.out, self.stall = out, stall
        self.stalled = False
        self._done = threading.Event()
        self._proc = None

    def started(self, proc) -> None:
        self._proc = proc
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        size, since = -1, time.monotonic()
        while not self._done.wait(1.0):
            now = self.out.stat().st_size if self.out.exists() else 0
            if now != size:
                size, since = now, time.monotonic()
            elif time.monotonic() - since > self.stall:
                self.stalled = True
                stop_job(self._proc)
                return

    def done(self) -> None:
        self._done.set()


def run_one(ctx: _Context, mutation: Mutation, index: int, run: Run,
            budget: float | None = None) -> RunOutcome:
    """Run ``run`` (the ``index``-th of ``mutation``) within ``budget`` seconds (default the
    context's) and classify how it ended. **Local**."""
    paths, notes = ctx.resolve(run)
    if not paths:
        return RunOutcome(run, "skipped", False, 0.0, notes=tuple(notes))
    log = ctx.log_dir / f"{mutation.name}.{index}.log"
    out = ctx.log_dir / f"{mutation.name}.{index}.out"
    suite = "unit" if run.ranks is None else "mpi"
    mode = mutation.mode or ctx.mode
    env = stage_environment(Stage(suite, run.ranks, mode, ctx.tests_dir / suite), ctx.env)
    env.update({_mutant.NAME_VAR: mutation.name, _mutant.LOG_VAR: str(log)})
    watch = _Watch(out, ctx.stall)
    start = time.perf_counter()
    with open(out, "wb") as sink:
        try:
            rc = run_job(ctx.command(run, paths), env=env, cwd=ctx.tests_dir,
                         timeout=ctx.budget if budget is None else budget, output=sink,
                         started=watch.started)
        finally:
            watch.done()
    seconds = time.perf_counter() - start
    logged = _mutant.read_log(log)
    fired = logged.fired_processes > 0
    errors = logged.errors
    if rc == USAGE_EXIT_CODE and not errors:
        errors = (f"pytest stopped with a usage error (see {out})",)
    if errors:
        status = "error"
    elif watch.stalled:
        status = "timeout"
        notes.append(f"{run.label}: no output for {ctx.stall:g} s")
    elif rc == 0:
        status = "passed"
    elif rc == TIMEOUT_EXIT_CODE:
        status = "budget"
    elif rc == NO_TESTS_EXIT_CODE:
        status = "empty"
        notes.append(f"{run.label}: no test selected")
    else:
        status = "killed"
    found = _FAILED.search(out.read_text(errors="replace")) if status == "killed" else None
    return RunOutcome(run, status, fired, seconds, found.group(1) if found else "",
                      tuple(notes), errors)


def run_mutation(ctx: _Context, mutation: Mutation) -> Result:
    """Run ``mutation``'s selected runs until one kills it or its budget is spent; its
    result. **Local**."""
    start = time.perf_counter()
    runs = runs_for(ctx.tests_dir, mutation)
    if not runs:
        return Result(mutation, "invalid", "no test file selected", 0.0)
    outcomes = []
    for i, run in enumerate(runs):
        left = ctx.budget - (time.perf_counter() - start)
        if left <= 1:
            break
        if run.lead:  # one file: a share that leaves the broad runs theirs
            left = min(left, LEAD_SHARE * ctx.budget)
        elif run.ranks is None and len(runs) > 1:  # leave the MPI runs their share
            left = min(left, UNIT_SHARE * ctx.budget)
        outcome = run_one(ctx, mutation, i, run, left)
        outcomes.append(outcome)
        if outcome.status in ("killed", "timeout", "error") or (
                outcome.status == "budget" and run.ranks is not None and not run.lead):
            break
    return conclude(mutation, outcomes, time.perf_counter() - start)


def layer_table(results: Sequence[Result]) -> list[str]:
    """The per-layer table of the report: killed / total (survived, invalid) per layer of
    :data:`launch.mutations.LAYERS` that has a result, in that order. **Local**."""
    rows = [("layer", "killed", "total", "survived", "invalid", "killed %")]
    for layer in LAYERS:
        mine = [r for r in results if r.mutation.layer == layer]
        if not mine:
            continue
        k = sum(r.status == "killed" for r in mine)
        rows.append((layer, str(k), str(len(mine)),
                     str(sum(r.status == "survived" for r in mine)),
                     str(sum(r.status == "invalid" for r in mine)),
                     f"{100 * k / len(mine):.0f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [_row(r, widths) for r in rows]


def _row(cells: Sequence[str], widths: Sequence[int]) -> str:
    return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()


def select(
    parser: argparse.ArgumentParser, only: Sequence[str] | None, families: Sequence[str] | None,
    layers: Sequence[str] | None = None,
) -> list[Mutation]:
    """The mutations ``--only``, ``--family`` and ``--layer`` select (all by default), in
    list order."""
    known = {m.name for m in MUTATIONS}
    unknown = [n for n in only or () if n not in known]
    if unknown:
        parser.error(f"unknown mutation(s) {unknown}; --list shows them")
    chosen = [
        m for m in MUTATIONS
        if (not only or m.name in only) and (not families or m.family in families)
        and (not layers or m.layer in layers)
    ]
    if not chosen:
        parser.error("no mutation selected")
    return chosen


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m launch mutate",
        description="Apply each mutation (launch/mutations.py: sharding rules, redistribute "
        "plans, one-line bugs in product modules of every layer) and run the tests selected "
        "from the module it changes; report which run killed each and killed/total per "
        f"layer. Fails below {TARGET:.0%} killed or when a mutation is invalid.",
    )
    p.add_argument("--list", action="store_true", help="list the mutations and exit")
    p.add_argument("--only", nargs="+", metavar="NAME", help="only these mutations")
    p.add_argument(
        "--family", action="append", choices=FAMILIES, metavar="F",
        help=f"only this family (repeatable): {', '.join(FAMILIES)}",
    )
    p.add_argument(
        "--layer", action="append", choices=tuple(LAYERS), metavar="L",
        help=f"only this layer (repeatable): {', '.join(LAYERS)}",
    )
    p.add_argument(
        "--budget", type=float, default=180.0, metavar="S",
        help="time budget of each mutation over all its runs, in seconds (default 180; its "
        "unit run takes at most two thirds of it when MPI runs follow); a mutation not "
        "killed when it is spent survives",
    )
    p.add_argument(
        "--stall", type=float, default=90.0, metavar="S",
        help="a run whose output does not grow for S seconds is stopped and counts as a kill "
        "(default 90)",
    )
    p.add_argument(
        "--mode", choices=tuple(MODES), default="fastpath",
        help="fastpath (DTENSOR_FASTPATH=1, the default) or python (DTENSOR_FASTPATH=0)",
    )
    p.add_argument("--tests-dir", type=Path, default=None, metavar="DIR",
                   help="the tests folder (default: ./tests of the checkout)")
    p.add_argument("--log-dir", type=Path, default=None, metavar="DIR",
                   help="where each run's output and mutation log go (default: a new "
                   "temporary folder)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the mutation check and print its report; 0 only when it passes.

    **Local** (each MPI run starts its own ``mpiexec`` job).

    Parameters
    ----------
    argv : sequence of str, optional
        The command line after ``mutate``; default ``sys.argv[1:]``.
    """
    parser = _parser()
    opts = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    for flag in ("budget", "stall"):
        if getattr(opts, flag) <= 0:
            parser.error(f"--{flag} must be positive, got {getattr(opts, flag):g}")
    chosen = select(parser, opts.only, opts.family, opts.layer)
    if opts.list:
        for m in chosen:
            mode = f", {m.mode} path" if m.mode else ""
            print(f"{m.name}  [{m.layer}/{m.kind}: {m.module}{mode}]  {m.description}")
        counts = {la: sum(m.layer == la for m in chosen) for la in LAYERS}
        print(f"{len(chosen)} mutations; per layer: "
              + ", ".join(f"{la} {n}" for la, n in counts.items() if n))
        print("kinds: " + "; ".join(f"{k}: {v}" for k, v in KINDS.items()))
        return 0
    tests_dir = opts.tests_dir.resolve() if opts.tests_dir else find_tests_dir(Path.cwd())
    if tests_dir is None or not tests_dir.is_dir():
        parser.error("no tests folder found (run from the checkout, or pass --tests-dir)")
    log_dir = opts.log_dir or Path(tempfile.mkdtemp(prefix="dtensor-mutate-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    ctx = _Context(tests_dir, log_dir, opts.mode, opts.budget, opts.stall)
    try:
        ctx.mpiexec = find_mpiexec()
    except FileNotFoundError as exc:
        parser.error(str(exc))
    print(f"{len(chosen)} mutations, {opts.mode} path, budget {opts.budget:g} s each, tests "
          f"{tests_dir}, logs {log_dir}")
    widths = [max(len(m.name) for m in chosen), 12, 6, 7, 0]
    print(_row(["mutation", "layer", "kind", "seconds", "result"], widths), flush=True)
    start = time.perf_counter()
    results = []
    try:
        with interruptible():
            for m in chosen:
                r = run_mutation(ctx, m)
                results.append(r)
                result = r.detail if r.status != "invalid" else f"INVALID: {r.detail}"
                if r.notes:
                    result += f" (skipped: {'; '.join(r.notes)})"
                print(_row([m.name, m.layer, m.kind, f"{r.seconds:.1f}", result], widths),
                      flush=True)
    except (JobInterrupted, KeyboardInterrupt) as exc:
        stop = exc if isinstance(exc, JobInterrupted) else JobInterrupted(signal.SIGINT)
        print(f"launch mutate: {stop} during mutation {m.name} (its test run killed); no "
              "further mutation runs", file=sys.stderr, flush=True)
        return stop.status
    survivors = [r for r in results if r.status == "survived"]
    invalid = [r for r in results if r.status == "invalid"]
    if survivors:
        print("\nsurvivors:")
        for r in survivors:
            print(f"  {r.mutation.name}: {r.mutation.description}\n"
                  f"    reason: {r.mutation.note or 'not analysed yet'}")
    if invalid:
        print("\ninvalid (errors, not counted as killed):")
        for r in invalid:
            print(f"  {r.mutation.name}: {r.detail}")
            if r.mutation.note:
                print(f"    note: {r.mutation.note}")
    print("\nper layer:")
    for line in layer_table(results):
        print("  " + line)
    print(f"\nwall time {time.perf_counter() - start:.0f} s")
    print(summary_line(results), flush=True)
    return 0 if passes(results) else 1
