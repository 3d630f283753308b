"""``launch/bench/gpt_predict.py --repredict SWEEP.json --calibration CAL.json``: a stored
training sweep's strategies priced again by the old predictor (no FSDP copies, no slowdown
beside a collective), the new one and the new one with the prefetch beside the compute, on
a small synthetic sweep of gpt-tiny at 2 ranks (one process: the predictor reads metadata
only)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

import dtensor as dt
from launch.bench import gpt_predict

pytestmark = pytest.mark.mode_independent  # the predictor's arithmetic, no kernels run

NAMES = ("local", "dp", "fsdp", "tp")


def _calibration():
    # copies slow enough and a slowdown large enough that both new terms show
    return replace(dt.autoshard.Calibration(), copy_rate=2e8, overlap_slowdown=1.3)


def _sweep(step_ms: dict[str, float]) -> dict:
    return {"mode": "train", "model": "gpt-tiny", "ranks": 2, "optimizer": "sgd",
            "results": [{"name": n, "step_us": step_ms[n] * 1e3} for n in NAMES]}


def _column(doc, key):
    return {r["strategy"]: r[key] for r in doc["rows"]}


def test_the_old_predictor_leaves_out_fsdp_copies_and_the_slowdown():
    doc = gpt_predict.repredict(_sweep(dict.fromkeys(NAMES, 100.0)), _calibration(),
                                compute_scale=2.0)
    assert doc["compute_scale"] == 2.0 and not doc["compute_scale_fitted"]
    old, new, beside = (_column(doc, k) for k in ("old_ms", "new_ms", "new_beside_ms"))
    for n in ("local", "dp", "tp"):  # no FSDP groups: nothing to copy, no prefetch
        assert old[n] == pytest.approx(new[n], rel=1e-12) == beside[n]
    assert new["fsdp"] > old["fsdp"] * 1.001  # the copies at 0.2 GB/s
    assert beside["fsdp"] != new["fsdp"]  # the prefetch on its lane, slowed compute
    # the old predictor is the new one at an infinite copy rate and no slowdown
    plain = gpt_predict.repredict(
        _sweep(dict.fromkeys(NAMES, 100.0)),
        replace(_calibration(), copy_rate=float("inf"), overlap_slowdown=1.0),
        compute_scale=2.0)
    assert _column(plain, "new_ms") == pytest.approx(old, rel=1e-12)


def test_fit_spearman_and_choice_against_the_measured_steps():
    cal = _calibration()
    first = gpt_predict.repredict(_sweep(dict.fromkeys(NAMES, 100.0)), cal, compute_scale=2.0)
    new = _column(first, "new_ms")
    # measured steps equal to the new predictions at scale 2: the fit finds 2 again, the
    # new predictor ranks them exactly and chooses the best distributed strategy
    doc = gpt_predict.repredict(_sweep(new), cal)
    assert doc["compute_scale_fitted"] and doc["compute_scale"] == pytest.approx(2.0, rel=1e-9)
    p = doc["predictors"]["new"]
    assert p["spearman"] == pytest.approx(1.0) and p["spearman_without_local"] == pytest.approx(1.0)
    dist = {n: v for n, v in new.items() if n != "local"}
    assert p["chosen"] == min(dist, key=dist.get)
    assert p["over_best"] == pytest.approx(min(dist.values()) / min(new.values()))
    assert p["within_10pct"] == (p["over_best"] <= 1.1)
    # the measured order reversed: the same predictions rank them exactly backwards, and
    # the choice is the distributed strategy measured slowest
    order = sorted(new, key=new.get)
    reversed_ms = {n: new[m] for n, m in zip(order, reversed(order))}
    back = gpt_predict.repredict(_sweep(reversed_ms), cal, compute_scale=2.0)
    q = back["predictors"]["new"]
    assert q["spearman"] == pytest.approx(-1.0)
    assert q["chosen"] == min(dist, key=dist.get)
    slowest = max(v for n, v in reversed_ms.items() if n != "local")
    assert q["chosen"] == next(n for n, v in reversed_ms.items() if v == slowest)
    assert not q["within_10pct"]


def test_command_line_prints_the_table_and_writes_the_json(tmp_path, capsys):
    cal_path = _calibration().save(tmp_path / "cal.json")
    step_ms = {"local": 900.0, "dp": 500.0, "fsdp": 520.0, "tp": 610.0}
    sweep_path = tmp_path / "sweep.json"
    sweep_path.write_text(json.dumps(_sweep(step_ms)))
    out = tmp_path / "re.json"
    gpt_predict.main(["--repredict", str(sweep_path), "--calibration", str(cal_path),
                      "--out", str(out), "--quiet"])
    text = capsys.readouterr().out
    assert "| strategy | measured ms | old pred ms | new pred ms | new, beside ms |" in text
    assert "| dp | 500 |" in text and "old: Spearman" in text and "choice" in text
    doc = json.loads(out.read_text())
    assert doc["sweep"] == str(sweep_path) and doc["best"] == "dp"
    assert _column(doc, "measured_ms") == pytest.approx(step_ms)
    # the fitted scale predicts the measured local step
    assert _column(doc, "new_ms")["local"] == pytest.approx(900.0, rel=1e-9)
    again = gpt_predict.repredict(_sweep(step_ms), dt.autoshard.load_calibration(cal_path))
    assert _column(again, "new_beside_ms") == pytest.approx(_column(doc, "new_beside_ms"))


def test_bad_input_says_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match="'mlp'.*gpt-tiny"):
        gpt_predict.repredict({"model": "mlp", "ranks": 2, "results": []}, _calibration())
    with pytest.raises(ValueError, match="no results"):
        gpt_predict.repredict({"model": "gpt-tiny", "ranks": 2, "results": []}, _calibration())
    with pytest.raises(SystemExit, match="--repredict needs --calibration"):
        gpt_predict.main(["--repredict", str(tmp_path / "sweep.json")])
