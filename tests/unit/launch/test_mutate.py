"""The mutation check (``python -m launch mutate``): its list of mutations, their patches
applied in this process and undone, source mutations compiled with their marker, the
automatic test selection, the plugin's log, how a mutation's runs conclude, the report and
the command line. Two tests start one short pytest run each with a mutation (a rule
mutation and a source mutation served by the import hook)."""

from __future__ import annotations

import itertools
import re
import types
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from helpers import TESTS as TESTS_DIR

from dtensor.debug import validate as V
from dtensor.ops import OPS
from dtensor.ops import samples as S
from launch import _mutant, _select, _source, mutate
from launch.__main__ import USAGE
from launch.mutations import (
    FAMILIES,
    KINDS,
    LAYERS,
    MUTATIONS,
    RULE_KINDS,
    PlanPatch,
    RulePatch,
    Run,
    SourcePatch,
    get,
)
from placements import DTensorSpec, MeshShape, Partial, Replicate, Shard
from placements.errors import ConfigError
from placements.rules import _core, get_rule
from redistribute import plan

RULES_DIR = Path(_core.__file__).parent


# -- the list ------------------------------------------------------------------------------
def test_the_list_covers_every_rule_family_with_every_kind_and_every_layer():
    assert len(MUTATIONS) >= 100
    assert len({m.name for m in MUTATIONS}) == len(MUTATIONS)
    modules = {p.stem for p in RULES_DIR.glob("*.py") if not p.stem.startswith("_")}
    assert set(FAMILIES) == modules | {"plan"}
    have = {(m.family, m.kind) for m in MUTATIONS}
    for family in FAMILIES[:-1]:
        for kind in RULE_KINDS:
            assert (family, kind) in have, (family, kind)
    assert ("plan", "step") in have
    for layer in LAYERS:  # every layer of DESIGN.md has at least two mutations
        assert sum(m.layer == layer for m in MUTATIONS) >= 2, layer
    for m in MUTATIONS:
        assert m.name.startswith(f"{m.family}.{m.kind}.") and m.kind in KINDS, m.name
        assert m.layer in LAYERS and m.description, m.name
        if m.kind == "source":
            assert isinstance(m.patch, SourcePatch) and m.family == m.layer, m.name
            assert m.mode in (None, "python"), m.name
        else:
            assert isinstance(m.patch, PlanPatch if m.family == "plan" else RulePatch), m.name
            assert all(op in OPS for op in getattr(m.patch, "ops", ())), m.name
        assert _source.module_file(m.module).is_file(), m.name


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


# -- source mutations -------------------------------------------------------------------------
@pytest.mark.parametrize("mutation", [m for m in MUTATIONS if m.kind == "source"],
                         ids=lambda m: m.name)
def test_a_source_mutation_changes_one_line_that_runs_inside_a_function(mutation):
    patch = mutation.patch
    source = _source.module_file(patch.module).read_text()
    assert source.count(patch.old) == 1 and patch.new != patch.old
    code, path = patch.code()  # compiles, with the marker before the changed statement
    names = set()
    todo = [code]
    while todo:
        c = todo.pop()
        names |= set(c.co_names)
        todo += [k for k in c.co_consts if hasattr(k, "co_names")]
    assert _source.MARKER in names and str(path).endswith(".py")


def _function(patch, name, module):
    """Function ``name`` of ``patch``'s mutated code, over the globals of the real
    ``module`` and a marker that counts into the returned list (the module's body is not
    run again: its registrations would clash)."""
    code, _ = patch.code()
    assert _source.MARKER not in code.co_names  # the module's body never calls the marker
    fn_code = next(c for c in code.co_consts if getattr(c, "co_name", "") == name)
    fired = []
    env = {**vars(module), _source.MARKER: lambda: fired.append(1)}
    return types.FunctionType(fn_code, env), fired


def test_the_marker_fires_when_the_mutated_statement_runs_and_only_then():
    from placements import layout

    fn, fired = _function(SourcePatch("placements.layout", "    chunk = -(-n // k)\n",
                                      "    chunk = n // k\n"), "shard_range", layout)
    assert not fired
    assert fn(5, 2, 1) == (2, 2) != layout.shard_range(5, 2, 1) == (3, 2)
    assert fired == [1]


def test_the_marker_of_a_mutated_lambda_runs_with_its_body():
    code, _ = get("backward.source.cos_sign").patch.code()
    assert _source.MARKER not in code.co_names  # the module's body (the op records) never
    lambdas = [c for c in code.co_consts if getattr(c, "co_name", "") == "<lambda>"
               and _source.MARKER in c.co_names]
    assert len(lambdas) == 1
    fired = []
    fn = types.FunctionType(lambdas[0], {_source.MARKER: lambda: fired.append(1)})

    class X:
        def sin(self):
            return 3.0

    assert fn(2.0, X()) == 6.0 and fired == [1]  # cos' gradient without its minus sign


@pytest.mark.parametrize("old, new, match", [
    ("no such text", "x", "occurs 0 times"),
    ("return", "return", "the new text is the old one"),
    ("    chunk = -(-n // k)\n", "    chunk = -(-n // k\n", "not valid Python"),
    ('__all__ = [', '__all__ = [  "x",', "inside a function"),
    ("``start = min(i * chunk, n)``", "``start = min(i * chunk, n + 1)``", "inside a string"),
])
def test_a_source_mutation_that_cannot_be_applied_says_why(old, new, match):
    with pytest.raises(_source.MutationError, match=match):
        SourcePatch("placements.layout", old, new).code()
    with pytest.raises(_source.MutationError, match="no source file"):
        _source.module_file("placements.no_such_module")


def test_a_source_mutation_of_an_imported_module_is_refused():
    # the hook serves later imports only: one of a module already imported would never run
    with pytest.raises(_source.MutationError, match="imported before"):
        get("placements.source.chunk_size").patch.install(lambda: None)


# -- the automatic selection -----------------------------------------------------------------
def _tree(root, files):
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_selection_reads_imports_names_helpers_and_the_layer_folder(tmp_path):
    tests = _tree(tmp_path / "tests", {
        "helpers/__init__.py": "",
        "helpers/sim.py": "from placements.layout import local_slices\n",
        "unit/ops/test_direct.py": "import placements.layout\n",
        "unit/ops/test_helper.py": "from helpers.sim import x\n",
        "unit/ops/test_name.py": "import placements as p\np.shard_range(1, 1, 0)\n" + "#" * 50,
        "unit/ops/test_small_name.py": "import placements as p\np.shard_range(1, 1, 0)\n",
        "unit/ops/test_two_names.py": "import placements as p\np.shard_range\np.local_shape\n"
                                      + "#" * 100,
        "unit/placements/test_layer.py": "x = 1\n",
        "unit/ops/test_unrelated.py": "import numpy\nshard_range = 1\n",
        "unit/launch/test_mutate.py": "import placements.layout\n",
        "mpi/ops/test_mpi.py": "from placements.layout import local_shape\n",
    })
    unit, mpi = _select.select(tests, "placements.layout")
    # level 3 (imports, also through a helper), then 2 (names it defines), then 1 (its
    # layer's folder); in a level the file that uses more of its names first, then the
    # smaller; never the mutation machinery's own tests
    assert unit == ["unit/ops/test_helper.py", "unit/ops/test_direct.py",
                    "unit/ops/test_two_names.py", "unit/ops/test_small_name.py",
                    "unit/ops/test_name.py", "unit/placements/test_layer.py"]
    assert mpi == ["mpi/ops/test_mpi.py"]
    assert "shard_range" in _select.public_names("placements.layout")
    assert not any(n.startswith("_") for n in _select.public_names("placements.layout"))


def test_runs_go_lead_files_then_unit_then_mpi_at_two_then_three_ranks():
    m = get("placements.source.chunk_size")
    unit, mpi = _select.select(TESTS_DIR, m.module)
    runs = mutate.runs_for(TESTS_DIR, m)
    two, three = mutate.MPI_RANKS
    assert [(r.ranks, r.lead) for r in runs] == [
        (None, True), (two, True), (None, False), (two, False), (three, False)]
    # the best-matching file of each suite alone first, then the others; every MPI file at 3
    assert runs[0].paths == tuple(unit[:1]) and runs[1].paths == tuple(mpi[:1])
    assert runs[2].paths == tuple(unit[1:]) and runs[3].paths == tuple(mpi[1:])
    assert runs[4].paths == tuple(mpi)
    assert "unit/placements/test_layout.py" in runs[0].paths + runs[2].paths
    assert not any("test_mutate.py" in p for r in runs for p in r.paths)
    assert runs[0].label == "lead unit (1 file)" and runs[3].label.startswith("mpi-2 (")
    rule = mutate.runs_for(TESTS_DIR, get("pointwise.sum.relu_inplace"))
    # the validator groups run with the lead unit file, and only there
    assert rule[0].validate == ("relu_",) and rule[0].lead
    assert not any(r.validate for r in rule[1:])
    assert all(mutate.VALIDATOR_FILE not in r.paths for r in rule)
    assert "unit/placements/test_rules.py" in rule[0].paths + rule[2].paths
    # the nonblocking avg of the executor: its async MPI tests run alone before the unit run
    avg = mutate.runs_for(TESTS_DIR, get("redistribute.source.avg_divisor"))
    assert avg[1].lead and avg[1].paths == ("mpi/redistribute/test_async_redistribute.py",)


def test_a_lead_run_out_of_time_does_not_end_the_mutation(monkeypatch, tmp_path):
    lead = Run(("mpi/ops/test_ops.py",), ranks=2, lead=True)
    seen = []

    def fake_run_one(ctx, mutation, index, run, budget=None):
        seen.append((run.label, round(budget / ctx.budget, 3)))
        status = "budget" if run.lead else "killed"
        return mutate.RunOutcome(run, status, True, 1.0)

    monkeypatch.setattr(mutate, "runs_for", lambda tests, mutation: (lead, UNIT, MPI))
    monkeypatch.setattr(mutate, "run_one", fake_run_one)
    ctx = mutate._Context(TESTS_DIR, tmp_path, "fastpath", 100.0, 90.0)
    result = mutate.run_mutation(ctx, get("placements.source.chunk_size"))
    # the lead run gets a sixth, the unit run two thirds; the unit run then kills it
    assert seen == [("lead mpi-2 (1 file)", 0.167), ("unit (1 file)", 0.667)]
    assert result.status == "killed"


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
UNIT, MPI = Run(("unit/placements/test_rules.py",)), Run(("mpi/ops/test_ops.py",), ranks=2)


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
    assert unnamed.detail == "mpi-2 (1 file)"
    timeout = mutate.conclude(m, [_outcome(MPI, "timeout", True)], 2.0)
    assert timeout.status == "killed" and "stalled" in timeout.detail
    survived = mutate.conclude(m, [_outcome(UNIT, "passed", True), _outcome(MPI, "passed", False)],
                               2.0)
    assert survived.status == "survived" and survived.detail == "SURVIVED"
    # the budget ran out while a run still made progress: not a kill
    cut = mutate.conclude(m, [_outcome(UNIT, "passed", True), _outcome(MPI, "budget", True)], 2.0)
    assert cut.status == "survived" and cut.detail == "SURVIVED (budget spent in mpi-2 (1 file))"
    table = mutate.layer_table([killed, cut, mutate.Result(get("solver.source.pair_cost"),
                                                           "invalid", "never fired", 1.0)])
    assert table[0].split() == ["layer", "killed", "total", "survived", "invalid", "killed", "%"]
    assert [line.split() for line in table[1:]] == [["solver", "0", "1", "0", "1", "0"],
                                                   ["rules", "1", "2", "1", "0", "50"]]
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
                         "--budget", "5", "--stall", "4", "--mode", "python", "--layer", "optim"])
    assert (opts.only, opts.family, opts.budget, opts.stall, opts.mode, opts.layer) == (
        ["a", "b"], ["view", "nn"], 5.0, 4.0, "python", ["optim"])
    defaults = p.parse_args([])
    assert (defaults.list, defaults.only, defaults.family, defaults.mode, defaults.layer,
            defaults.budget) == (False, None, None, "fastpath", None, 180.0)
    with pytest.raises(SystemExit):
        p.parse_args(["--layer", "nope"])
    assert {m.layer for m in mutate.select(p, None, None, ["optim"])} == {"optim"}
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
        mutate.main(["--budget", "0"])
    assert "python -m launch mutate" in USAGE


def test_list_prints_one_line_per_mutation(capsys):
    assert mutate.main(["--list", "--family", "nn"]) == 0
    lines = capsys.readouterr().out.splitlines()
    nn = [m for m in MUTATIONS if m.family == "nn"]
    assert len(lines) == len(nn) + 2 and all(m.name in text for m, text in zip(nn, lines))
    assert lines[len(nn)] == f"{len(nn)} mutations; per layer: rules {len(nn)}"
    assert mutate.main(["--list", "--layer", "kernels"]) == 0
    out = capsys.readouterr().out
    assert "kernels.source.layer_norm_bw_twin  [kernels/source: dtensor.local.kernels.nn, " \
           "python path]" in out


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
    assert ctx.command(Run(("mpi/ops/test_ops.py",), ranks=2),
                       ["mpi/ops/test_ops.py"])[-3:] == ["-p", "launch._mutant", "--with-mpi"]


def test_one_mutation_end_to_end(tmp_path, monkeypatch, capsys):
    """The plugin applies the mutation in a pytest process of its own; the run's output and
    log give the killing test; the report ends with the summary line."""
    m = get("reduction.drop.amax_passthrough")
    monkeypatch.setattr(mutate, "runs_for", lambda tests, mutation: (
        Run(("unit/placements/test_rules.py::test_reduction_candidates",)),))
    rc = mutate.main(["--only", m.name, "--tests-dir", str(TESTS_DIR), "--log-dir", str(tmp_path),
                      "--budget", "120"])
    out = capsys.readouterr().out.splitlines()
    assert rc == 0, out
    row = next(line for line in out if line.startswith(m.name))
    assert "unit/placements/test_rules.py::test_reduction_candidates" in row
    assert out[-1] == "mutations: 1/1 killed"
    assert _mutant.read_log(tmp_path / f"{m.name}.0.log").fired_processes == 1


def test_one_source_mutation_end_to_end(tmp_path, monkeypatch, capsys):
    """The plugin installs the import hook before the product is imported: the test process
    runs the mutated line (its marker fires) and the test fails; the per-layer table counts
    it."""
    m = get("placements.source.chunk_size")
    monkeypatch.setattr(mutate, "runs_for", lambda tests, mutation: (
        Run(("unit/placements/test_layout.py::test_shard_range_errors",
             "unit/placements/test_layout.py::test_shard_range_is_torch_chunk")),))
    rc = mutate.main(["--only", m.name, "--tests-dir", str(TESTS_DIR), "--log-dir", str(tmp_path),
                      "--budget", "120"])
    out = capsys.readouterr().out.splitlines()
    assert rc == 0, out
    row = next(line for line in out if line.startswith(m.name))
    assert "test_shard_range_is_torch_chunk" in row and "placements" in row
    assert any(line.split()[:3] == ["placements", "1", "1"] for line in out)
    assert out[-1] == "mutations: 1/1 killed"
    assert _mutant.read_log(tmp_path / f"{m.name}.0.log").fired_processes == 1
