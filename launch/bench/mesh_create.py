"""Mesh creation time: ``dt.init_device_mesh`` called again and again with the same shape.

Run as ``python -m launch -n 2 -m launch.bench.mesh_create [--repeat N] [--out FILE]``.
For the 1-D mesh ``(n,)`` and the 2-D mesh ``(n, 1)`` over all ``n`` ranks it reports the
microseconds of one ``init_device_mesh`` call (each sample times one call after a barrier,
so every rank starts it together; the median per rank, then the worst rank). The first
call of each shape is a warm-up: it is the one that creates the mesh's communicators, the
later ones find them (identical meshes share their communicators).

Output: JSON on stdout (``--out FILE`` too), then a table, from rank 0.
"""

from __future__ import annotations

import os
import sys

# Run as a script, this file's folder is sys.path[0], where the sibling benchmark
# ``redistribute.py`` would shadow the ``redistribute`` package.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

from mpi4py import MPI

import dtensor as dt
from launch.bench._common import (
    Progress,
    bench_args,
    each_call_us,
    emit,
    environment,
    summary,
    table,
    worst_rank,
)


def main(argv: list[str] | None = None) -> None:
    """Time mesh creation on every rank; rank 0 prints the JSON. **Collective**."""
    args = bench_args(__doc__.splitlines()[0], argv)
    world = MPI.COMM_WORLD
    n = world.Get_size()
    figures = {}
    progress = Progress("mesh_create", 2, enabled=world.Get_rank() == 0 and not args.quiet)
    for shape in ((n,), (n, 1)):
        samples = each_call_us(
            lambda shape=shape: dt.init_device_mesh(shape), repeat=args.repeat, comm=world
        )
        stats = summary(samples)
        stats["median_us"] = round(worst_rank(stats["median_us"], world), 3)
        figures[f"init_device_mesh{shape}"] = stats
        progress(f"init_device_mesh{shape}")
    if world.Get_rank() == 0:
        rows = [(name, f["median_us"], f["min_us"], f["max_us"], f["samples"])
                for name, f in figures.items()]
        emit({"ranks": n, "environment": environment(), "figures": figures}, args.out,
             table(("call", "median us", "min us", "max us", "samples"), rows,
                   title=f"mesh creation on {n} ranks (median: worst rank)"))


if __name__ == "__main__":
    main()
