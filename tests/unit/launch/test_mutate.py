"""The mutation check (``python -m launch mutate``): its list of mutations, their patches
applied in this process and undone, the plugin's log, how a mutation's runs conclude, the
report and the command line. One test starts one short pytest run with a mutation."""

from __future__ import annotations

import itertools
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from helpers import TESTS as TESTS_DIR

from dtensor.debug import validate as V
from dtensor.ops import OPS
from dtensor.ops import samples as S
from launch import _mutant, mutate
from launch.__main__ import USAGE
from launch.mutations import (
    FAMILIES,
    KINDS,
    MUTATIONS,
    RULE_KINDS,
    PlanPatch,
    RulePatch,
    Run,
    get,
)
from placements import DTensorSpec, MeshShape, Partial, Replicate, Shard
from placements.errors import ConfigError
from placements.rules import _core, get_rule
from redistribute import plan

RULES_DIR = Path(_core.__file__).parent


# -- the list ------------------------------------------------------------------------------
def test_the_list_covers_every_rule_family_with_every_kind():
    assert len(MUTATIONS) >= 50
    assert len({m.name for m in MUTATIONS}) == len(MUTATIONS)
    modules = {p.stem for p in RULES_DIR.glob("*.py") if not p.stem.startswith("_")}
    assert set(FAMILIES) == modules | {"plan"}
    have = {(m.family, m.kind) for m in MUTATIONS}
    for family in FAMILIES[:-1]:
        for kind in RULE_KINDS:
            assert (family, kind) in have, (family, kind)
    assert ("plan", "step") in have
    for m in MUTATIONS:
        assert m.name.startswith(f"{m.family}.{m.kind}.") and m.kind in KINDS, m.name
        assert isinstance(m.patch, PlanPatch if m.family == "plan" else RulePatch), m.name
        assert m.runs and m.description, m.name
        for run in m.runs:
            suite = "unit" if run.ranks is None else "mpi"
            assert all(p.startswith(f"{suite}/") for p in run.paths), (m.name, run)
            assert not run.validate or run.ranks is None, (m.name, run)
            assert all(op in OPS for op in run.validate), (m.name, run)


def test_get_names_the_command_that_lists_mutations():
    assert get(MUTATIONS[0].name) is MUTATIONS[0]
    with pytest.raises(ConfigError, match="no mutation named 'nope'.*--list"):
        get("nope")


# -- patches applied in this process --------------------------------------------------------
def _schemas(op):
    """The rule inputs of the strategy validator's sample calls of ``op`` (quick shapes), on
    a 1-D and a 2-D mesh."""
    info = OPS[op]
    out = []
    for case in S.cases(info, S.Gen(0), S.QUICK_SHAPES):
        call = V._bind(info, case)
        if call is not None:
            out += [V._schema(call, mesh, [None] * len(call.slots)) for mesh in ((2,), (2, 2))]
    return out


def _answers(schemas):
    out = []
    for s in schemas:
        try:
            out.append(get_rule(s.op)(s))
        except Exception as exc:  # noqa: BLE001 - a sample the rule refuses: compare the error
            out.append(repr(exc))
    return out


@pytest.mark.parametrize(
    "mutation", [m for m in MUTATIONS if isinstance(m.patch, RulePatch)], ids=lambda m: m.name
)
def test_a_rule_mutation_changes_its_rules_only_until_undone(mutation):
    schemas = [s for op in mutation.patch.ops for s in _schemas(op)]
    before = _answers(schemas)
    rules = dict(_core._RULES)
    fired = []
    undo = mutation.patch.apply(lambda: fired.append(1))
    try:
        changed = [op for op in rules if _core._RULES[op] is not rules[op]]
        assert changed == list(mutation.patch.ops)
        during = _answers(schemas)
    finally:
        undo()
    assert fired and len(fired) == sum(a != b for a, b in zip(before, during))
    assert _core._RULES == rules
    assert _answers(schemas) == before


def _plans():
    out = []
    pls = (Replicate(), Shard(0), Shard(1), Partial("sum"), Partial("max"))
    for mesh_shape in ((2,), (2, 2)):
        mesh = MeshShape(mesh_shape)
        for src, dst in itertools.product(itertools.product(pls, repeat=len(mesh_shape)),
                                          repeat=2):
            spec = DTensorSpec(mesh, src, (4, 6), np.dtype(np.float32))
            out.append((spec, dst))
    return out


@pytest.mark.parametrize(
    "mutation", [m for m in MUTATIONS if isinstance(m.patch, PlanPatch)], ids=lambda m: m.name
)
def test_a_plan_mutation_removes_steps_only_until_undone(mutation):
    pairs = _plans()
    before = [plan(spec, dst) for spec, dst in pairs]
    fired = []
    undo = mutation.patch.apply(lambda: fired.append(1))
    try:
        during = [plan(spec, dst) for spec, dst in pairs]
    finally:
        undo()
    assert fired and len(fired) == sum(a != b for a, b in zip(before, during))
    for old, new in zip(before, during):  # steps removed, none added or reordered
        it = iter(old)
        assert all(step in it for step in new), (old, new)
    assert [plan(spec, dst) for spec, dst in pairs] == before


def test_a_mutation_of_an_unregistered_rule_cannot_be_applied():
    patch = replace(MUTATIONS[0].patch, ops=("no_such_op",))
    with pytest.raises(ConfigError, match="no_such_op"):
        patch.apply(lambda: None)
    assert "no_such_op" not in _core._RULES


# -- the plugin's log -------------------------------------------------------------------------
def test_the_plugin_logs_the_first_firing_at_once_and_the_count_at_the_end(
    tmp_path, monkeypatch
):
    log = tmp_path / "m.log"
    monkeypatch.setenv(_mutant.NAME_VAR, "pointwise.sum.abs")
    monkeypatch.setenv(_mutant.LOG_VAR, str(log))
    schema = _schemas("abs")[0]
    _mutant.pytest_configure(None)
    try:
        get_rule("abs")(schema)
        assert _mutant.read_log(log) == _mutant.LogSummary(0, 1, ())  # fired, still running
        get_rule("abs")(schema)
    finally:
        _mutant.pytest_unconfigure(None)
    assert _mutant.read_log(log) == _mutant.LogSummary(2, 1, ())
    assert get_rule("abs")(schema) == _answers([schema])[0]  # undone


def test_the_plugin_logs_a_mutation_it_cannot_apply(tmp_path, monkeypatch):
    log = tmp_path / "m.log"
    monkeypatch.setenv(_mutant.NAME_VAR, "no.such.mutation")
    monkeypatch.setenv(_mutant.LOG_VAR, str(log))
    with pytest.raises(pytest.UsageError, match="no.such.mutation"):
        _mutant.pytest_configure(None)
    summary = _mutant.read_log(log)
    assert summary.fired_processes == 0 and "no.such.mutation" in summary.errors[0]
    _mutant.pytest_unconfigure(None)  # nothing applied: nothing to undo
    assert _mutant.read_log(tmp_path / "absent.log") == _mutant.LogSummary(0, 0, ())


def test_the_plugin_does_nothing_without_a_mutation(monkeypatch):
    monkeypatch.delenv(_mutant.NAME_VAR, raising=False)
    rules = dict(_core._RULES)
    _mutant.pytest_configure(None)
    _mutant.pytest_unconfigure(None)
    assert _core._RULES == rules


# -- concluding a mutation from its runs -------------------------------------------------------
UNIT, MPI = Run(("unit/placements/test_rules.py",)), Run(("mpi/ops/test_ops.py",), "relu", ranks=2)


def _outcome(run, status, fired, **kw):
    return mutate.RunOutcome(run, status, fired, 1.0, **kw)


def test_a_mutation_that_never_fired_is_invalid_not_counted():
    m = MUTATIONS[0]
    result = mutate.conclude(m, [_outcome(UNIT, "passed", False), _outcome(MPI, "passed", False)],
                             2.0)
    assert (result.status, result.detail) == ("invalid", "never fired")
    result = mutate.conclude(m, [_outcome(UNIT, "skipped", False, notes=("x missing",))], 0.0)
    assert (result.status, result.detail, result.notes) == ("invalid", "no test ran",
                                                            ("x missing",))
    # a failure without a firing is a broken run, not a catch
    result = mutate.conclude(m, [_outcome(UNIT, "killed", False)], 1.0)
    assert result.status == "invalid" and "never fired" in result.detail
    result = mutate.conclude(m, [_outcome(UNIT, "error", False, errors=("no rule",))], 1.0)
    assert result.status == "invalid" and "no rule" in result.detail
    assert mutate.summary_line([result]) == "mutations: 0/1 killed"
    assert not mutate.passes([result])


def test_kills_survivors_and_the_last_line():
    m = MUTATIONS[0]
    killed = mutate.conclude(
        m, [_outcome(UNIT, "passed", True),
            _outcome(MPI, "killed", True, failed_test="mpi/ops/test_ops.py::test_unary")], 2.0)
    assert killed.status == "killed"
    assert killed.detail == "mpi-2 mpi/ops/test_ops.py::test_unary"
    unnamed = mutate.conclude(m, [_outcome(MPI, "killed", True)], 2.0)
    assert unnamed.detail == "mpi-2 test_ops.py -k relu"
    timeout = mutate.conclude(m, [_outcome(MPI, "timeout", True)], 2.0)
    assert timeout.status == "killed" and "(timeout)" in timeout.detail
    survived = mutate.conclude(m, [_outcome(UNIT, "passed", True), _outcome(MPI, "passed", False)],
                               2.0)
    assert survived.status == "survived"
    results = [killed] * 19 + [survived]
    line = mutate.summary_line(results)
    assert line == "mutations: 19/20 killed"
    assert re.fullmatch(r"mutations: \d+/\d+ killed", line)
    assert mutate.passes(results)  # 95 %
    assert not mutate.passes(results[1:])  # 18/19 < 95 %
    assert not mutate.passes([])


# -- the command line ------------------------------------------------------------------------
def test_options_and_selection():
    p = mutate._parser()
    opts = p.parse_args(["--only", "a", "b", "--family", "view", "--family", "nn",
                         "--timeout", "5", "--mode", "python"])
    assert (opts.only, opts.family, opts.timeout, opts.mode) == (["a", "b"], ["view", "nn"],
                                                                 5.0, "python")
    defaults = p.parse_args([])
    assert (defaults.list, defaults.only, defaults.family, defaults.mode) == (
        False, None, None, "fastpath")
    with pytest.raises(SystemExit):
        p.parse_args(["--family", "nope"])
    assert [m.family for m in mutate.select(p, None, ["plan"])] == ["plan"] * sum(
        m.family == "plan" for m in MUTATIONS)
    names = [MUTATIONS[3].name, MUTATIONS[1].name]
    assert [m.name for m in mutate.select(p, names, None)] == names[::-1]  # list order
    with pytest.raises(SystemExit):
        mutate.select(p, ["nope"], None)
    with pytest.raises(SystemExit):
        mutate.select(p, [MUTATIONS[0].name], ["plan"])  # nothing left
    with pytest.raises(SystemExit):
        mutate.main(["--timeout", "0"])
    assert "python -m launch mutate" in USAGE


def test_list_prints_one_line_per_mutation(capsys):
    assert mutate.main(["--list", "--family", "nn"]) == 0
    lines = capsys.readouterr().out.splitlines()
    nn = [m for m in MUTATIONS if m.family == "nn"]
    assert len(lines) == len(nn) + 1 and all(m.name in text for m, text in zip(nn, lines))


def test_runs_skip_missing_files_and_select_validator_groups(tmp_path):
    ctx = mutate._Context(TESTS_DIR, tmp_path, "fastpath", 60.0)
    ctx.mpiexec = "mpiexec"
    ctx._groups = {"relu": 3, "exp": 1}
    paths, notes = ctx.resolve(Run(("unit/placements/test_rules.py", "mpi/test_not_yet.py"),
                                   validate=("relu", "exp")))
    assert paths == ["unit/placements/test_rules.py",
                     f"{mutate.VALIDATOR_FILE}::{mutate.VALIDATOR_TEST}[1]",
                     f"{mutate.VALIDATOR_FILE}::{mutate.VALIDATOR_TEST}[3]"]
    assert notes == ["mpi/test_not_yet.py missing"]
    paths, notes = ctx.resolve(Run(("unit/placements/test_rules.py",), validate=("gelu",)))
    assert paths[-1] == mutate.VALIDATOR_FILE and "unknown" in notes[0]
    assert ctx.command(Run(("mpi/ops/test_ops.py",), "relu", ranks=2),
                       ["mpi/ops/test_ops.py"])[-5:] == [
        "-p", "launch._mutant", "-k", "relu", "--with-mpi"]


def test_one_mutation_end_to_end(tmp_path, monkeypatch, capsys):
    """The plugin applies the mutation in a pytest process of its own; the run's output and
    log give the killing test; the report ends with the summary line."""
    m = replace(get("reduction.drop.amax_passthrough"),
                runs=(Run(("unit/placements/test_rules.py::test_reduction_candidates",)),))
    monkeypatch.setattr(mutate, "MUTATIONS", (m,))
    rc = mutate.main(["--only", m.name, "--tests-dir", str(TESTS_DIR), "--log-dir", str(tmp_path),
                      "--timeout", "120"])
    out = capsys.readouterr().out.splitlines()
    assert rc == 0, out
    row = next(line for line in out if line.startswith(m.name))
    assert "unit/placements/test_rules.py::test_reduction_candidates" in row
    assert out[-1] == "mutations: 1/1 killed"
    assert _mutant.read_log(tmp_path / f"{m.name}.0.log").fired_processes == 1
