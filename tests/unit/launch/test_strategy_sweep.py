"""``launch/experiments/strategy_sweep.py``: a chart in every mode; a user's model through
``--model package.module:function`` (the contract and its errors); a model family plugged in
with its own strategies and predictor; the calibration of ``--train --auto`` (measured when
none is stored, or a warning with the command that makes one); progress lines.

The one-rank runs call ``main`` in this process; the runs that need collectives go through
the launcher at 2 ranks.
"""

from __future__ import annotations

import json
import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT
from helpers.jobs import child_env, run_group

import dtensor as dt
from launch.experiments import _families, strategy_sweep
from launch.experiments._families import (
    FunctionalFamily,
    ModelSpecError,
    Prediction,
    load_user_model,
    resolve,
)

LIMIT_S = 180
USER = "launch.examples.sweep_model:build"


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture
def calibration_path(tmp_path, monkeypatch):
    """The default calibration path, in ``tmp_path`` (nothing stored there yet)."""
    path = tmp_path / "calibration.json"
    monkeypatch.setenv("DTENSOR_CALIBRATION", str(path))
    return path


def _builtin_calibration(tmp_path: Path) -> Path:
    path = tmp_path / "builtin.json"
    dt.autoshard.Calibration(ranks=1, mesh_shape=(1,)).save(path)
    return path


# -- a chart in every mode -------------------------------------------------------------------------
@pytest.mark.mode_independent  # the report
@pytest.mark.parametrize("mode", ["forward", "train", "auto"])
def test_png_in_every_mode(mode, tmp_path, capsys, calibration_path):
    """``--png`` writes the mode's chart (or, without matplotlib, says why not)."""
    png = tmp_path / f"{mode}.png"
    args = {"forward": [], "train": ["--train"],
            "auto": ["--train", "--auto", "--count", "3", "--solver", "bnb",
                     "--calibration", str(_builtin_calibration(tmp_path))]}[mode]
    assert strategy_sweep.main([*args, "--size", "tiny", "--repeat", "1", "--quiet",
                                "--png", str(png)]) == 0
    out = capsys.readouterr().out
    if _has_matplotlib():
        assert png.stat().st_size > 0 and f"--png: chart written to {png}" in out
    else:
        assert "--png: matplotlib is not installed" in out and not png.exists()


# -- a user's model ------------------------------------------------------------------------------
def test_users_model_follows_the_contract():
    model = load_user_model(USER, "tiny")
    assert model.name == USER and set(model.shapes) == {"norm.g", "w1", "b1", "w2", "head"}
    assert model.tp["w1"] == dt.Shard(1) and model.tp["norm.g"] == dt.Replicate()
    first, again = model.init(), model.init()
    assert all(np.array_equal(first[n], again[n]) for n in first)
    first["w1"][:] = 0  # copies: the model's values stay
    assert not np.array_equal(model.init()["w1"], first["w1"])
    assert set(model.batch(0)) == {"x", "labels"}
    family = resolve(USER, "tiny")
    assert family.strategies(2) == ["local", "dp", "tp", "2d"] and family.note() is None
    # the same loss as the function's own step on local tensors
    step_fn, params, inputs, _ = __import__("launch.examples.sweep_model",
                                            fromlist=["build"]).build("tiny")
    want = step_fn({n: dt.tensor(a) for n, a in params.items()},
                   {n: dt.tensor(a) for n, a in inputs.items()}).item()
    assert family.reference_loss(optimizer="sgd", clip=1.0) == pytest.approx(want, rel=1e-6)


@pytest.fixture
def user_module(monkeypatch):
    """A module ``sweep_user_models`` with model functions, good and bad."""
    module = types.ModuleType("sweep_user_models")
    w = np.ones((4, 4), np.float32)
    x = np.ones((8, 4), np.float32)

    def loss(p, b):
        return (b["x"] @ p["w"]).square().mean()

    module.no_tp = lambda: (loss, {"w": w}, {"x": x})
    module.sized = lambda size="small": (loss, {"w": np.ones((2 if size == "tiny" else 6,) * 2,
                                                            np.float32)},
                                         {"x": np.ones((8, 2 if size == "tiny" else 6),
                                                       np.float32)})
    module.two = lambda: (loss, {"w": w})
    module.int_param = lambda: (loss, {"w": np.ones((4, 4), np.int64)}, {"x": x})
    module.scalar_input = lambda: (loss, {"w": w}, {"x": np.float32(1)})
    module.not_callable = lambda: ("loss", {"w": w}, {"x": x})
    module.clash = lambda: (loss, {"w": w}, {"w": x})
    module.bad_tp_name = lambda: (loss, {"w": w}, {"x": x}, {"v": dt.Shard(0)})
    module.bad_tp_value = lambda: (loss, {"w": w}, {"x": x}, {"w": "S(0)"})
    module.value = 3
    monkeypatch.setitem(sys.modules, "sweep_user_models", module)
    return module


def test_users_model_without_tp_runs_local_and_dp(user_module):
    family = resolve("sweep_user_models:no_tp", "small")
    assert family.strategies(4) == ["local", "dp"]
    assert "tp and 2d not run" in family.note()
    assert resolve("sweep_user_models:sized", "tiny").shapes == {"w": (2, 2)}  # gets --size
    assert resolve("sweep_user_models:sized", "small").shapes == {"w": (6, 6)}


@pytest.mark.parametrize(("spec", "message"), [
    ("nope", "not a model family (mlp, transformer"),
    ("sweep_user_models:", "expected package.module:function"),
    ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
    ("sweep_user_models:missing", "has no function 'missing'"),
    ("sweep_user_models:value", "has no function 'value'"),
    ("sweep_user_models:two", "must return (step_fn, params, inputs)"),
    ("sweep_user_models:int_param", "parameter 'w' has dtype int64"),
    ("sweep_user_models:scalar_input", "input 'x' is 0-d"),
    ("sweep_user_models:not_callable", "step_fn must be callable"),
    ("sweep_user_models:clash", "names ['w'] are both parameters and inputs"),
    ("sweep_user_models:bad_tp_name", "tp names ['v'], which are not parameters"),
    ("sweep_user_models:bad_tp_value", "tp['w'] = 'S(0)'; use dt.Shard(d)"),
])
def test_users_model_errors_name_the_broken_part(user_module, spec, message):
    with pytest.raises(ModelSpecError) as err:
        resolve(spec, "small")
    assert message in str(err.value)


@pytest.mark.mode_independent  # the command line
def test_command_line_errors(user_module, capsys):
    """Bad combinations end with a usage error naming the problem."""
    for argv, message in [
        (["--model", "sweep_user_models:two", "--train"], "must return (step_fn, params"),
        (["--model", "transformer"], "the forward sweep runs mlp or attention"),
        (["--model", "attention", "--train"], "forward only"),
        (["--auto"], "--auto needs --train"),
        (["--mesh", "2,2"], "--mesh 2,2 has 4 ranks; this job has 1"),
        (["--mesh", "2,x"], "positive integers, comma-separated"),
        (["--train", "--mesh", "1"], "--mesh applies to the forward sweep and --auto"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            strategy_sweep.main(argv)
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err, argv


def test_help_describes_the_model_contract(capsys):
    with pytest.raises(SystemExit):
        strategy_sweep.main(["--help"])
    out = capsys.readouterr().out
    assert "(step_fn, params, inputs)" in out and USER in out
    assert "transformer" in out and "(default: small)" in out


# -- a model family with its own strategies and predictor ---------------------------------------------
@dataclass
class _Family:
    """A family that wraps the MLP under its own strategy names and prices whole steps."""

    inner: FunctionalFamily
    name: str = "toy"

    def __post_init__(self):
        self.shapes = self.inner.shapes
        self.predicted = []

    def strategies(self, world):
        return ["single", "data", "tensor"]

    def build(self, strategy, *, optimizer, clip):
        own = {"single": "local", "data": "dp", "tensor": "tp"}[strategy]
        return self.inner.build(own, optimizer=optimizer, clip=clip)

    def reference_loss(self, *, optimizer, clip):
        return self.inner.reference_loss(optimizer=optimizer, clip=clip)

    def predict(self, strategy, step):
        self.predicted.append(strategy)
        us = {"single": 10.0, "data": 20.0, "tensor": 30.0}[strategy]
        return Prediction({"forward": 1.0, "backward": 2.0, "optimizer": None}, us)

    def auto_model(self):
        return None

    def named_layouts(self, mesh):
        return {}

    def note(self):
        return "toy: three strategies of its own"


@pytest.mark.mode_independent  # the sweep's plumbing
def test_a_registered_family_runs_with_its_own_strategies_and_predictor(tmp_path, capsys,
                                                                          monkeypatch):
    family = _Family(FunctionalFamily(_families.mlp_model(*_families.MLP_SIZES["tiny"])))
    monkeypatch.setitem(_families._FAMILIES, "toy", (lambda size: family, "a toy family"))
    out_path = tmp_path / "toy.json"
    assert strategy_sweep.main(["--train", "--model", "toy", "--repeat", "1",
                                "--out", str(out_path)]) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out_path.read_text())
    assert doc["model"] == "toy" and [r["name"] for r in doc["results"]] == [
        "single", "data", "tensor"]
    assert family.predicted == ["single", "data", "tensor"]
    assert [r["predicted_step_us"] for r in doc["results"]] == [10.0, 20.0, 30.0]
    assert all(r["loss_error"] < 1e-6 for r in doc["results"])
    assert re.search(r"^strategy +mesh +step us +pred step us", out, re.MULTILINE), out
    assert "Spearman rank correlation predicted/measured step:" in out
    assert "toy: three strategies of its own" in out
    assert "strategy_sweep: [3/3] tensor (mesh (1,))" in err
    # no functional form: --auto says so
    with pytest.raises(ValueError, match="family 'toy' has no functional form"):
        strategy_sweep.main(["--train", "--auto", "--model", "toy", "--no-calibrate",
                             "--quiet"])


# -- the calibration of --auto --------------------------------------------------------------------
@pytest.mark.mode_independent
def test_auto_without_a_calibration_warns_with_the_command(calibration_path, tmp_path, capsys):
    """``--no-calibrate`` with nothing stored: built-in constants, a warning that gives the
    command to calibrate (before and after the table), nothing written."""
    out_path = tmp_path / "auto.json"
    assert strategy_sweep.main(["--train", "--auto", "--no-calibrate", "--size", "tiny",
                                "--repeat", "1", "--count", "3", "--solver", "bnb", "--quiet",
                                "--out", str(out_path)]) == 0
    out = capsys.readouterr().out
    warning = (f"WARNING: no calibration of this machine for 1 ranks (none at "
               f"{calibration_path}); predictions use built-in constants")
    assert out.count(warning) == 2, out
    assert "Make one with: python -m launch -n 1 launch/bench/calibrate.py" in out
    assert not calibration_path.exists()
    cal = json.loads(out_path.read_text())["calibration"]
    assert cal == {"source": "built-in", "path": str(calibration_path)}


@pytest.mark.mode_independent  # calibration and reports
def test_auto_calibrates_when_none_is_stored_then_uses_it(tmp_path):
    """At 2 ranks with no calibration stored: the sweep measures one (in well under 30 s),
    stores it where the next run finds it, says so, and draws its chart; progress lines go
    to stderr. The next run reads the stored one."""
    path = tmp_path / "cal" / "calibration.json"
    env = child_env({"DTENSOR_CALIBRATION": str(path)}, drop=["DTENSOR_MESH"])
    args = ["--train", "--auto", "--model", USER, "--size", "tiny", "--repeat", "1",
            "--count", "4", "--solver", "bnb"]

    def sweep(*extra):
        cmd = [sys.executable, "-m", "launch", "-n", "2", "--timeout", str(LIMIT_S),
               "launch/experiments/strategy_sweep.py", *args, *extra]
        proc = run_group(cmd, ROOT, LIMIT_S + 30, env)
        assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
        return proc

    png, out_path = tmp_path / "auto.png", tmp_path / "auto.json"
    first = sweep("--png", str(png), "--out", str(out_path))
    found = re.search(rf"^calibration: no calibration stored at {re.escape(str(path))}; "
                      r"measured now in ([\d.]+) s on mesh \(2,\)", first.stdout, re.MULTILINE)
    assert found and float(found.group(1)) < 30, first.stdout
    cal = dt.autoshard.load_calibration(path)
    assert cal.ranks == 2 and cal.mesh_shape == (2,) and cal.points["kernels"]
    doc = json.loads(out_path.read_text())
    assert doc["calibration"]["source"] == "measured" and doc["model"] == USER
    assert len(doc["results"]) >= 4 and all(r["loss_error"] < 1e-5 for r in doc["results"])
    assert "no calibration stored" in first.stderr and "calibrating this machine" in first.stderr
    assert re.search(r"^strategy_sweep: \[1/\d+\] auto: predicted", first.stderr, re.MULTILINE)
    if _has_matplotlib():
        assert png.stat().st_size > 0
    else:
        assert "matplotlib is not installed" in first.stdout
    second = sweep("--quiet")
    assert f"calibration: stored at {path}" in second.stdout
    assert "strategy_sweep:" not in second.stderr
