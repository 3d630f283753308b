"""Checkpoint jobs launched from a test (``python -m launch``): a checkpoint written by a
4-rank job read by 1-, 2- and 3-rank jobs; a save killed mid-write (SIGKILL of one rank)
leaves the previous checkpoint loadable; two jobs saving to and loading from one folder at
once; the resume example at 4 then 2 ranks; the checkpoint benchmark at a tiny size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers import ROOT
from helpers.jobs import child_env, job_cwd, run_group

LIMIT_S = 120

# the data of the cross-world-size jobs: key -> (shape, dtype, placements on the 2x2 mesh)
_COMMON = """\
import sys
import numpy as np
from mpi4py import MPI
import dtensor as dt

R, S, P = dt.Replicate(), dt.Shard, dt.Partial
N = MPI.COMM_WORLD.size
TENSORS = {
    "a": ((9, 7), np.float32, [S(0), S(1)]),
    "b": ((5, 3), np.float64, [R, S(0)]),
    "c": ((6,), np.int64, [P("sum"), S(0)]),
    "d": ((3, 0), np.float16, [S(1), R]),
    "e": ((), np.float32, [R, P("max")]),
    "f": ((4, 4), np.bool_, [S(0), S(0)]),
}


def data(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    if np.dtype(dtype) == np.bool_:
        return rng.random(shape) > 0.5
    return (rng.standard_normal(shape) * 10).astype(dtype)


GLOBAL = {k: data(s, t, i) for i, (k, (s, t, _)) in enumerate(TENSORS.items())}
"""

_CROSS = _COMMON + """
path = sys.argv[2]
if sys.argv[1] == "save":
    mesh = dt.init_device_mesh((2, 2), mesh_dim_names=("dp", "tp"))
    state = {"model": {k: dt.distribute_tensor(GLOBAL[k], mesh, pl)
                       for k, (_, _, pl) in TENSORS.items()},
             "step": 11, "host": np.arange(6)}
    dt.save(state, path)
else:
    # load(path) at another world size: every DTensor Replicate on a 1-D mesh of all ranks
    out = dt.load(path)
    assert out["step"] == 11 and np.array_equal(out["host"], np.arange(6))
    for k, x in out["model"].items():
        assert x.placements == (R,) and x.device_mesh.shape == (N,), (k, x)
        assert np.array_equal(x.to_local().numpy(), GLOBAL[k]), k
    # in place onto every 1-D placement
    mesh = dt.init_device_mesh((N,))
    for option in range(3):
        targets = {}
        for k, (shape, dtype, _) in TENSORS.items():
            pl = [[R, P("max"), S(0)][option]] if shape else [[R, P("max"), R][option]]
            targets[k] = dt.distribute_tensor(np.zeros(shape, dtype), mesh, pl)
        dt.load({"model": targets}, path)
        for k, x in targets.items():
            assert np.array_equal(x.full_tensor().numpy(), GLOBAL[k]), (k, x.placements)
        stats = dt.checkpoint.last_load_stats()
        share = sum(x.to_local().numpy().nbytes for x in targets.values())
        assert stats["needed_bytes"] == share, (stats, share)
    print(f"loaded at {N} ranks")
"""

_KILL = _COMMON + """
import os
path = sys.argv[2]
mesh = dt.init_device_mesh((N,))
a = GLOBAL["a"]
if sys.argv[1] == "save":
    dt.save({"w": dt.distribute_tensor(a, mesh, [S(0)]), "step": 1}, path)
    os.environ["_DTENSOR_CHECKPOINT_KILL_RANK"] = "1"  # the private test hook
    dt.save({"w": dt.distribute_tensor(a + 1, mesh, [S(0)]), "step": 2}, path)
    raise SystemExit("the killed save returned")
state = {"w": dt.distribute_tensor(np.zeros_like(a), mesh, [R]), "step": 0}
dt.load(state, path)
assert state["step"] == 1 and np.array_equal(state["w"].to_local().numpy(), a)
dt.save({"w": dt.distribute_tensor(a + 2, mesh, [S(0)]), "step": 3}, path)
dt.load(state, path)
assert state["step"] == 3 and np.array_equal(state["w"].to_local().numpy(), a + 2)
print("previous checkpoint loaded")
"""

# two jobs at once: each saves its own values and loads what is there, ROUNDS times
_RACE = _COMMON + """
from dtensor.errors import CheckpointError

path, job = sys.argv[2], int(sys.argv[3])
mesh = dt.init_device_mesh((N,))
a = GLOBAL["a"]
counts = dict(saved=0, refused=0, loaded=0, replaced=0)
for i in range(int(sys.argv[4])):
    value = job * 1000 + i
    try:
        dt.save({"w": dt.distribute_tensor(np.full_like(a, value), mesh, [S(0)]), "v": value},
                path)
        counts["saved"] += 1
    except CheckpointError as e:  # the other job's save holds the lock
        assert "another save to" in str(e) and "is in progress" in str(e), e
        counts["refused"] += 1
    state = {"w": dt.distribute_tensor(np.zeros_like(a), mesh, [R]), "v": -1}
    try:
        dt.load(state, path)
    except CheckpointError as e:  # replaced during both reads, or none saved yet
        assert "was replaced by another save while this load read it" in str(e) or (
            "no checkpoint at" in str(e) and not counts["saved"]), e
        counts["replaced"] += 1
        continue
    w = state["w"].to_local().numpy()
    assert (w == state["v"]).all(), (state["v"], np.unique(w))  # one whole checkpoint
    counts["loaded"] += 1
print(f"job {job}: {counts}")
"""


def _launch(cwd: Path, n: int, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "launch", "-n", str(n), "--timeout", str(LIMIT_S), *args]
    proc = run_group(cmd, job_cwd(cwd, args), LIMIT_S + 30, child_env(drop=["DTENSOR_MESH"]))
    if ok:
        assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.mark.mode_independent  # file IO and layout math, below the dispatch
def test_checkpoint_of_4_ranks_loads_at_1_2_and_3_ranks(tmp_path):
    (tmp_path / "job.py").write_text(_CROSS)
    ckpt = str(tmp_path / "ckpt")
    _launch(tmp_path, 4, "job.py", "save", ckpt)
    meta = json.loads((tmp_path / "ckpt" / "metadata.json").read_text())
    assert meta["world_size"] == 4
    placed = {t["key"]: t.get("placements") for t in meta["tensors"]}
    assert placed["model.c"] == ["R", "S(0)"]  # Partial reduced before the write
    for n in (1, 2, 3):
        assert f"loaded at {n} ranks" in _launch(tmp_path, n, "job.py", "load", ckpt).stdout


@pytest.mark.mode_independent  # file IO, below the dispatch
def test_save_killed_mid_write_keeps_the_previous_checkpoint(tmp_path):
    (tmp_path / "job.py").write_text(_KILL)
    ckpt = tmp_path / "ckpt"
    proc = _launch(tmp_path, 2, "job.py", "save", str(ckpt), ok=False)
    assert proc.returncode == 128 + 9, proc.stderr  # the launcher reports the SIGKILL
    (tmp,) = tmp_path.glob(".ckpt.dtensor-tmp-*")
    assert list(tmp.glob("data-*.bin")) and not (tmp / "metadata.json").exists()
    out = _launch(tmp_path, 2, "job.py", "load", str(ckpt)).stdout
    assert "previous checkpoint loaded" in out
    assert not tmp.exists()  # the next save removed the leftover
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "job.py"]


@pytest.mark.mode_independent  # file IO, below the dispatch
def test_two_jobs_saving_to_one_folder_at_once(tmp_path):
    """Two 2-rank jobs save to and load from one checkpoint at once: a save that finds the
    other's in progress fails cleanly on every rank, a load always gets one whole
    checkpoint (or says it was replaced meanwhile), and the folder ends with one complete
    checkpoint and nothing else."""
    (tmp_path / "job.py").write_text(_RACE)
    ckpt = str(tmp_path / "ckpt")
    with ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(_launch, tmp_path, 2, "job.py", "race", ckpt, str(job), "20")
                for job in (1, 2)]
        outs = [job.result().stdout for job in jobs]
    assert all(f"job {job}: " in out for job, out in zip((1, 2), outs)), outs
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "job.py"]
    meta = json.loads((tmp_path / "ckpt" / "metadata.json").read_text())
    assert meta["structure"]["dict"][1][1]["value"] in {j * 1000 + i for j in (1, 2)
                                                          for i in range(20)}


def test_resume_example_at_4_then_2_ranks(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    script = str(ROOT / "launch" / "examples" / "checkpoint_resume.py")
    out = _launch(ROOT, 4, script, "--dir", ckpt).stdout
    assert "saved step 3 from 4 ranks" in out
    out = _launch(ROOT, 2, script, "--dir", ckpt, "--resume", "--steps", "2").stdout
    assert "resumed at step 3 on 2 ranks, mesh (2,), from a checkpoint of 4 ranks" in out
    assert "saved step 5 from 2 ranks" in out


@pytest.mark.mode_independent  # file IO, below the dispatch
def test_checkpoint_benchmark_at_a_tiny_size(tmp_path):
    out = tmp_path / "bench.json"
    work = tmp_path / "work"
    work.mkdir()
    _launch(ROOT, 2, "-m", "launch.bench.checkpoint", "--mib", "1", "--repeat", "1",
            "--dir", str(work), "--out", str(out))
    doc = json.loads(out.read_text())
    assert doc["ranks"] == 2 and doc["bytes"] >= 2**20 - 4096 * 4
    assert set(doc["figures"]) == {"dt.save", "dt.save(sync=False)", "np.save", "np.save+fsync",
                                   "dt.load", "np.load", "np.load into"}
    assert all(f["median_s"] > 0 for f in doc["figures"].values())
    assert set(doc["ratios"]) == {"save/np.save", "save/np.save+fsync", "save(sync=False)/np.save",
                                  "load/np.load", "load/np.load into"}
    assert set(doc["worst_round_ratios"]) == set(doc["ratios"])
    assert doc["date"].endswith("UTC") and len(doc["load_average"]["before"]) == 3
    assert os.listdir(work) == []  # the run removed what it wrote
