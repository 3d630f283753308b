"""The GPT training example's parts and jobs: the FLOP count against a hand count, the
text data (fixed order, disjoint per-rank rows of one global batch for every strategy),
and ``train_gpt.py`` at 2 and 4 ranks (losses equal the local run's, the metrics JSON has
every field, the PNG is written)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import ROOT
from helpers.jobs import child_env, run_group

import dtensor as dt
from launch.examples.gpt import GPT, GPTConfig
from launch.examples.gpt_strategies import Run
from launch.examples.text_data import ByteData, docstring_text

LIMIT_S = 300

pytestmark = pytest.mark.mode_independent  # model sizes, data and jobs, not dispatch


def test_flops_per_token_match_a_hand_count():
    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, d_model=64, bias=False)
    d, v, s, layers = 64, 256, 64, 2
    per_block = 2 * (2 * d) + 4 * d * d + 4 * d * d + 4 * d * d  # 2 norms, attn, fc, proj
    params = v * d + s * d + layers * per_block + 2 * d  # tied head, final norm
    assert params == 119424
    dt.manual_seed(0)
    assert sum(p.numel() for p in GPT(cfg).parameters()) == params == cfg.n_params()
    assert cfg.flops_per_token() == 6 * params + 12 * layers * d * s == 814848


def test_byte_data_is_deterministic_and_splits_per_rank():
    text = bytes(np.random.default_rng(0).integers(32, 127, 20000, dtype=np.uint8))
    data = ByteData(text, val_fraction=0.1, seed=3)
    assert len(data.val) == 2000 and len(data.train) == 18000
    idx, tgt = data.batch(5, 12, 32)
    again, _ = ByteData(text, seed=3).batch(5, 12, 32)
    np.testing.assert_array_equal(idx, again)  # a function of (seed, step) only
    np.testing.assert_array_equal(idx[:, 1:], tgt[:, :-1])  # next-byte targets
    assert not np.array_equal(idx, data.batch(6, 12, 32)[0])
    vidx, _ = data.batch(5, 12, 32, split="val")
    assert set(np.unique(vidx)) <= set(np.unique(data.val))
    for n in (1, 2, 3, 4):  # each data-parallel rank its own rows; together the batch
        parts = [Run("fsdp", None, n, r).inputs(idx, tgt)[0].numpy() for r in range(n)]
        np.testing.assert_array_equal(np.concatenate(parts), idx)
    assert 0 < data.unigram_loss() < np.log(256)


def test_docstring_text_is_real_text_in_a_fixed_order(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    text = docstring_text()
    assert len(text) > 1_000_000
    assert b"Return" in text and b"array" in text
    assert docstring_text() == text  # from the cache file now
    assert list(tmp_path.rglob("docstrings-*.txt"))


def _launch(n: int, *args: str) -> str:
    import sys

    cmd = [sys.executable, "-m", "launch", "-n", str(n), "--timeout", str(LIMIT_S),
           "launch/examples/train_gpt.py", *args]
    proc = run_group(cmd, ROOT, LIMIT_S + 30, child_env(drop=["DTENSOR_MESH"]))
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.mark.parametrize(("n", "strategies"), [
    (2, "local,dp,replicate,fsdp,zero2,tp,tp_sp"),
    (4, "local,fsdp_int,fsdp_tp,hsdp"),
])
def test_train_gpt_tiny_under_each_strategy(tmp_path, n, strategies):
    data = tmp_path / "text.txt"
    data.write_bytes(bytes(np.random.default_rng(1).integers(32, 127, 50000, dtype=np.uint8)))
    out = _launch(n, "--model", "tiny", "--data", str(data), "--strategy", strategies,
                  "--steps", "3", "--eval-interval", "2", "--batch", "4",
                  "--peak-gflops", "50", "--rtol", "1e-5",
                  "--json", str(tmp_path / "m.json"), "--png", str(tmp_path / "m.png"))
    assert "LOSSES DIFFER" not in out
    doc = json.loads((tmp_path / "m.json").read_text())
    assert doc["n_params"] == GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4,
                                        d_model=64, bias=False).n_params()
    assert list(doc["strategies"]) == strategies.split(",")
    for name, rows in doc["strategies"].items():
        assert [r["step"] for r in rows] == [0, 1, 2]
        for r in rows:
            for key in ("loss", "tokens_per_s", "mfu", "peak_bytes", "comm_bytes"):
                assert key in r and r[key] >= 0, (name, key)
        assert "val_loss" in rows[1] and "val_loss" in rows[2]
        if name != "local" and n > 1:
            assert rows[0]["comm_bytes"] > 0, name
    assert (tmp_path / "m.png").stat().st_size > 1000
    assert "max rel diff" in out
