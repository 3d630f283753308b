"""Save a run's state and resume it at another rank count.

``python -m launch -n 4 launch/examples/checkpoint_resume.py --dir CKPT`` runs a few forward
steps ``x <- tanh(relu(x @ w1) @ w2)`` with ``x`` sharded by rows and the weights sharded
Megatron style (2x2 ``("dp", "tp")`` mesh at 4 ranks, a 1-D mesh otherwise) and saves
``{"step", "x", "w1", "w2"}`` with ``dt.save``.
``python -m launch -n 2 launch/examples/checkpoint_resume.py --dir CKPT --resume`` builds the
same state on its own mesh and placements, fills it in place with ``dt.load`` (each rank
reads only its shard's bytes), checks it against numpy, runs more steps and saves again.
Without ``--dir`` the run saves into a temporary folder that it removes at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

import numpy as np
from mpi4py import MPI

import dtensor as dt

R, S = dt.Replicate(), dt.Shard
SHAPES = {"x": (12, 16), "w1": (16, 24), "w2": (24, 16)}


def initial() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {k: (rng.standard_normal(s) / np.sqrt(s[0])).astype(np.float32)
            for k, s in SHAPES.items()}


def reference(steps: int) -> np.ndarray:
    """``x`` after ``steps`` steps, in numpy."""
    a = initial()
    x = a["x"]
    for _ in range(steps):
        x = np.tanh(np.maximum(x @ a["w1"], 0) @ a["w2"])
    return x


def layout() -> tuple[dt.DeviceMesh, dict[str, list]]:
    """This world size's mesh and the placements of each tensor."""
    n = MPI.COMM_WORLD.size
    if n == 4:
        mesh = dt.init_device_mesh((2, 2), mesh_dim_names=("dp", "tp"))
        return mesh, {"x": [S(0), R], "w1": [R, S(1)], "w2": [R, S(0)]}
    mesh = dt.init_device_mesh((n,), mesh_dim_names=("tp",))
    return mesh, {"x": [R], "w1": [S(1)], "w2": [S(0)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", help="the checkpoint folder (default: a temporary one)")
    parser.add_argument("--resume", action="store_true", help="load the checkpoint first")
    parser.add_argument("--steps", type=int, default=3, help="forward steps to run")
    args = parser.parse_args()
    if args.resume and args.dir is None:
        parser.error("--resume needs --dir")
    rank, n = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
    scratch = None
    if args.dir is None:
        scratch = MPI.COMM_WORLD.bcast(tempfile.mkdtemp() if rank == 0 else None)
        args.dir = os.path.join(scratch, "ckpt")
    mesh, placements = layout()
    # the state, built the same way for a fresh start and for a resume
    state = {"step": 0, **{k: dt.distribute_tensor(a, mesh, placements[k])
                           for k, a in initial().items()}}
    if args.resume:
        dt.load(state, args.dir)  # in place, resharded onto this mesh
        with open(os.path.join(args.dir, "metadata.json")) as fh:
            saved_ranks = json.load(fh)["world_size"]
        err = float(np.abs(state["x"].full_tensor().numpy() - reference(state["step"])).max())
        read = dt.checkpoint.last_load_stats()["data_bytes"]
        if rank == 0:
            print(f"resumed at step {state['step']} on {n} ranks, mesh {mesh.shape}, from a "
                  f"checkpoint of {saved_ranks} ranks; rank 0 read {read} data bytes; "
                  f"max |x - numpy| = {err:.1e}")
        assert err < 1e-5
    x, w1, w2 = state["x"], state["w1"], state["w2"]
    for _ in range(args.steps):
        x = (x @ w1).relu() @ w2  # x [S(0)] or [R] @ w1 [S(1)] -> @ w2 [S(0)] -> Partial
        x = x.tanh().redistribute(mesh, placements["x"])
    state["x"], state["step"] = x, state["step"] + args.steps
    err = float(np.abs(x.full_tensor().numpy() - reference(state["step"])).max())
    assert err < 1e-5
    dt.save(state, args.dir)
    if rank == 0:
        print(f"saved step {state['step']} from {n} ranks (x {x.placements}); "
              f"max |x - numpy| = {err:.1e}")
        if scratch is not None:
            shutil.rmtree(scratch)


if __name__ == "__main__":
    main()
