"""``train_gpt.py --save`` / ``--resume``: a run of N steps saved under one strategy and rank
count, resumed for M steps under another, gives the losses of N + M steps straight through
(parameters, AdamW moments and step counts, the learning-rate schedule, the step counter
and the data position all carried); and the errors: a checkpoint of another model names
the parameter and both shapes, several strategies with --save or --resume, no checkpoint."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from helpers import ROOT
from helpers.jobs import child_env, run_group

import dtensor as dt

LIMIT_S = 300
N, M = 3, 3  # steps before the save, steps after the resume

pytestmark = pytest.mark.mode_independent  # jobs and their losses, not dispatch


def _launch(n: int, *args: str) -> str:
    cmd = [sys.executable, "-m", "launch", "-n", str(n), "--timeout", str(LIMIT_S),
           "launch/examples/train_gpt.py", *args]
    proc = run_group(cmd, ROOT, LIMIT_S + 30, child_env(drop=["DTENSOR_MESH"]))
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _common(data) -> list[str]:
    # lr 1e-2 from a 2-step warmup: the moments and the schedule move the losses at once
    return ["--model", "tiny", "--data", str(data), "--batch", "4", "--lr", "1e-2",
            "--warmup", "2", "--eval-interval", "2", "--peak-gflops", "50"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The text file and the losses of N + M steps straight through (local, one rank)."""
    folder = tmp_path_factory.mktemp("straight")
    data = folder / "text.txt"
    data.write_bytes(bytes(np.random.default_rng(1).integers(32, 127, 50000, dtype=np.uint8)))
    _launch(1, *_common(data), "--strategy", "local", "--steps", str(N + M),
            "--json", str(folder / "m.json"))
    rows = json.loads((folder / "m.json").read_text())["strategies"]["local"]
    assert [r["step"] for r in rows] == list(range(N + M))
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.1  # it learns: the steps matter
    return data, rows


def _losses(path, name):
    return json.loads(path.read_text())["strategies"][name]


@pytest.mark.parametrize(("save_n", "save_as", "resume_n", "resume_as", "extra"), [
    (2, "fsdp", 4, "tp", []),
    (2, "tp", 1, "local", ["--ac"]),  # activation checkpointing's wrapper in the names
    (4, "hsdp", 2, "dp", []),
])
def test_resume_under_another_strategy_and_rank_count_continues_the_run(
        tmp_path, straight, save_n, save_as, resume_n, resume_as, extra):
    data, ref = straight
    ckpt = tmp_path / "ckpt"
    out = _launch(save_n, *_common(data), "--strategy", save_as, "--steps", str(N),
                  "--total-steps", str(N + M), "--save", str(ckpt), "--save-every", "2",
                  "--json", str(tmp_path / "a.json"))
    assert f"saved step 2 to {ckpt}" in out and f"saved step {N} to {ckpt}" in out
    first = _losses(tmp_path / "a.json", save_as)
    out = _launch(resume_n, *_common(data), *extra, "--strategy", resume_as,
                  "--steps", str(M), "--resume", str(ckpt), "--json", str(tmp_path / "b.json"))
    assert f"resumed step {N} (data position {N}" in out
    assert f"saved under {save_as} at {save_n} ranks" in out
    second = _losses(tmp_path / "b.json", resume_as)
    rows = first + second
    assert [r["step"] for r in rows] == list(range(N + M))
    np.testing.assert_allclose([r["loss"] for r in rows], [r["loss"] for r in ref],
                               rtol=1e-5, atol=0)
    for got, want in zip(rows, ref):  # validation where both runs evaluated
        if "val_loss" in got and "val_loss" in want:
            np.testing.assert_allclose(got["val_loss"], want["val_loss"], rtol=1e-5)
    assert sum("val_loss" in r for r in second) == 2  # steps 3 and 5


def _main(*argv: str) -> int:
    from launch.examples.train_gpt import main

    return main(list(argv))


def test_resume_a_checkpoint_of_another_model_names_the_parameter_and_shapes(
        tmp_path, straight, capsys):
    data, _ = straight
    ckpt = tmp_path / "ckpt"
    assert _main(*_common(data), "--steps", "1", "--save", str(ckpt)) == 0
    capsys.readouterr()
    assert _main(*_common(data), "--model", "small", "--steps", "1",
                 "--resume", str(ckpt)) == 2
    out = capsys.readouterr().out
    assert "train_gpt.py: error: --resume" in out and "holds another model" in out
    assert "--model tiny" in out and "--model small" in out
    assert "pos_emb.weight has shape (64, 64) in the checkpoint but (256, 384) in this " \
           "model" in out
    assert "blocks.5.ln1.weight (384,) is not in the checkpoint" in out or "more" in out


def test_resume_and_save_errors(tmp_path, straight, capsys):
    data, _ = straight
    for flags in (["--save", str(tmp_path / "c")], ["--resume", str(tmp_path / "c")]):
        with pytest.raises(SystemExit) as info:
            _main(*_common(data), "--strategy", "local,fsdp", *flags)
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert f"{flags[0]} take one strategy; --strategy gives 2 (local,fsdp)" in err
    with pytest.raises(SystemExit):
        _main(*_common(data), "--save-every", "2")
    assert "--save-every 2 needs --save DIR" in capsys.readouterr().err
    assert _main(*_common(data), "--steps", "1", "--resume", str(tmp_path / "none")) == 2
    assert f"--resume {tmp_path / 'none'}: no checkpoint there" in capsys.readouterr().out
    dt.save({"w": np.ones(3, np.float32)}, str(tmp_path / "other"))
    assert _main(*_common(data), "--steps", "1", "--resume", str(tmp_path / "other")) == 2
    assert "not a checkpoint of train_gpt.py" in capsys.readouterr().out


def test_resume_rejects_a_schedule_that_differs(tmp_path, straight, capsys):
    data, _ = straight
    ckpt = tmp_path / "ckpt"
    assert _main(*_common(data), "--steps", "1", "--total-steps", "4",
                 "--save", str(ckpt)) == 0
    capsys.readouterr()
    assert _main(*_common(data), "--steps", "1", "--total-steps", "9",
                 "--resume", str(ckpt)) == 2
    assert "--total-steps 9 differs from the checkpoint's schedule (--total-steps 4)" in \
        capsys.readouterr().out


def test_resume_in_another_dtype_casts_the_saved_tensors(tmp_path, straight, capsys):
    """A float32 checkpoint resumed with --dtype bfloat16 (local: bfloat16 parameters and
    moments): the first resumed loss is the straight run's to bfloat16's precision."""
    data, ref = straight
    ckpt = tmp_path / "ckpt"
    assert _main(*_common(data), "--steps", str(N), "--total-steps", str(N + M),
                 "--save", str(ckpt)) == 0
    assert _main(*_common(data), "--steps", "1", "--dtype", "bfloat16", "--resume", str(ckpt),
                 "--json", str(tmp_path / "b.json")) == 0
    capsys.readouterr()
    (row,) = _losses(tmp_path / "b.json", "local")
    assert row["step"] == N
    np.testing.assert_allclose(row["loss"], ref[N]["loss"], rtol=1e-2)
