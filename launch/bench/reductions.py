"""Reducing collectives: dtensor's NaN-safe max/min against MPI's predefined MAX/MIN.

Run as ``python -m launch -n 2 -m launch.bench.reductions [--repeat N] [--sizes 8 64]
[--out FILE]``. For NxN float32 buffers it times, in microseconds per call, four
all-reduces on preallocated numpy buffers: ``MPI_Allreduce`` with MPI.MAX (which keeps or
drops a NaN depending on the rank that holds it) and with MPI.SUM, and dtensor's
:meth:`redistribute.comm.Comm.allreduce` with ``op="max"`` (a user-defined op that
propagates NaN, as numpy and PyTorch do) and ``op="sum"``. Each sample is a batched loop;
the four calls are interleaved sample by sample so that they share the machine's load.
Figures: median and fastest sample per rank, then the worst rank.

Output: JSON on stdout (``--out FILE`` too), then a table, from rank 0.
"""

from __future__ import annotations

import os
import sys

# Run as a script, this file's folder is sys.path[0], where the sibling benchmark
# ``redistribute.py`` would shadow the ``redistribute`` package.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import numpy as np
from mpi4py import MPI

from launch.bench._common import (
    Progress,
    bench_args,
    emit,
    environment,
    per_call_us,
    summary,
    table,
    worst_rank,
)
from redistribute import comm as _comm


def main(argv: list[str] | None = None) -> dict:
    """Time the four all-reduces at each size; rank 0 prints the JSON. **Collective**."""
    args = bench_args(
        __doc__.splitlines()[0], argv,
        sizes={"type": int, "nargs": "+", "default": [8, 64], "help": "N of NxN"},
    )
    world, comm = MPI.COMM_WORLD, _comm.world()
    progress = Progress("reductions", len(args.sizes),
                        enabled=world.Get_rank() == 0 and not args.quiet)
    figures = {}
    for n in args.sizes:
        x = np.random.default_rng(world.Get_rank()).standard_normal((n, n)).astype(np.float32)
        y = np.empty_like(x)
        calls = {
            "MPI.MAX": lambda x=x, y=y: world.Allreduce(x, y, MPI.MAX),
            "NaN-safe max": lambda x=x, y=y: comm.allreduce(x, y, op="max"),
            "MPI.SUM": lambda x=x, y=y: world.Allreduce(x, y, MPI.SUM),
            "sum": lambda x=x, y=y: comm.allreduce(x, y, op="sum"),
        }
        samples: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(args.repeat):
            for name, call in calls.items():
                world.Barrier()
                samples[name] += per_call_us(call, repeat=1, number=200, warmup=20)
        for name, values in samples.items():
            stats = summary(values)
            stats["median_us"] = round(worst_rank(stats["median_us"], world), 3)
            stats["min_us"] = round(worst_rank(stats["min_us"], world), 3)
            figures[f"{name} {n}x{n}"] = stats
        progress(f"{n}x{n}")
    doc = {"ranks": world.Get_size(), "environment": environment(), "figures": figures}
    if world.Get_rank() == 0:
        rows = [(name, f["median_us"], f["min_us"], f["samples"]) for name, f in figures.items()]
        emit(doc, args.out, table(("all-reduce", "median us", "min us", "samples"), rows,
                                  title=f"all-reduces on {doc['ranks']} ranks (worst rank)"))
    return doc


if __name__ == "__main__":
    main()
