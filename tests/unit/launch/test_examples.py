"""The demo, the examples, the strategy-sweep script and the calibration script run under
the launcher (short sizes) and exit 0 with the output they promise; every script of
``launch/`` run from where the package is installed (outside the repository) imports the
installed dtensor and runs on its compiled path; and the 3-D mesh tests of tests/mpi and
its fuzzer run on 2x2x2 and 2x4 meshes (8 ranks, a size the MPI stages do not use).
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT
from helpers.jobs import PKG_ROOT, child_env, job_cwd, run_group

import fastpath
from dtensor.autoshard import load_calibration
from dtensor.autoshard._calibrate import fit
from launch.bench import size_sweep
from redistribute.cost import CostModel

LIMIT_S = 120
# the launch package next to the imported dtensor (site-packages when installed)
INSTALLED = Path(PKG_ROOT) / "launch"


def launch(n: int, *args: str, cwd: Path = ROOT, env: dict | None = None) -> str:
    """Run ``python -m launch -n n args...``; assert it succeeds; its standard output."""
    cmd = [sys.executable, "-m", "launch", "-n", str(n), "--timeout", str(LIMIT_S), *args]
    proc = run_group(cmd, job_cwd(cwd, args), LIMIT_S + 30,
                     child_env(env, drop=["DTENSOR_MESH"]))
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.mark.parametrize("n", [4, 3, 1])
def test_demo_tour(n):
    out = launch(n, "launch/demo.py")
    for title in (
        "== mesh",
        "== one (6, 5) tensor",
        "== ops and their inferred placements",
        "== redistribute",
        "== tensor-parallel MLP",
        "== latency",
    ):
        assert title in out
    assert f"{n} ranks, mesh shape {(2, 2) if n == 4 else (n,)}" in out
    err = float(re.search(r"max \|dtensor - numpy\| = (\S+)", out).group(1))
    assert err < 1e-4
    seconds = float(re.search(r"tour done in (\S+) s", out).group(1))
    assert seconds < 60
    assert out.count("placements [") >= 3  # three visualize_sharding tables
    # the latency table: two sizes as columns, rows labelled with what ran
    table = out[out.index("== latency"):]
    assert re.search(r"^op +placements +collectives +8x8 +512x512$", table, re.MULTILINE)
    sharded = "[S(0), R]" if n == 4 else "[S(0)]"
    replicated = "[R, R]" if n == 4 else "[R]"
    gather = "all_gather" if n > 1 else "none"
    for parts in (
        ("x + x", f"{sharded}, {sharded} -> {sharded}", "none"),
        ("x @ w", f"{sharded}, {replicated} -> {sharded}", "none"),
        (f"x.redistribute({replicated})", f"{sharded} -> {replicated}", gather),
    ):
        row = "^" + " +".join(map(re.escape, parts)) + r" +[\d.]+ +[\d.]+$"
        assert re.search(row, table, re.MULTILINE), (row, table)
    # rank 0 prints alone: every section once
    assert out.count("== mesh") == 1


@pytest.mark.parametrize(
    ("name", "n", "expect"),
    [
        ("tp_mlp.py", 4, "max |error| against numpy"),
        ("tp_mlp.py", 2, "all_reduce"),
        ("dp_tp_2d.py", 4, "mesh (2, 2) ('dp', 'tp')"),
        ("redistribute_tour.py", 4, "--- S(0),S(1) -> R,R"),
        ("redistribute_tour.py", 3, "--- S(0) -> S(1)"),
        ("custom_rule.py", 4, "observed: {'all_to_all': 1}"),
    ],
)
def test_examples_run(name, n, expect):
    out = launch(n, f"launch/examples/{name}")
    assert expect in out


# Small sizes and few steps: each job trains the local reference and every strategy.
_TRAIN_SIZES = {"train_mlp.py": ["--dim", "8", "--hidden", "16"]}


@pytest.mark.parametrize(
    ("name", "n", "strategies"),
    # the MLP in both modes' stages
    [("train_mlp.py", 4, "dp,tp,2d"), ("train_mlp.py", 2, "dp,tp")],
)
def test_training_examples_match_the_local_run(name, n, strategies):
    out = launch(n, f"launch/examples/{name}", "--strategy", strategies, "--steps", "3",
                 *_TRAIN_SIZES[name])
    for s in strategies.split(","):
        found = re.search(rf"^{s}: max relative loss difference against the local run: "
                          r"(\S+): losses agree$", out, re.MULTILINE)
        assert found and float(found.group(1)) <= 1e-4, out
    assert ("strategy 2d on mesh (2, 2) ('dp', 'tp')" in out) is ("2d" in strategies)
    assert re.search(r"^step   2: loss \S+ \(local \S+\)$", out, re.MULTILINE)


@pytest.mark.mode_independent  # the longer job: in the first mode's stage
def test_gpt_training_example_runs_every_strategy_like_the_local_run():
    out = launch(4, "launch/examples/train_transformer.py", "--steps", "3", "--layers", "1")
    for s in ("dp", "replicate", "fsdp", "zero2", "fsdp_int", "tp", "tp_sp", "fsdp_tp",
              "hsdp"):
        found = re.search(rf"^{s}: max relative loss difference against the local run: "
                          r"(\S+): losses agree$", out, re.MULTILINE)
        assert found and float(found.group(1)) <= 1e-5, out
    assert re.search(r"^fsdp step   2: loss \S+ \(local \S+\)$", out, re.MULTILINE)


@pytest.mark.mode_independent  # the check of the losses, not how they were computed
def test_training_example_fails_on_a_loss_mismatch(monkeypatch, capsys):
    """A distributed loss off by more than the tolerance at one step (a loss above 1, so
    the difference is relative): exit status 1."""
    from launch.examples import _training

    real = _training.train

    def off_at_step_1(model, strategy, mesh, steps, **kwargs):
        losses = real(model, strategy, mesh, steps, **kwargs)
        return losses if strategy == "local" else [v * (1 + (i == 1) * 1e-3) for i, v in
                                                   enumerate(losses)]

    monkeypatch.setattr(_training, "train", off_at_step_1)
    args = _training.parser("t").parse_args(["--strategy", "local,dp", "--steps", "2"])
    assert _training.main(_training.mlp_model(4, 4, 8), args) == 1
    out = capsys.readouterr().out
    assert "local: max relative loss difference against the local run: 0.00e+00" in out
    assert "dp: max relative loss difference against the local run: 1.00e-03" in out
    assert "MISMATCH" in out
    with pytest.raises(SystemExit):
        _training.parser("t").parse_args(["--strategy", "dp,fsdp"])


def test_strategy_sweep_script_writes_json(tmp_path):
    path = tmp_path / "sweep.json"
    out = launch(
        4,
        "launch/experiments/strategy_sweep.py",
        "--size",
        "tiny",
        "--repeat",
        "1",
        "--out",
        str(path),
        "--png",
        str(tmp_path / "sweep.png"),
    )
    doc = json.loads(path.read_text())
    assert doc["mesh"] == [2, 2] and doc["model"] == "mlp"
    names = [r["name"] for r in doc["results"]]
    assert sorted(names) == sorted(
        ["replicated", "data-parallel", "tensor-parallel", "2-D dp x tp"]
    )
    assert all(r["max_error"] < 1e-4 for r in doc["results"])
    assert re.search(r"^strategy +time us +model us +collectives", out, re.MULTILINE), out
    for name in names:
        assert name in out
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in out
    else:
        assert (tmp_path / "sweep.png").stat().st_size > 0


def test_calibrate_writes_a_usable_cost_model(tmp_path):
    path, stored = tmp_path / "costs.json", tmp_path / "calibration.json"
    out = launch(2, "launch/bench/calibrate.py", "--sizes", "8,64", "--comm-sizes", "8,64,96",
                 "--repeat", "3", "--out", str(path), "--calibration", str(stored))
    assert re.search(r"^mesh dim +collective +alpha us +beta GB/s$", out, re.MULTILINE), out
    assert re.search(r"^op class +alpha us +rate G/s$", out, re.MULTILINE), out
    doc = json.loads(path.read_text())
    # the whole calibration (what auto_shard reads): kernels per op class, fixed costs
    cal = load_calibration(stored)
    assert cal.ranks == 2 and cal.mesh_shape == (2,) and cal.model() == CostModel.from_dict(doc)
    assert set(cal.points["kernels"]) == {"matmul", "nn", "pointwise", "view"}
    # kernels at --sizes, collectives at --comm-sizes (reaching further)
    assert all(len(v) == 2 for v in cal.points["kernels"].values())
    assert cal.entry_s >= 0 and cal.sync_s >= 0
    assert set(doc["per_kind"]) == {"all_gather", "reduce_scatter", "all_reduce", "all_to_all"}
    points = json.loads(Path(str(path) + ".points.json").read_text())["points"]
    assert all(len(v) == 3 and v[0][0] < v[1][0] < v[2][0] for v in points.values())  # bytes grow
    # the file is accepted as DTENSOR_COST_MODEL
    code = "from redistribute.cost import default_cost_model as d; print(d().alpha_s)"
    env = child_env({"DTENSOR_COST_MODEL": str(path)})
    got = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert float(got.stdout) == pytest.approx(doc["alpha_s"])


def test_calibration_fit_recovers_alpha_and_beta():
    alpha, beta = 7e-6, 2e9
    points = [(b, alpha + b / beta) for b in (1e3, 1e5, 1e6, 4e6)]
    got_alpha, got_beta = fit(points)
    assert got_alpha == pytest.approx(alpha, rel=1e-6)
    assert got_beta == pytest.approx(beta, rel=1e-6)
    assert fit([(1e3, 5e-6), (1e4, 5e-6)])[1] == 1e12  # flat: bandwidth not measurable


def test_small_ops_benchmark_reports_every_op_and_path(tmp_path):
    path = tmp_path / "small_ops.json"
    out = launch(2, "-m", "launch.bench.small_ops", "--no-torch", "--repeat", "2", "--out",
                 str(path))
    doc = json.loads(path.read_text())
    # the JSON, then a table of one row per op (what a terminal shows last)
    table = out[out.rindex("small ops, 8x8 float32, mesh (2,)"):]
    assert re.search(r"^op +numpy us +(fast us +)?python us +overhead us", table, re.MULTILINE)
    assert all(re.search(rf"^{name} +[\d.]+ ", table, re.MULTILINE) for name in doc["ops"])
    assert doc["device"] == "cpu" and doc["mesh"] == [2] and not doc["torch"]
    assert {"add", "relu", "view", "gelu", "mean", "softmax", "from_local"} <= set(doc["ops"])
    for name, row in doc["ops"].items():
        assert row["numpy_us"] > 0 and row["python_us"] > 0, name
        if doc["fastpath"]["available"]:
            assert row["fast_us"] > 0 and row["python_over_fast"] > 0, name
        assert ("overhead_met" in row) == (name not in ("to_local", "from_local")), name


@pytest.mark.parametrize(
    ("n", "torch", "sizes"),
    # the job with torch (the longer one) checks the script's torch columns: one mode's
    # stage runs it; the other job runs in both modes (the path it reports)
    [(1, False, [8, 16]), pytest.param(2, True, [8], marks=pytest.mark.mode_independent)],
)
def test_size_sweep_times_every_op_size_placement_and_library(n, torch, sizes, tmp_path):
    path, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    out = launch(n, "launch/bench/size_sweep.py", "--sizes", ",".join(map(str, sizes)),
                 "--quick", "--budget", "0.001", "--json", str(path), "--png", str(png),
                 *([] if torch else ["--no-torch"]))
    doc = json.loads(path.read_text())
    assert (doc["ranks"], doc["sizes"], doc["placements"]) == (n, sizes, ["S0", "R"])
    assert doc["fastpath"] == ("compiled" if fastpath.ENABLED else "python")
    assert doc["torch"] is (torch and importlib.util.find_spec("torch") is not None)
    libs = ["ours", "numpy", *(["torch_local", "torch_dtensor"] if doc["torch"] else [])]
    assert doc["libraries"] == libs
    got = [(r["op"], r["placement"], r["n"]) for r in doc["results"]]
    assert sorted(got) == sorted(
        (op, pl, size) for op in size_sweep.OPS for pl in ("S0", "R") for size in sizes
        if op != "redistribute" or pl == "S0"
    )
    for r in doc["results"]:
        assert r["bytes"] == r["n"] * r["n"] * 4
        for lib in libs:
            if lib == "torch_local" and r["op"] == "redistribute":
                assert r[f"{lib}_us"] is None
            else:
                assert r[f"{lib}_us"] > 0 and r[f"{lib}_samples"] >= 3, (lib, r)
        local = [r[f"{k}_us"] for k in ("numpy", "torch_local") if r.get(f"{k}_us")]
        assert r["best_local_us"] == min(local)
        assert r["within_local"] is (r["ours_us"] <= 1.1 * min(local) + 1.0)
        assert r["within_torch_dtensor"] is (
            None if not doc["torch"] else r["ours_us"] <= r["torch_dtensor_us"]
        )
        row = f"| {r['op']} | {r['placement']} | {r['n']} | {r['ours_us']:.1f} | "
        assert row in out
    misses = sum(not r["within_local"] for r in doc["results"])
    assert doc["misses"]["local"] == misses
    assert f"misses: {misses} of {len(got)} against the best local" in out
    if importlib.util.find_spec("matplotlib") is None:
        assert "matplotlib is not installed" in out
    else:
        assert png.stat().st_size > 0


@pytest.mark.mode_independent  # the benchmark's report; either path serves its ops
def test_train_step_benchmark_compares_a_step_with_torch_dtensor(tmp_path):
    path = tmp_path / "train_step.json"
    out = launch(2, "launch/bench/train_step.py", "--sizes", "8", "--budget", "0.001",
                 "--repeat", "2", "--out", str(path))
    doc = json.loads(path.read_text())
    assert doc["ranks"] == 2 and doc["torch"] is (importlib.util.find_spec("torch") is not None)
    (row,) = doc["results"]
    assert (row["n"], row["batch"]) == (8, 8)
    for key in ("ours_step_us", "ours_forward_us", "ours_forward_grad_us"):
        assert row[key] > 0, key
    if doc["torch"]:
        assert row["torch_step_us"] > 0 and row["torch_forward_us"] > 0
        assert row["speedup"] == round(row["torch_step_us"] / row["ours_step_us"], 2)
        assert doc["speedup_met"] is (row["speedup"] >= doc["target_speedup"])
        assert abs(row["loss_ours"] - row["loss_torch"]) < 1e-5  # the same model and data
    assert {"add", "relu", "mm_S0_R"} <= set(doc["small_ops"])
    assert all(s[k] > 0 for s in doc["small_ops"].values()
               for k in ("before_us", "after_us", "before_min_us", "after_min_us"))
    assert re.search(r"^\| 8 \| [\d.]+ \| ", out, re.MULTILINE)


@pytest.mark.mode_independent  # the benchmark's rows; either kernel path gives the copy
def test_kernels_benchmark_times_the_transposed_copy():
    """``launch.bench.kernels`` times ``t().contiguous()`` against numpy and torch, on N x N
    and N/2 x N, and the three calls give the same array."""
    from launch.bench import kernels

    a = np.random.default_rng(3).standard_normal((8, 6)).astype(np.float32)
    ours, ref, tch = kernels.cases(a)["t().contiguous()"]
    np.testing.assert_array_equal(ours().numpy(), ref())
    if tch is not None:
        np.testing.assert_array_equal(tch().numpy(), ref())
    rows = kernels.measure(["t().contiguous()"], [64], repeat=2)
    assert [(r["op"], r["shape"]) for r in rows] == [("t().contiguous()", [64, 64]),
                                                     ("t().contiguous()", [32, 64])]
    assert all(r["ours_us"] > 0 and r["numpy_us"] > 0 for r in rows)


def test_size_sweep_command_line():
    args = size_sweep.parse_args(["--ops", "add,redistribute", "--placements", "R"])
    assert args.ops == ("add", "redistribute") and args.placements == ("R",)
    assert args.sizes == size_sweep.SIZES and max(args.sizes) == 4096
    assert size_sweep.parse_args(["--quick"]).sizes == size_sweep.QUICK_SIZES
    assert size_sweep.parse_args(["--sizes", "8,24"]).sizes == (8, 24)
    for bad in (["--ops", "add,nope"], ["--placements", "S1"], ["--sizes", "8,x"],
                ["--sizes", "0"]):
        with pytest.raises(SystemExit):
            size_sweep.parse_args(bad)


def test_redistribute_benchmark_compares_against_raw_collectives(tmp_path):
    path = tmp_path / "redistribute.json"
    launch(2, "-m", "launch.bench.redistribute", "--sizes", "8", "--repeat", "2", "--cold",
           "--out", str(path))
    doc = json.loads(path.read_text())
    assert doc["cold_caches"] is True and doc["batch_ms"] == 1.0
    from redistribute import shm

    assert doc["shared_memory"] is shm.enabled() and doc["shm_min_bytes"] == shm.MIN_BYTES
    cases = {r["case"]: r for r in doc["results"]}
    assert set(cases) == {"S(0)->R", "S(1)->R", "S(0)->S(1)", "P->R", "P(max)->R", "R->S(0)"}
    assert cases["P->R"]["raw"] == "Allreduce" and cases["P->R"]["raw_us"] > 0
    assert cases["P(max)->R"]["raw"] == "Allreduce MAX" and cases["P(max)->R"]["raw_us"] > 0
    assert all(r["dtensor_us"] > 0 and r["execute_us"] > 0 and r["python_us"] > 0
               for r in cases.values())


def test_overlap_benchmark_reports_every_case(tmp_path):
    path = tmp_path / "overlap.json"
    launch(2, "-m", "launch.bench.overlap", "--repeat", "1", "--number", "20", "--iters", "2",
           "--matmul", "16", "--large", "64", "--delay-ms", "1", "--out", str(path))
    doc = json.loads(path.read_text())
    p = doc["persistent"]
    assert p["dtensor_persistent_us"] > 0 and p["dtensor_blocking_us"] > 0
    assert p["raw_allgather_us"] > 0 and p["raw_persistent_us"] > 0
    assert all(type(p[f"paired_{k}_us"]) is float for k in ("over_raw", "gain", "blocking_over_raw"))
    assert [c["redistribute"] for c in doc["overlap"]] == [
        "(8x8) float32 S(0)->R", "(64x64) float32 S(0)->R"]
    for case in [*doc["overlap"], doc["slow_peer"]]:
        assert case["blocking_us_per_iter"] > 0 and case["async_us_per_iter"] > 0
    assert doc["slow_peer"]["late_rank_delay_ms"] == 1.0
    assert all(doc["progress"][f"{k}_us"] > 0 for k in (
        "compute_only", "blocking", "wait_at_end", "polled", "worker_thread"))


@pytest.mark.mode_independent  # the benchmarks' reports; either path serves their calls
def test_reductions_mesh_create_autograd_and_vocab_benchmarks_report_their_figures(tmp_path):
    path = tmp_path / "reductions.json"
    launch(2, "-m", "launch.bench.reductions", "--sizes", "8", "--repeat", "2", "--out",
           str(path))
    figures = json.loads(path.read_text())["figures"]
    assert set(figures) == {"MPI.MAX 8x8", "NaN-safe max 8x8", "MPI.SUM 8x8", "sum 8x8"}
    assert all(f["min_us"] > 0 and f["samples"] == 2 for f in figures.values())
    path = tmp_path / "mesh.json"
    launch(2, "-m", "launch.bench.mesh_create", "--repeat", "3", "--out", str(path))
    figures = json.loads(path.read_text())["figures"]
    assert set(figures) == {"init_device_mesh(2,)", "init_device_mesh(2, 1)"}
    assert all(f["median_us"] > 0 for f in figures.values())
    path = tmp_path / "autograd.json"
    launch(2, "-m", "launch.bench.autograd_overhead", "--repeat", "1", "--out", str(path))
    doc = json.loads(path.read_text())
    assert len(doc["figures"]) == 20 and doc["target_us"] == 3.0
    for row in doc["figures"].values():
        assert min(row["no_grad_us"], row["leaf_us"], row["intermediate_us"]) > 0
        assert row["overhead_met"] is (row["overhead_us"] <= 3.0)
        assert row["paired_met"] is (row["paired_overhead_us"] <= 3.0)
    assert doc["met"] is all(r["overhead_met"] for r in doc["figures"].values())
    assert doc["paired_met"] is all(r["paired_met"] for r in doc["figures"].values())
    path = tmp_path / "vocab.json"
    launch(2, "-m", "launch.bench.vocab_parallel", "--rows", "16", "--classes", "4096",
           "--repeat", "2", "--out", str(path))
    figures = json.loads(path.read_text())["figures"]
    kept, gathered = figures["vocab_parallel"]["collectives"], figures["gather"]["collectives"]
    assert kept.get("all_reduce") and "all_gather" not in kept, kept
    assert "all_gather" in gathered and "all_reduce" not in gathered, gathered
    assert all(f["median_ms"] > 0 for f in figures.values())


# Runs a script as ``python script.py args`` does (its folder is sys.path[0]), then reports
# where dtensor came from and which path served its ops.
_RUN_AND_REPORT = """
import os, runpy, sys
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(script)
try:
    runpy.run_path(script, run_name="__main__")
except SystemExit as exc:
    if exc.code not in (None, 0):
        raise
import dtensor
status = dtensor.debug.fastpath_status()
print("REPORT", dtensor.__file__, status["active"])
"""

#: Arguments that keep an example's run short (its defaults train a real model).
_SMALL_ARGS = {"train_gpt.py": " --model tiny --steps 2 --batch 2 --peak-gflops 50"}


def _scripts(folder: Path, bench: bool = True) -> list[str]:
    """The scripts of a launch package folder (with the benchmarks' ``--help`` when
    ``bench``), each with small arguments."""
    return [
        *(["demo.py"] if (folder / "demo.py").exists() else []),
        *(f"examples/{p.name}{_SMALL_ARGS.get(p.name, '')}"
          for p in sorted((folder / "examples").glob("[!_]*.py"))),
        "experiments/strategy_sweep.py --help",
        *(f"bench/{p.name} --help" for p in sorted((folder / "bench").glob("[!_]*.py")) if bench),
    ]


# From the source tree every script (a script that put its own tree on sys.path would
# import the dtensor there, not the installed one); from the installed folder, when the
# package was installed rather than in place, the scripts a user runs, and the strategy
# sweep once for real.
_SOURCE = ROOT / "launch"
_CASES = [
    *((_SOURCE, s) for s in _scripts(_SOURCE)),
    *((INSTALLED, s) for s in _scripts(INSTALLED, bench=False) if INSTALLED != _SOURCE),
    (INSTALLED, "experiments/strategy_sweep.py --size tiny --repeat 1"),
]


@pytest.mark.skipif(not fastpath.AVAILABLE, reason="compiled extension not built")
@pytest.mark.mode_independent  # each job sets DTENSOR_FASTPATH=1 itself
@pytest.mark.parametrize(
    ("folder", "script"), _CASES, ids=[f"{f.parent.name}:{s}" for f, s in _CASES]
)
def test_launch_scripts_import_the_installed_package(folder, script, tmp_path):
    """Each script at 1 rank, cwd outside the repository: it imports the installed dtensor
    (no path of its own goes first), the extension loads (no "not built" warning, also for
    ``--help``) and the compiled front is the one serving ops."""
    path, *args = script.split()
    cmd = [sys.executable, "-c", _RUN_AND_REPORT, str(folder / path), *args]
    proc = run_group(cmd, tmp_path, LIMIT_S, child_env({"DTENSOR_FASTPATH": "1"}))
    assert proc.returncode == 0, f"{script}\n{proc.stdout}\n{proc.stderr}"
    assert "not built" not in proc.stderr, proc.stderr
    origin, active = proc.stdout.rsplit("REPORT ", 1)[1].split()
    assert Path(origin).resolve().is_relative_to(Path(PKG_ROOT).resolve()), origin
    assert active == "True"


def _at_8_ranks(files: list[str], keyword: str, least: int, env: dict | None = None) -> None:
    out = launch(
        8, "-m", "pytest", *files, "--with-mpi", "-q", "-p", "no:cacheprovider", "-k", keyword,
        cwd=ROOT / "tests", env={"MPIR_CVAR_ENABLE_HEAVY_YIELD": "1", **(env or {})},
    )  # fmt: skip
    counts = re.search(r"(\d+) passed", out)
    assert counts and int(counts.group(1)) >= least and "skipped" not in out, out[-2000:]


@pytest.mark.mode_independent  # the executor, below the dispatch that DTENSOR_FASTPATH picks
def test_3d_executor_at_8_ranks():
    """The 3-D mesh tests of the executor (sampled placement pairs on 2x2x2, uneven and
    empty shards, transposed inputs) at 8 ranks, oversubscribed: correctness only."""
    _at_8_ranks(["mpi/redistribute/test_execute.py"], "3d", 8)


def test_3d_meshes_at_8_ranks():
    """The 3-D mesh tests of the DTensor API and the program fuzzer (2x4 and 2x2x2 meshes
    among its draws) at 8 ranks, oversubscribed: correctness only. The fuzzer draws 60
    programs here (a third of them on 2x2x2); the MPI stages draw 150 at 1-4 ranks."""
    _at_8_ranks(["mpi/distributed/test_dtensor_api.py", "mpi/ops/test_fuzz.py"],
                "3d or programs_match_numpy", 4, env={"DTENSOR_FUZZ_EXAMPLES": "60"})  # fmt: skip
