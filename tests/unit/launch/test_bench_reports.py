"""The reports of the benchmarks and of the strategy sweep: every script's ``--help`` shows
its defaults; every benchmark, run in its smallest mode, prints a table (the shared
:func:`launch.bench._common.table`) besides its JSON and progress lines on stderr; the
shared helpers (table layout, cells, progress lines, charts) do what they say, and a chart
that cannot be drawn (no matplotlib) is said so, in every script that draws one.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
from pathlib import Path

import pytest
from helpers import ROOT
from helpers.jobs import child_env, run_group

from launch.bench import _common

BENCH = sorted(p.stem for p in (ROOT / "launch" / "bench").glob("[!_]*.py"))
SCRIPTS = [*(f"launch.bench.{b}" for b in BENCH), "launch.experiments.strategy_sweep"]

#: Per benchmark: its smallest mode (one rank) and words of its table's header.
SMALLEST = {
    "abstract_plan": ("--repeat 1 --models mlp", "model mesh  step s"),
    "activation_checkpoint": ("--layers 1 --batch 64 --width 32 --hidden 64",
                              "variant       peak MiB"),
    "allocator": ("--repeat 1", "size   pooled us"),
    "autograd_overhead": ("--repeat 1", "no_grad us  leaf us"),
    "checkpoint": ("--mib 1 --repeat 1 --dir {tmp}", "operation            median s"),
    "ddp_buckets": (("--d-model 64 --layers 1 --block 8 --vocab 64 --batch 1 --repeat 1 "
                    "--caps 1"), "side            step ms"),
    "fsdp": (("--d-model 32 --layers 1 --seq 8 --vocab 64 --batch 1 --heads 2 --repeat 1 "
             "--strategies dp,fsdp"), "strategy  state MiB"),
    "fsdp_parts": ("--model tiny --repeat 1 --micro 1 --strategies dp,fsdp-nopool,fsdp",
                   "strategy  rank  wall ms  fwd ms"),
    "gpt_predict": ("--models tiny --strategies local,fsdp --batch 2",
                    "model  strategy  peak pred  peak meas"),
    "gpt_vs_torch": (("--model tiny --steps 2 --warmup 1 --strategy local --no-memory "
                      "--no-torch"), "| mode | dtensor | torch | dtensor ms |"),
    "index_check": ("--repeat 2", "| case | µs per call (median) | fastest sample |"),
    "implicit_tp": ("--layers 1 --dim 32 --heads 2 --seq 8 --vocab 32 --batch 2 --repeat 1",
                    "layout    step ms  collectives"),
    "kernels": ("--sizes 8 --repeat 1 --ops exp", "| op | shape | ours | numpy |"),
    "mesh_create": ("--repeat 2", "median us  min us"),
    "overlap": (("--repeat 1 --number 20 --iters 2 --matmul 16 --small 8 --medium 16 "
                "--large 32 --delay-ms 1"), "blocking us/iter"),
    "peak": ("--sizes 64 --repeat 1", " n  GFLOP/s"),
    "pipeline": (("--micro 1,2 --repeat 1 --d-model 32 --seq 8 --batch 4 --layers-per-stage 1 "
                  "--schedules gpipe,1f1b --timeline --png {tmp}/pipe.png"),
                 "schedule  m  step ms  bubble  expected"),
    "propagation": ("--number 5 --repeat 1", "cold miss us  miss us  hit us"),
    "redistribute": ("--sizes 8 --repeat 2", "dtensor us  python us  execute us"),
    "reductions": ("--sizes 8 --repeat 2", "all-reduce      median us"),
    "ring_attention": ("--seqs 16 --heads 2 --head-dim 8 --repeat 1",
                       "seq  ring s  gathered s  serial s"),
    "size_sweep": ("--sizes 8 --quick --budget 0.001 --no-torch --ops add,matmul",
                   "| op | pl | N | ours | numpy |"),
    "small_ops": ("--no-torch --repeat 2", "numpy us  fast us  python us"),
    "train_step": ("--sizes 8 --budget 0.001 --repeat 2 --no-torch",
                   "| N | ours step | torch step |"),
    "vocab_parallel": ("--rows 16 --classes 256 --repeat 2", "strategy        median ms"),
}
#: Needs two ranks: its table is checked by test_examples' calibration job.
TWO_RANKS = {"calibrate"}
#: A text table's rule (``----  ---``) or a markdown table's (``|---|---:|``).
RULE = re.compile(r"^(-+(  -+)*|\|(:?-{3,}:?\|)+)$", re.MULTILINE)


# -- --help ---------------------------------------------------------------------------------------
class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def _parser_of(module_name: str, monkeypatch) -> argparse.ArgumentParser:
    """The argument parser a script's ``main`` builds (caught at its ``parse_args``)."""
    module = importlib.import_module(module_name)

    def catch(self, *args, **kwargs):
        raise _Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    with pytest.raises(_Parsed) as got:
        module.main([])
    return got.value.parser


@pytest.mark.mode_independent  # command lines
@pytest.mark.parametrize("module_name", SCRIPTS)
def test_help_shows_every_default(module_name, monkeypatch):
    """Every option has a help text and ``--help`` shows its default (options that default
    to off or to nothing show none)."""
    parser = _parser_of(module_name, monkeypatch)
    assert issubclass(parser.formatter_class, _common.HelpFormatter)
    formatter = parser._get_formatter()
    text = parser.format_help()
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS:
            continue
        assert action.help and action.help.strip(), (module_name, action.option_strings)
        shown = formatter._get_help_string(action)
        if action.default in (None, False, argparse.SUPPRESS):
            assert shown == action.help, (module_name, action.option_strings)
        else:
            assert "(default: " in shown, (module_name, action.option_strings)
            value = shown.rsplit("(default: ", 1)[1].rstrip(")").replace("%%", "%")
            assert "".join(value.split()) in "".join(text.split()), (module_name, value)
    assert "--quiet" in text, module_name  # every script prints progress lines


def test_help_formatter_writes_list_defaults_as_typed():
    p = _common.parser("x")
    p.add_argument("--sizes", type=int, nargs="+", default=[8, 2048], help="N")
    p.add_argument("--caps", default=(25, 4), help="caps")
    p.add_argument("--rate", type=float, default=0.5, help="a 50%% share")
    p.add_argument("--flag", action="store_true", help="a flag")
    p.add_argument("--out", help="a file")
    text = " ".join(p.format_help().split())
    assert "N (default: 8 2048)" in text and "caps (default: 25,4)" in text
    assert "a 50% share (default: 0.5)" in text
    assert "a flag --out OUT a file -h" not in text and "(default: False)" not in text
    assert "(default: None)" not in text


# -- tables, cells, progress ------------------------------------------------------------------------
def test_table_aligns_numbers_right_and_text_left():
    text = _common.table(("op", "us", "ok"), [("add", 1.234, True), ("matmul", 12345.6, None)],
                         title="t", notes=["n"])
    assert text.splitlines() == [
        "t",
        "op         us  ok",
        "------  -----  ---",
        "add      1.23  yes",
        "matmul  12346  -",
        "n",
    ]
    md = _common.table(("op", "us"), [("add", "1.2")], markdown=True, align="lr")
    assert md.splitlines() == ["| op | us |", "|---|---:|", "| add | 1.2 |"]


@pytest.mark.parametrize(("value", "text"), [
    (None, "-"), (True, "yes"), (0.0, "0"), (12345.6, "12346"), (12.0, "12"), (12.34, "12.3"),
    (1.5, "1.50"), (0.1234, "0.123"), (1.2e-5, "1.2e-05"), (7, "7"), ("x", "x"),
    (9.999, "10.0"), (99.97, "100"), (0.9999, "1.00"), (-3.25, "-3.25"),
])
def test_cells(value, text):
    assert _common.fmt(value) == text


def test_progress_lines_go_to_stderr(capsys):
    progress = _common.Progress("bench", 2)
    progress("first")
    progress("under way", step=False)
    progress("second")
    _common.Progress("quiet", 1, enabled=False)("nothing")
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert re.fullmatch(r"bench: \[1/2\] first \(\d+\.\d s\)", lines[0])
    assert re.fullmatch(r"bench: under way \(\d+\.\d s\)", lines[1])
    assert lines[2].startswith("bench: [2/2] second") and len(lines) == 3


def test_emit_prints_the_json_then_the_table(tmp_path, capsys):
    _common.emit({"a": 1}, str(tmp_path / "r.json"), "the table")
    out = capsys.readouterr().out
    assert out.index('"a": 1') < out.index("the table")
    assert json.loads((tmp_path / "r.json").read_text()) == {"a": 1}


# -- every benchmark in its smallest mode -------------------------------------------------------------
# Runs each benchmark in turn as ``python script.py args`` would (one process, one import),
# and prints, per script, its exit code and what it wrote.
_RUN_ALL = """
import contextlib, io, json, os, runpy, sys
out = {}
for script, args in json.loads(sys.argv[1]):
    sys.argv = [script, *args]
    o, e = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exc:
            code = exc.code or 0
        except Exception as exc:
            code, e = 1, io.StringIO(e.getvalue() + repr(exc))
    out[os.path.basename(script)[:-3]] = {"code": code, "out": o.getvalue(), "err": e.getvalue()}
print("RESULTS" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def bench_tmp(tmp_path_factory):
    """The folder the smallest modes write their files into (``{tmp}`` in their args)."""
    return tmp_path_factory.mktemp("bench")


@pytest.fixture(scope="module")
def bench_runs(bench_tmp):
    tmp = bench_tmp
    jobs = [(str(ROOT / "launch" / "bench" / f"{name}.py"),
             args.format(tmp=tmp).split()) for name, (args, _) in SMALLEST.items()]
    proc = run_group([sys.executable, "-c", _RUN_ALL, json.dumps(jobs)], tmp, 600,
                     child_env({"DTENSOR_CALIBRATION": str(tmp / "cal.json")}))
    assert proc.returncode == 0 and "RESULTS" in proc.stdout, proc.stderr[-3000:]
    return json.loads(proc.stdout.rsplit("RESULTS", 1)[1])


def test_every_benchmark_has_a_smallest_mode():
    assert set(SMALLEST) | TWO_RANKS == set(BENCH)


@pytest.mark.mode_independent  # the reports, not the figures
@pytest.mark.parametrize("name", sorted(SMALLEST))
def test_every_benchmark_prints_a_table_and_progress(name, bench_runs):
    """Each benchmark at one rank in its smallest mode exits 0, prints its table (the header
    and the rule of the shared table helper) and at least one progress line on stderr."""
    run = bench_runs[name]
    assert run["code"] == 0, run["err"][-3000:]
    header = SMALLEST[name][1]
    if header.startswith("|"):
        assert header in run["out"], run["out"][-3000:]
    else:  # the words of the header, however wide its columns came out
        words = " ".join(header.split())
        assert any(words in " ".join(line.split()) for line in run["out"].splitlines()), \
            run["out"][-3000:]
    assert RULE.search(run["out"]), run["out"][-3000:]
    assert re.search(rf"^{name}: \[1/\d+\] ", run["err"], re.MULTILINE), run["err"][-2000:]


@pytest.mark.mode_independent  # the report, not the figures
def test_pipeline_prints_timelines_and_draws_pngs(bench_runs, bench_tmp):
    """``pipeline.py --timeline --png FILE``: after the table, each case's measured chart
    (one stage row at one rank), and one PNG per case (FILE's stem plus the case)."""
    out = bench_runs["pipeline"]["out"]
    assert out.index("schedule  m") < out.index("gpipe m=1:\nScheduleGPipe: 1 stages")
    for name, m in (("gpipe", 1), ("gpipe", 2), ("1f1b", 1), ("1f1b", 2)):
        chart = out.split(f"{name} m={m}:\n", 1)[1].split("\n\n", 1)[0].splitlines()
        assert chart[2].startswith("r0/s0 |") and "F0" in chart[2], chart
        assert "theory (p-1)/(m+p-1) = 0/" in chart[3], chart
    pngs = sorted(bench_tmp.glob("pipe-*.png"))
    assert [p.name for p in pngs] == ["pipe-1f1b-m1.png", "pipe-1f1b-m2.png",
                                      "pipe-gpipe-m1.png", "pipe-gpipe-m2.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)


# -- charts without matplotlib ----------------------------------------------------------------------
@pytest.fixture
def no_matplotlib(monkeypatch):
    """``import matplotlib`` fails, as where it is not installed."""
    for name in list(sys.modules):
        if name == "matplotlib" or name.startswith("matplotlib."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)


def _says_no_chart(out: str, path: Path, flag: str = "--png") -> None:
    assert f"{flag}: matplotlib is not installed (pip install 'dtensor[bench]'); no chart " \
           f"written to {path}" in out, out
    assert not path.exists()


@pytest.mark.mode_independent
def test_charts_without_matplotlib_say_so(no_matplotlib, tmp_path, capsys):
    """The chart of every script that draws one returns False and says why."""
    from launch.bench import size_sweep, small_ops
    from launch.experiments import _sweep

    path = tmp_path / "c.png"
    forward = [{"name": "dp", "time_us": 1.0, "predicted_comm_us": 0.0}]
    train = [{"name": "dp", "mesh": [2], "phase_us": {"forward": 1.0, "backward": 1.0,
                                                       "optimizer": 1.0},
              "predicted_comm_us": {"forward": 0.0, "backward": 0.0, "optimizer": None}}]
    auto = [{"model": "mlp", "mesh": [2], "spearman": 1.0,
             "results": [{"name": "auto", "predicted_us": 1.0, "step_us": 1.0}]}]
    sweep = {"ops": ["add"], "results": [], "placements": ["S0"], "libraries": ["ours"],
             "ranks": 2}
    small = {"ops": {"add": {"numpy_us": 1.0, "python_us": 2.0}}, "mesh": [2]}
    for draw in (lambda: _sweep.save_png(forward, str(path)),
                 lambda: _sweep.save_train_png(train, str(path)),
                 lambda: _sweep.save_prediction_png(auto, str(path)),
                 lambda: _sweep.save_train_prediction_png(
                     [{"name": "dp", "predicted_step_us": 1.0, "step_us": 1.0}], str(path)),
                 lambda: size_sweep.save_png(sweep, str(path)),
                 lambda: small_ops._plot(small, str(path))):
        assert draw() is False
        _says_no_chart(capsys.readouterr().out, path)


@pytest.mark.mode_independent
def test_strategy_sweep_png_without_matplotlib_says_so(no_matplotlib, tmp_path, capsys):
    """``strategy_sweep.py --train --png`` (the mode that used to write nothing and say
    nothing) prints the table and then why no chart was written."""
    from launch.experiments import strategy_sweep

    path = tmp_path / "train.png"
    assert strategy_sweep.main(["--train", "--size", "tiny", "--repeat", "1", "--quiet",
                                "--png", str(path)]) == 0
    out = capsys.readouterr().out
    assert "training step of mlp" in out
    _says_no_chart(out, path)


@pytest.mark.mode_independent
def test_pipeline_png_without_matplotlib_says_so(no_matplotlib, tmp_path, capsys):
    """``pipeline.py --png`` without matplotlib still prints the table (and the timeline)
    and says why no chart was written."""
    from launch.bench import pipeline

    path = tmp_path / "pipe.png"
    pipeline.main(["--micro", "1", "--repeat", "1", "--d-model", "16", "--seq", "4",
                   "--batch", "2", "--layers-per-stage", "1", "--schedules", "gpipe",
                   "--quiet", "--timeline", "--png", str(path)])
    out = capsys.readouterr().out
    assert "gpipe m=1:\nScheduleGPipe" in out
    _says_no_chart(out, path)
