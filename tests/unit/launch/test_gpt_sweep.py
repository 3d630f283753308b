"""``strategy_sweep.py --train --model gpt-tiny``: the GPT family of the sweep
(``launch/experiments/_gpt_family.py``) measured against its predictor at 2 ranks (step
time and peak memory per strategy, the Spearman correlation, the predictor's choice, the
chart), and the choice under a memory budget."""

from __future__ import annotations

import json
import sys
import types

import pytest
from helpers import ROOT
from helpers.jobs import child_env, run_group

import dtensor as dt
from launch.experiments import _gpt_family  # noqa: F401 (registers the gpt-* families)
from launch.experiments._families import resolve
from launch.experiments._sweep import predicted_choice, spearman

LIMIT_S = 120


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_gpt_families_are_registered_with_the_strategies_that_run():
    tiny, small = resolve("gpt-tiny", "small"), resolve("gpt-small", "tiny")  # --size unread
    assert tiny.name == "gpt-tiny" and small.name == "gpt-small"
    assert tiny.shapes["tok_emb.weight"] == (256, 64)
    assert small.shapes["blocks.5.mlp.fc.weight"] == (4 * 384, 384)
    assert tiny.strategies(2) == ["local", "dp", "fsdp", "tp", "tp_sp", "pp2_m2", "pp2_m4",
                                  "cp2"]
    assert "fsdp_tp not run (needs 4 ranks" in tiny.note()
    assert "pp4 not run (2 ranks are not a multiple of 4)" in tiny.note()
    # tiny's 2 blocks do not fill 4 stages
    assert tiny.strategies(4) == ["local", "dp", "fsdp", "tp", "tp_sp", "fsdp_tp", "hsdp",
                                  "pp2_fsdp2_m2", "pp2_fsdp2_m4", "cp4"]
    assert "pp4 not run (2 blocks do not fill 4 stages)" in tiny.note()
    # gpt-small's 6 heads do not split over 4 ranks: no 1-D tensor parallelism there; its
    # batch of 4 gives a (pp 2, dp 2) replica 2 sequences: no 4 micro-batches
    assert small.strategies(4) == ["local", "dp", "fsdp", "fsdp_tp", "hsdp", "pp2_fsdp2_m2",
                                   "pp4_m2", "pp4_m4", "cp4"]
    assert "tp not run (6 heads (sequence 256) do not split over 4 ranks)" in small.note()
    assert "pp2_fsdp2_m4 not run (4 micro-batches do not split a replica's 2" in small.note()
    small.set_dimensions((), (), ())
    assert small.strategies(4) == ["local", "dp", "fsdp", "fsdp_tp", "hsdp"]
    assert tiny.auto_model() is None  # a module: the sweep chooses by the predictor


def test_fit_step_scales_compute_to_the_measured_local_step():
    """The compute scale fitted to a measured local step predicts that step; strategies
    other than local are not fitted to; ``fit=False`` keeps the calibration."""
    family = resolve("gpt-tiny", "tiny")
    family.use_calibration(dt.autoshard.Calibration(ranks=2, mesh_shape=(2,)))
    step = types.SimpleNamespace(optimizer_name="sgd", clip=1.0)
    before = family.predict("local", step).step_us
    family.fit_step("dp", step, 5 * before)
    assert family.fitted == [] and family.predict("local", step).step_us == before
    dp_before = family.predict("dp", step).step_us
    family.fit_step("local", step, 5 * before)
    assert family.fitted == ["local"]
    assert family.predict("local", step).step_us == pytest.approx(5 * before, rel=1e-6)
    assert family.predict("dp", step).step_us > 2 * dp_before  # dp's kernels scaled too
    assert "compute scale fitted to the measured local step: 1.00 ->" in family.note()
    off = resolve("gpt-tiny", "tiny")
    off.use_calibration(None, fit=False)
    off.fit_step("local", step, 5 * before)
    assert off.fitted == [] and "--no-fit" in off.note()


def _row(name, predicted, measured, pred_peak, peak):
    return {"name": name, "predicted_step_us": predicted, "step_us": measured,
            "predicted_peak_bytes": pred_peak, "peak_with_state_bytes": [peak, peak - 1]}


def test_the_predictor_chooses_the_fastest_predicted_that_fits():
    rows = [_row("local", 10.0, 30.0, 900, 900), _row("dp", 20.0, 20.0, 500, 500),
            _row("fsdp", 30.0, 25.0, 300, 300)]
    free = predicted_choice(rows)
    assert free["chosen"] == "local" and free["best"] == "dp"
    assert free["over_best"] == pytest.approx(1.5) and not free["within_10pct"]
    tight = predicted_choice(rows, budget_bytes=600)
    assert tight["chosen"] == "dp" and tight["excluded"] == ["local"]
    assert tight["over_best"] == 1.0 and tight["within_10pct"]
    # the best measured is taken among the strategies whose measured peak fits
    assert predicted_choice(rows, budget_bytes=400)["best"] == "fsdp"
    assert predicted_choice(rows, budget_bytes=100)["chosen"] is None
    assert predicted_choice([{**rows[0], "predicted_step_us": None}, *rows[1:]]) is None


@pytest.mark.mode_independent  # a launcher job and its report
def test_gpt_tiny_sweep_reports_predicted_and_measured_step_and_peak(tmp_path):
    """At 2 ranks, one timed step per strategy: per strategy the measured and predicted step
    and peak, the first loss equal to the local run's; the Spearman correlation and the
    predictor's choice in the JSON and the table; the chart written."""
    cal = tmp_path / "builtin.json"
    dt.autoshard.Calibration(ranks=2, mesh_shape=(2,)).save(cal)
    png, out_path = tmp_path / "gpt.png", tmp_path / "gpt.json"
    cmd = [sys.executable, "-m", "launch", "-n", "2", "--timeout", str(LIMIT_S),
           "launch/experiments/strategy_sweep.py", "--train", "--model", "gpt-tiny",
           "--repeat", "1", "--calibration", str(cal), "--png", str(png),
           "--out", str(out_path)]
    proc = run_group(cmd, ROOT, LIMIT_S + 30, child_env(drop=["DTENSOR_MESH"]))
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    doc = json.loads(out_path.read_text())
    rows = doc["results"]
    assert [r["name"] for r in rows] == ["local", "dp", "fsdp", "tp", "tp_sp", "pp2_m2",
                                         "pp2_m4", "cp2"]
    for r in rows:
        assert r["step_us"] > 0 and r["predicted_step_us"] > 0, r["name"]
        measured = max(r["peak_with_state_bytes"])
        assert measured > 0 and r["predicted_peak_bytes"] > 0, r["name"]
        assert abs(r["predicted_peak_bytes"] - measured) / measured < 0.3, r["name"]
        assert r["loss_error"] < 1e-5, r["name"]
    want = spearman([r["predicted_step_us"] for r in rows], [r["step_us"] for r in rows])
    assert doc["spearman"] == pytest.approx(want)
    assert f"Spearman rank correlation predicted/measured step: {want:.3f} over 8" \
        in proc.stdout
    choice = doc["choice"]
    chosen = min(rows, key=lambda r: r["predicted_step_us"])
    best = min(rows, key=lambda r: r["step_us"])
    assert choice["chosen"] == chosen["name"] and choice["best"] == best["name"]
    assert choice["over_best"] == pytest.approx(chosen["step_us"] / best["step_us"])
    assert "predictor's choice (memory budget" in proc.stdout
    assert f"= {choice['over_best']:.3f} x the best measured ({best['name']}" in proc.stdout
    assert doc["calibration"]["source"] == "stored"
    # the compute scale was fitted to the local step: local's prediction is its measurement
    assert doc["fitted"] == ["local"]
    assert rows[0]["predicted_step_us"] == pytest.approx(rows[0]["step_us"], rel=1e-6)
    rest = spearman([r["predicted_step_us"] for r in rows[1:]], [r["step_us"] for r in rows[1:]])
    assert doc["spearman_unfitted"] == pytest.approx(rest, nan_ok=True)
    assert "the predictor was fitted to the measured step of local; Spearman without it:" \
        in proc.stdout
    assert "strategy_sweep: [8/8] cp2 (mesh (2,))" in proc.stderr
    if _has_matplotlib():
        assert png.stat().st_size > 0
    else:
        assert "matplotlib is not installed" in proc.stdout


@pytest.mark.mode_independent  # a launcher job and its report
def test_gpt_tiny_pipeline_sweep_trains_like_the_local_model(tmp_path):
    """At 2 ranks, a pipeline of 2 stages (1F1B, 2 micro-batches) and context parallelism
    beside the local model: the first losses equal the local run's, the predictions carry
    the pipeline (bubble 1/3)."""
    cal = tmp_path / "builtin.json"
    dt.autoshard.Calibration(ranks=2, mesh_shape=(2,)).save(cal)
    out_path = tmp_path / "pp.json"
    cmd = [sys.executable, "-m", "launch", "-n", "2", "--timeout", str(LIMIT_S),
           "launch/experiments/strategy_sweep.py", "--train", "--model", "gpt-tiny",
           "--repeat", "1", "--calibration", str(cal), "--pp-degrees", "2",
           "--microbatches", "2", "--cp-degrees", "2", "--out", str(out_path)]
    proc = run_group(cmd, ROOT, LIMIT_S + 30, child_env(drop=["DTENSOR_MESH"]))
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    rows = {r["name"]: r for r in json.loads(out_path.read_text())["results"]}
    assert list(rows)[-2:] == ["pp2_m2", "cp2"]
    for name in ("pp2_m2", "cp2"):
        r = rows[name]
        assert r["loss_error"] < 1e-5, name
        assert r["step_us"] > 0 and r["predicted_step_us"] > 0, name
        measured = max(r["peak_with_state_bytes"])
        assert abs(r["predicted_peak_bytes"] - measured) / measured < 0.3, name
    # the pipeline's stages exchange activations and gradients point to point
    assert set(rows["pp2_m2"]["comm"]["forward"]) >= {"send", "recv"}
    # each stage holds about half of the model: less memory than the local run
    assert max(rows["pp2_m2"]["peak_with_state_bytes"]) < max(
        rows["local"]["peak_with_state_bytes"])
