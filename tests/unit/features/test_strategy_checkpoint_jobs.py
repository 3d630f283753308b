"""A GPT checkpoint saved under FSDP at 4 ranks resumes under tensor parallelism at 2 ranks
(``python -m launch`` jobs): the model's and AdamW's state load onto the new layout and
the next losses are those of the local model trained without a break
(``dt.checkpoint.get_state_dict`` / ``set_state_dict`` key the optimizer state by
parameter name)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers import ROOT
from helpers.jobs import child_env, run_group

LIMIT_S = 180

_JOB = """\
import sys
import numpy as np
import dtensor as dt
from launch.examples.gpt import GPTConfig, batch
from launch.examples.gpt_strategies import build

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=12, d_model=48, bias=False)
SAVE_AT, STEPS = 3, 6


def step(run, opt, i):
    idx, tgt = batch(CFG, 12, i)
    loss = run.model(*run.inputs(idx, tgt))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return run.loss_value(loss)


phase, path = sys.argv[1], sys.argv[2]
if phase == "save":
    run = build("fsdp", CFG)
    opt = dt.optim.AdamW(run.model.parameters(), lr=1e-2)
    for i in range(SAVE_AT):
        step(run, opt, i)
    model_sd, optim_sd = dt.checkpoint.get_state_dict(run.model, opt)
    dt.save({"model": model_sd, "optim": optim_sd}, path)
    print("saved", type(run.model.tok_emb.weight).__name__)
else:
    ref = build("local", CFG)
    ropt = dt.optim.AdamW(ref.model.parameters(), lr=1e-2)
    want = [step(ref, ropt, i) for i in range(STEPS)]
    run = build("tp", CFG)
    opt = dt.optim.AdamW(run.model.parameters(), lr=1e-2)
    state = dt.load(path)
    dt.checkpoint.set_state_dict(run.model, opt, model_state_dict=state["model"],
                                 optim_state_dict=state["optim"])
    got = [step(run, opt, i) for i in range(SAVE_AT, STEPS)]
    np.testing.assert_allclose(got, want[SAVE_AT:], rtol=1e-5)
    print("resumed", got)
"""


def _launch(cwd: Path, n: int, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "launch", "-n", str(n), "--timeout", str(LIMIT_S), *args]
    proc = run_group(cmd, cwd, LIMIT_S + 30, child_env(drop=["DTENSOR_MESH"]))
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}"
    return proc


def test_fsdp_checkpoint_at_4_ranks_resumes_under_tp_at_2_ranks(tmp_path):
    (tmp_path / "job.py").write_text(_JOB)
    ckpt = str(tmp_path / "ckpt")
    out = _launch(ROOT, 4, str(tmp_path / "job.py"), "save", ckpt)
    assert "saved DTensor" in out.stdout
    out = _launch(ROOT, 2, str(tmp_path / "job.py"), "resume", ckpt)
    assert "resumed" in out.stdout
