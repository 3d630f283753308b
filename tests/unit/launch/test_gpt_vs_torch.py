"""``launch/bench/gpt_vs_torch.py``: the torch twin of the GPT has dtensor's parameter names
and shapes and computes the same loss from the same weights; the benchmark at 2 ranks runs
every mode with the tiny model, both sides' first-step losses agree to float32 rounding and
its JSON has every field; without torch it says so and times dtensor alone (exit 0)."""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest
from helpers import ROOT
from helpers.jobs import child_env, run_group

import dtensor as dt
from launch.examples.gpt import GPT, GPTConfig, batch

LIMIT_S = 300
MODES = ("local", "dp", "replicate", "fsdp", "tp")

pytestmark = pytest.mark.mode_independent  # a benchmark job and a torch model, not dispatch


@pytest.mark.torch
def test_torch_twin_has_the_names_and_shapes_and_gives_the_same_loss():
    import torch  # lazy: the tests' oracle, marked torch

    from launch.bench._torch_gpt import TorchGPT, load_numpy

    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, d_model=32, bias=True)
    dt.manual_seed(3)
    ours = GPT(cfg)
    weights = {n: p.detach().numpy().copy() for n, p in ours.named_parameters()}
    theirs = TorchGPT(cfg)
    assert {n: tuple(p.shape) for n, p in theirs.named_parameters()} == {
        n: a.shape for n, a in weights.items()}
    assert theirs.head.weight is theirs.tok_emb.weight  # tied, as in gpt.py
    load_numpy(theirs, weights)
    idx, tgt = batch(cfg, 4, seed=1)
    want = float(ours(dt.tensor(idx), dt.tensor(tgt)).item())
    got = float(theirs(torch.from_numpy(idx), torch.from_numpy(tgt)).item())
    assert got == pytest.approx(want, rel=1e-5)
    with pytest.raises(ValueError, match="tok_emb.weight has shape"):
        load_numpy(theirs, {**weights, "tok_emb.weight": np.zeros((3, 3), np.float32)})
    with pytest.raises(KeyError, match="ln_f.bias"):
        load_numpy(theirs, {n: a for n, a in weights.items() if n != "ln_f.bias"})


@pytest.mark.torch
def test_every_mode_at_2_ranks_agrees_with_torch_and_reports_every_field(tmp_path):
    path = tmp_path / "gpt_vs_torch.json"
    cmd = [sys.executable, "-m", "launch", "-n", "2", "--timeout", str(LIMIT_S),
           "launch/bench/gpt_vs_torch.py", "--model", "tiny", "--steps", "3", "--warmup", "1",
           "--strategy", ",".join(MODES), "--out", str(path)]
    proc = run_group(cmd, ROOT, LIMIT_S + 30, child_env(drop=["DTENSOR_MESH"]))
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    doc = json.loads(path.read_text())
    assert doc["ranks"] == 2 and doc["model"] == "tiny" and doc["steps"] == 3
    assert doc["tokens_per_step"] == 8 * 64 and doc["torch_threads"] == doc["blas_threads"] == 1
    assert set(doc["modes"]) == set(MODES) == set(doc["targets_met"])
    for mode, row in doc["modes"].items():
        for side in ("dtensor", "torch"):
            assert row[f"{side}_step_ms"] > 0, (mode, side)
            assert set(row[f"{side}_phases_ms"]) == {"forward", "backward", "optimizer"}
            step_tps = doc["tokens_per_step"] / (row[f"{side}_step_ms"] / 1e3)
            assert row[f"{side}_tokens_per_s"] == pytest.approx(step_tps, rel=1e-2)
            assert len(row[f"{side}_losses"]) == 3
            assert row[f"{side}_rss_mib"] > 0, (mode, side)  # a model, Adam state, activations
        assert row["rss_method"] in ("VmHWM - VmRSS", "ru_maxrss delta")
        assert row["ratio"] == round(row["dtensor_tokens_per_s"] / row["torch_tokens_per_s"], 2)
        assert row["target_met"] is (row["ratio"] >= doc["target_ratio"])
        # the same weights and batches: float32 rounding apart
        assert math.isclose(row["loss0_dtensor"], row["loss0_torch"], rel_tol=1e-5), mode
        assert row["loss0_rel_diff"] < 1e-5 and row["max_rel_loss_diff"] < 1e-4, mode
        assert 5.0 < row["loss0_dtensor"] < 6.0  # about ln(256): an untrained byte model
    losses = {m: r["loss0_dtensor"] for m, r in doc["modes"].items()}
    assert max(losses.values()) - min(losses.values()) < 1e-5  # one model under every layout
    tables = proc.stdout[proc.stdout.rindex("\n}\n"):]  # after the JSON
    for mode in MODES:
        assert f"| {mode} | " in tables


_NO_TORCH = """
import runpy, sys
sys.modules["torch"] = None  # import torch fails, importlib.util.find_spec gives None
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_without_torch_it_says_so_and_runs_dtensor_alone(tmp_path):
    path = tmp_path / "out.json"
    script = str(ROOT / "launch" / "bench" / "gpt_vs_torch.py")
    proc = run_group([sys.executable, "-c", _NO_TORCH, script, "--model", "tiny", "--steps",
                      "2", "--warmup", "1", "--strategy", "local,tp", "--no-memory", "--out",
                      str(path)], tmp_path, 120, child_env())  # not ROOT: its source tree
    assert proc.returncode == 0, proc.stderr
    assert "torch is not installed" in proc.stdout
    doc = json.loads(path.read_text())
    assert doc["torch"] is None and doc["targets_met"] == {}
    for mode in ("local", "tp"):
        row = doc["modes"][mode]
        assert row["torch"] is None and row["dtensor_step_ms"] > 0 and "ratio" not in row
        assert f"| {mode} | {mode} | - | " in proc.stdout
