"""Calibrate this machine: collective alpha/beta per mesh dim and kernel throughput per op
class (:func:`dtensor.autoshard.calibrate`).

Run as ``python -m launch -n 4 launch/bench/calibrate.py --out costs.json``, then
``export DTENSOR_COST_MODEL=costs.json`` so that strategy choices use the measured constants.

On a 1-D mesh over all ranks (``--mesh 2,2`` for another shape) the library times
``DTensor.redistribute`` for each collective kind of the cost model (``all_gather``
S(0)->R, ``reduce_scatter`` P(sum)->S(0), ``all_reduce`` P(sum)->R, ``all_to_all``
S(0)->S(1)) on each mesh dim at several sizes (float32 NxN), takes the slowest rank's
median time per call and fits ``time = alpha + bytes / beta`` by least squares, ``bytes``
being the per-rank traffic the cost model assigns to the step; it also times one op per
class (matmul, softmax, add, transpose) on replicated DTensors and fits ``alpha + work /
rate``. The whole calibration (what ``dt.auto_shard`` reads) is stored at ``--calibration``
(default: :func:`dtensor.autoshard.default_path`). ``--out`` gets the cost model alone, in
its format (:class:`redistribute.cost.CostModel`: top-level ``alpha_s`` and
``beta_bytes_per_s``, the medians, ``per_kind`` and ``per_mesh_dim`` overrides); the
collectives' measured points go to ``<out>.points.json`` (the cost model rejects unknown
fields). Rank 0 prints the cost model's JSON, then the fitted constants as a table.
"""

from __future__ import annotations

import os
import sys

# Run as a script, this file's folder is sys.path[0], where a benchmark's name could shadow
# a package (launch/bench/redistribute.py): it goes; the installed packages are imported.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import json
import math

from mpi4py import MPI

import dtensor as dt
from dtensor.autoshard import calibrate
from launch.bench._common import Progress, bench_args, environment, table


def main(argv: list[str] | None = None) -> int:
    """Measure, fit and write the calibration (and the cost model JSON) on rank 0.
    **Collective**."""
    args = bench_args(
        __doc__.splitlines()[0],
        argv,
        sizes={"default": "64,256,1024", "help": "comma-separated N of the NxN float32 tensors"},
        comm_sizes={"default": "64,256,1024,2048",
                    "help": "comma-separated N of the collectives' NxN float32 tensors (they "
                    "reach past the caches: large collectives run at about half the bandwidth "
                    "of small ones)"},
        mesh={"default": None, "help": "mesh shape, e.g. 2,2 (default: all ranks in 1-D)"},
        calibration={"default": None, "help": "where to store the calibration JSON"},
    )
    comm = MPI.COMM_WORLD
    if comm.size < 2:
        if comm.rank == 0:
            print("calibrate: needs at least 2 ranks (python -m launch -n 2 ...)")
        return 2
    shape = tuple(int(s) for s in args.mesh.split(",")) if args.mesh else (comm.size,)
    mesh = dt.init_device_mesh(shape)
    sizes = tuple(int(s) for s in args.sizes.split(","))
    progress = Progress("calibrate", 1, enabled=comm.rank == 0 and not args.quiet)
    progress(f"measuring collectives, kernels and a small step on mesh {shape}", step=False)
    comm_sizes = tuple(int(s) for s in args.comm_sizes.split(","))
    result = calibrate(mesh, args.calibration, sizes=sizes, repeat=args.repeat,
                       comm_sizes=comm_sizes)
    progress("done")
    if comm.rank == 0:
        text = json.dumps(result.cost_model, indent=2)
        print(text)
        print("kernels:", json.dumps(result.to_dict()["kernels"]))
        print()
        print(report(result))
        print("calibration stored at", args.calibration or dt.autoshard.default_path(comm.size))
        if args.out:
            with open(args.out, "w", encoding="utf-8") as f:
                f.write(text + "\n")
            points = result.points["collectives"][next(iter(result.points["collectives"]))]
            points_doc = {"ranks": comm.size, "env": environment(), "points": points}
            with open(args.out + ".points.json", "w", encoding="utf-8") as f:
                json.dump(points_doc, f, indent=2)
    return 0


def report(result: dt.autoshard.Calibration) -> str:
    """The fitted constants as tables. **Local**."""
    per_dim = result.cost_model.get("per_mesh_dim", {})
    rows = [(dim, kind, v["alpha_s"] * 1e6, v["beta_bytes_per_s"] / 1e9)
            for dim, kinds in per_dim.items() for kind, v in kinds.items()]
    out = table(("mesh dim", "collective", "alpha us", "beta GB/s"), rows,
                title=f"calibration of {result.ranks} ranks, mesh {result.mesh_shape}")
    rows = [(cls, k["alpha_s"] * 1e6, "-" if not math.isfinite(k["rate"]) else k["rate"] / 1e9)
            for cls, k in result.kernels.items()]
    return out + "\n\n" + table(
        ("op class", "alpha us", "rate G/s"), rows,
        notes=[(f"per traced entry of a step: {result.entry_s * 1e6:.1f} us; per collective in "
               f"a step: {result.sync_s * 1e6:.1f} us"),
               (f"large copies: {result.copy_rate / 1e9:.2f} GB/s (read + written); compute "
                f"beside the worker's all-gathers: {result.overlap_slowdown:.2f}x its time "
                "alone")])


if __name__ == "__main__":
    sys.exit(main())
