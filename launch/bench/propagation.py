"""Cost of the dispatcher's sharding propagation: cache misses and steady-state hits.

Run as ``mpiexec -n 2 python launch/bench/propagation.py`` (1-D mesh) and
``mpiexec -n 4 python launch/bench/propagation.py`` (1-D mesh and a 2x2 mesh), or with
``python -m launch.bench.propagation`` from the repository root. For a binary
pointwise op and for matmul on small (8x8) operands it reports, in microseconds per call:

- ``miss_us``: a call whose signature is not cached (the cache is cleared before every
  call), i.e. rule + strategy search + plans + the op itself (the planner's own caches of
  plans and costs are warm);
- ``cold_miss_us``: a miss on a never-seen input spec (each call a new shape), so the
  planner's caches are cold too;
- ``hit_us``: the same call in steady state (a cache hit, then the op);
- ``miss_overhead_us``: their difference, the price of one propagation.

Each figure is the median over repeats of batched loops on each rank, then the worst rank
(MAX over ranks). The JSON document goes to stdout (then a table) and, with ``--out FILE``,
to a file.
Target: a miss costs < 150 us on the 2x2 mesh.
"""

from __future__ import annotations

import os
import sys

# Run as a script, this file's folder is sys.path[0], where the sibling benchmark
# ``redistribute.py`` would shadow the ``redistribute`` package.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import gc
import statistics
import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

import dtensor as dt
from launch.bench._common import Progress, emit, parser, table

R, S = dt.Replicate(), dt.Shard
TARGET_MISS_US = 150.0


def per_call_us(fn: Callable[[], object], number: int, repeat: int) -> float:
    """Median over ``repeat`` batches of ``number`` calls, in microseconds per call."""
    fn()  # warm-up
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter() - t0) / number * 1e6)
    return statistics.median(samples)


def worst_rank(value: float) -> float:
    return MPI.COMM_WORLD.allreduce(value, op=MPI.MAX)


def cases(mesh: dt.DeviceMesh, rows: int = 8) -> dict[str, Callable[[], object]]:
    """Calls to time on ``mesh`` with ``rows`` x 8 operands: name -> zero-argument callable."""
    a = np.arange(rows * 8, dtype=np.float32).reshape(rows, 8)
    w = np.ones((8, 8), np.float32)

    def d(arr, *placements):
        return dt.distribute_tensor(arr, mesh, list(placements), src_data_rank=None)

    if mesh.ndim == 1:
        x = y = d(a, S(0))
        xm, wm = x, d(w, R)  # S(0) @ R -> S(0)
        xr, wr = d(a, S(1)), d(w, S(1))  # S(1) @ S(1): one operand must move
    else:
        x = y = d(a, S(0), S(1))
        xm, wm = d(a, S(0), R), d(w, R, S(1))  # [S(0), R] @ [R, S(1)] -> [S(0), S(1)]
        xr, wr = d(a, S(0), R), d(w, S(1), R)
    return {
        "add (same placements)": lambda: x + y,
        "matmul (no redistribution)": lambda: xm @ wm,
        "matmul (redistribution chosen by cost)": lambda: xr @ wr,
    }


def measure(mesh: dt.DeviceMesh, number: int, repeat: int) -> dict[str, dict[str, float]]:
    out = {}
    # cold misses: every call has a new input spec (a new row count), so the planner's
    # cached plans and costs do not help either
    fresh = [cases(mesh, rows) for rows in range(9, 10 + number * (repeat + 1))]
    gc.collect()
    gc.freeze()  # the prebuilt operands are not garbage: keep the collector off them
    for name, call in cases(mesh).items():
        calls = iter([c[name] for c in fresh])

        def miss(call=call):
            dt.debug.clear_prop_cache()
            return call()

        cold_us = worst_rank(per_call_us(lambda calls=calls: next(calls)(), number, repeat))
        miss_us = worst_rank(per_call_us(miss, number, repeat))
        dt.debug.clear_prop_cache()
        hit_us = worst_rank(per_call_us(call, number * 4, repeat))
        out[name] = {
            "cold_miss_us": round(cold_us, 2),
            "miss_us": round(miss_us, 2),
            "hit_us": round(hit_us, 2),
            "miss_overhead_us": round(miss_us - hit_us, 2),
        }
    gc.unfreeze()
    return out


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--number", type=int, default=200, help="calls per timed batch")
    p.add_argument("--repeat", type=int, default=7, help="timed batches per figure")
    p.add_argument("--out", help="also write the JSON document here")
    p.add_argument("--quiet", action="store_true", help="no progress lines (on stderr)")
    args = p.parse_args(argv)
    world = MPI.COMM_WORLD
    meshes = {f"1-D ({world.size},)": dt.init_device_mesh((world.size,))}
    if world.size == 4:
        meshes["2x2"] = dt.init_device_mesh((2, 2))
    progress = Progress("propagation", len(meshes), enabled=world.rank == 0 and not args.quiet)
    figures = {}
    for name, m in meshes.items():
        figures[name] = measure(m, args.number, args.repeat)
        progress(f"mesh {name}")
    result = {
        "benchmark": "propagation",
        "ranks": world.size,
        "unit": "microseconds per call, median of batches, worst rank",
        "target_miss_us_2x2": TARGET_MISS_US,
        "meshes": figures,
    }
    if world.rank == 0:
        rows = [(mesh, op, r["cold_miss_us"], r["miss_us"], r["hit_us"], r["miss_overhead_us"])
                for mesh, ops in figures.items() for op, r in ops.items()]
        emit(result, args.out, table(("mesh", "call", "cold miss us", "miss us", "hit us",
                                      "miss overhead us"), rows,
                                     title=f"sharding propagation, {world.size} ranks",
                                     notes=[(f"target: a miss under {TARGET_MISS_US:g} us on "
                                            "the 2x2 mesh")]))
    return result


if __name__ == "__main__":
    main()
