"""Calibrate the redistribute cost model on this machine: alpha and beta per collective.

Run as ``python -m launch -n 4 launch/bench/calibrate.py --out costs.json``, then
``export DTENSOR_COST_MODEL=costs.json`` so that strategy choices use the measured constants.

On a 1-D mesh over all ranks it times ``DTensor.redistribute`` for each collective kind of
the cost model (``all_gather`` S(0)->R, ``reduce_scatter`` P(sum)->S(0), ``all_reduce``
P(sum)->R, ``all_to_all`` S(0)->S(1)) at several sizes (float32 NxN), takes the slowest
rank's median time per call and fits ``time = alpha + bytes / beta`` by least squares,
``bytes`` being the per-rank traffic the cost model assigns to the step. The JSON written
is the cost model's format (:class:`redistribute.cost.CostModel`): top-level ``alpha_s`` and
``beta_bytes_per_s`` (the medians over kinds) and ``per_kind`` overrides. The measured
points go to a second file, ``<out>.points.json`` (the cost model rejects unknown fields).
"""

from __future__ import annotations

import os
import sys

# Run as a script, this file's folder is sys.path[0], where a benchmark's name could shadow
# a package (launch/bench/redistribute.py): it goes; the installed packages are imported.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import json
import statistics

import numpy as np
from mpi4py import MPI

import dtensor as dt
from launch.bench._common import bench_args, each_call_us, environment
from redistribute.cost import CostModel, step_bytes
from redistribute.plan import plan

R, S, P = dt.Replicate(), dt.Shard, dt.Partial

#: kind -> (source placements, target placements) on a 1-D mesh
CASES = {
    "all_gather": ([S(0)], [R]),
    "reduce_scatter": ([P("sum")], [S(0)]),
    "all_reduce": ([P("sum")], [R]),
    "all_to_all": ([S(0)], [S(1)]),
}


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``(alpha_s, beta_bytes_per_s)`` of ``seconds = alpha + bytes / beta``.

    **Local**. Alpha is clipped at 0; a slope that does not lift the fitted time measurably
    across the byte range (time not growing with bytes, as on tiny sizes only; the fit of
    flat data leaves a slope of rounding noise, of either sign) gives an infinite-like beta
    of 1e12 B/s.
    """
    x = np.array([b for b, _ in points], dtype=float)
    y = np.array([s for _, s in points], dtype=float)
    slope, intercept = np.polyfit(x, y, 1) if len(set(x)) > 1 else (0.0, float(y.mean()))
    rise = slope * (x.max() - x.min())
    beta = 1.0 / slope if rise > 1e-9 * np.abs(y).max() else 1e12
    return max(float(intercept), 0.0), float(beta)


def measure(mesh: dt.DeviceMesh, sizes: list[int], repeat: int) -> dict[str, list]:
    """``{kind: [(bytes, seconds), ...]}`` for every case and size. **Collective**."""
    comm = MPI.COMM_WORLD
    out: dict[str, list] = {}
    for kind, (src, dst) in CASES.items():
        for n in sizes:
            a = np.ones((n, n), np.float32)
            if src[0].is_partial():
                x = dt.DTensor.from_local(dt.from_numpy(a), mesh, src)
            else:
                x = dt.distribute_tensor(a, mesh, src, src_data_rank=None)
            steps = plan(x._spec, dst)
            nbytes = sum(step_bytes(s, x._spec) for s in steps if s.communicates)
            samples = each_call_us(
                lambda x=x, dst=dst: x.redistribute(mesh, dst), repeat=repeat, comm=comm
            )
            seconds = comm.allreduce(statistics.median(samples), op=MPI.MAX) * 1e-6
            out.setdefault(kind, []).append((nbytes, seconds))
    return out


def main(argv: list[str] | None = None) -> int:
    """Measure, fit and write the cost model JSON on rank 0. **Collective**."""
    args = bench_args(
        __doc__.splitlines()[0],
        argv,
        sizes={"default": "64,256,1024", "help": "comma-separated N of the NxN float32 tensors"},
    )
    comm = MPI.COMM_WORLD
    if comm.size < 2:
        if comm.rank == 0:
            print("calibrate: needs at least 2 ranks (python -m launch -n 2 ...)")
        return 2
    mesh = dt.init_device_mesh((comm.size,))
    points = measure(mesh, [int(s) for s in args.sizes.split(",")], args.repeat)
    per_kind = {}
    for kind, pts in points.items():
        alpha, beta = fit(pts)
        per_kind[kind] = {"alpha_s": alpha, "beta_bytes_per_s": beta}
    model = {
        "alpha_s": statistics.median(v["alpha_s"] for v in per_kind.values()),
        "beta_bytes_per_s": statistics.median(v["beta_bytes_per_s"] for v in per_kind.values()),
        "per_kind": per_kind,
    }
    CostModel(**model)  # validates what is written
    if comm.rank == 0:
        text = json.dumps(model, indent=2)
        print(text)
        if args.out:
            with open(args.out, "w", encoding="utf-8") as f:
                f.write(text + "\n")
            points_doc = {"ranks": comm.size, "env": environment(), "points": points}
            with open(args.out + ".points.json", "w", encoding="utf-8") as f:
                json.dump(points_doc, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
