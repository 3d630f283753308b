"""Redistribute bandwidth and latency against raw MPI collectives.

Run as ``mpiexec -n 2 python launch/bench/redistribute.py [--out FILE]`` (any world size
works; the targets are stated for 2 ranks). For float32 NxN tensors (N = 8 and 2048) on a
1-D mesh over all ranks it times, in microseconds per call:

- ``dtensor_us``: ``x.redistribute(mesh, dst)`` through the public API (from compiled code
  when the fast path serves the plan: every one-step plan below the shared-memory size);
- ``python_us``: DTensor's Python ``redistribute`` method on the same call (what the public
  API costs where the compiled path does not serve it);
- ``execute_us``: :func:`redistribute.execute.execute` on the same plan and local array
  (what redistribute costs below the DTensor layer);
- ``raw_us``: the matching mpi4py collective on preallocated numpy buffers of the same
  sizes (``Allgather``, ``Allreduce``, ``Alltoall``), in the same run.

Each figure is the median over repeats of batched loops (warm-up first; all variants of a
size interleaved batch by batch, so that they share the load of a busy machine, in an
order shuffled every repeat so that none always runs right after its twin; the
variants of one case make the same number of calls per batch, so that they are timed
with equally warm caches), per rank, then the worst rank (MAX over ranks). Timing
helpers are local to this file.

``--cold`` rewrites a buffer twice the size of the last-level cache (at least 64 MiB)
before every timed batch, so that each variant starts from cold caches (the state of a
redistribute between compute steps); by default each batch finds whatever the previous
one left, and ``--batch-ms 10`` times back-to-back calls on warm buffers.

``P(max)->R`` is timed against ``Allreduce`` with MPI's predefined MAX (which does not
propagate NaN; dtensor's max does). Targets: at 2048, S(0)->R, P->R and P(max)->R within
1.15x of raw and S(1)->R, S(0)->S(1) within
1.5x; at 8, within raw + 5 us; R->S(0) under 5 us. The JSON records whether the ranks move
tensors of ``shm_min_bytes`` and more through node-shared memory (``shared_memory``, off
with ``DTENSOR_SHM=0``; see :mod:`redistribute.shm`). The JSON document goes to stdout (then
a table) and, with ``--out FILE``, to a file.
"""

from __future__ import annotations

import os
import random
import sys

# Run as a script, this file's folder is sys.path[0], where this file's name would shadow
# the ``redistribute`` package.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import statistics
import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

import dtensor as dt
from dtensor.dispatch.compiled import PY_REDISTRIBUTE
from dtensor.distributed.dtensor import allocator_for
from dtensor.local.backend import array_module
from launch.bench._common import Progress, emit, parser, table
from redistribute import shm
from redistribute.execute import execute
from redistribute.plan import plan

WORLD = MPI.COMM_WORLD


def per_call_us(
    fns: dict[str, Callable[[], object]],
    repeat: int,
    batch_s: float,
    group: Callable[[str], str],
    evict: Callable[[], object] | None = None,
) -> dict:
    """This rank's median, per callable, over ``repeat`` batches (us per call).

    Each callable is warmed up (caches, plans, pooled buffers), then timed in batches of
    about ``batch_s`` seconds (the same number of calls on every rank). Callables that are
    compared with each other (the same ``group(name)``) get the same number of calls per
    batch, the one that fits the slowest of them into ``batch_s``: with large buffers the
    calls after the first in a batch find them warm in cache, so a faster twin given more
    calls per batch would be timed warmer. The callables are interleaved batch by batch, so
    that they share the load of a busy machine, in an order shuffled every repeat (the same
    on every rank), and every batch starts after a barrier, so that all ranks time the same
    calls. ``evict`` (untimed) runs before every batch: it leaves the caches cold.
    """
    numbers: dict[str, int] = {}
    for name, fn in fns.items():
        for _ in range(3):
            fn()
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        guess = int(batch_s / max((time.perf_counter() - t0) / 3, 1e-7))
        numbers[name] = WORLD.allreduce(max(1, min(guess, 5000)), op=MPI.MIN)
    fewest: dict[str, int] = {}
    for name, number in numbers.items():
        fewest[group(name)] = min(number, fewest.get(group(name), number))
    numbers = {name: fewest[group(name)] for name in numbers}
    samples: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(repeat):
        # a new order every repeat (the same on every rank): a callable that runs right
        # after another one on the same buffers finds them warm (measured up to 20% faster
        # at 16 MiB), so no callable may always follow its twin
        random.Random(r).shuffle(names)
        for name in names:
            fn = fns[name]
            number = numbers[name]
            if evict is not None:
                evict()
            WORLD.Barrier()
            t0 = time.perf_counter()
            for _ in range(number):
                fn()
            samples[name].append((time.perf_counter() - t0) / number * 1e6)
    return {name: statistics.median(values) for name, values in samples.items()}


def _cache_bytes() -> int:
    """The largest CPU cache of this machine in bytes (sysfs; 0 when unknown)."""
    largest = 0
    for index in range(8):
        try:
            with open(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size") as f:
                text = f.read().strip()
        except OSError:
            break
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text[:-1] if text[-1:] in "KMG" else text
        largest = max(largest, int(digits) * scale if digits.isdigit() else 0)
    return largest


def worst_rank(value: float) -> float:
    """The largest of every rank's ``value``."""
    return WORLD.allreduce(value, op=MPI.MAX)


def raw_collectives(n: int, mesh: dt.DeviceMesh) -> dict[str, Callable[[], object]]:
    """Collectives on preallocated buffers (of the mesh's device) of the sizes an NxN float32
    tensor moves (a shard of ceil(N/k) rows per rank). On the CPU, and on a GPU with a
    CUDA-aware MPI, these are the plain mpi4py calls; on the staged GPU path they go through
    the mesh communicator's staging, like dtensor's own collectives."""
    k, xp = WORLD.Get_size(), array_module(mesh.device_type)
    rows = -(-n // k)
    shard = xp.ones((rows, n), np.float32)
    gathered = xp.empty((rows * k, n), np.float32)
    full = xp.ones((n, n), np.float32)
    reduced = xp.empty((n, n), np.float32)
    a2a_in = xp.ones(rows * n, np.float32)
    a2a_out = xp.empty(rows * n, np.float32)
    comm = mesh.get_group(0)
    if getattr(comm, "path", None) == "staged":
        counts, a2a = [rows * n] * k, [rows * n // k] * k
        displs = [i * (rows * n // k) for i in range(k)]
        return {
            "Allgather": lambda: comm.allgatherv(shard, gathered, counts),
            "Allreduce": lambda: comm.allreduce(full, reduced),
            "Allreduce MAX": lambda: comm.allreduce(full, reduced, op="max"),
            "Alltoall": lambda: comm.alltoallv(a2a_in, a2a, displs, a2a_out, a2a, displs),
        }
    return {
        "Allgather": lambda: WORLD.Allgather(shard, gathered),
        "Allreduce": lambda: WORLD.Allreduce(full, reduced),
        "Allreduce MAX": lambda: WORLD.Allreduce(full, reduced, op=MPI.MAX),
        "Alltoall": lambda: WORLD.Alltoall(a2a_in, a2a_out),
    }


# name, source, target, raw baseline, ratio target at 2048 (None: absolute target only)
CASES = [
    ("S(0)->R", [dt.Shard(0)], [dt.Replicate()], "Allgather", 1.15),
    ("S(1)->R", [dt.Shard(1)], [dt.Replicate()], "Allgather", 1.5),
    ("S(0)->S(1)", [dt.Shard(0)], [dt.Shard(1)], "Alltoall", 1.5),
    ("P->R", [dt.Partial()], [dt.Replicate()], "Allreduce", 1.15),
    # NaN-propagating max (a user-defined MPI op; shared memory from 1 MiB) against MPI.MAX,
    # which drops a NaN held by some ranks
    ("P(max)->R", [dt.Partial("max")], [dt.Replicate()], "Allreduce MAX", 1.15),
    ("R->S(0)", [dt.Replicate()], [dt.Shard(0)], None, None),
]


def measure(
    mesh: dt.DeviceMesh, n: int, repeat: int, batch_s: float, cold: bool = False
) -> list[dict]:
    data = np.random.default_rng(n).standard_normal((n, n)).astype(np.float32)
    raws = raw_collectives(n, mesh)
    fns: dict[str, Callable[[], object]] = {}
    coord, comms = mesh.get_coordinate(), mesh.get_all_groups()
    alloc = allocator_for(mesh.device_type)
    for name, src, dst, raw, _ in CASES:
        x = dt.distribute_tensor(data, mesh, src)
        spec, local = x._spec, x.to_local()._arr
        steps = plan(spec, dst)
        fns[f"dtensor {name}"] = lambda x=x, dst=dst: x.redistribute(mesh, dst)
        fns[f"python {name}"] = lambda x=x, dst=dst: PY_REDISTRIBUTE(x, mesh, dst)
        fns[f"execute {name}"] = lambda a=(steps, local, spec, coord, comms): execute(*a, alloc)
        if raw is not None:  # timed once per case that compares with it
            fns[f"raw {name}"] = raws[raw]
    if mesh.device_type != "cpu":  # every call ends with the device idle
        sync = array_module(mesh.device_type).cuda.get_current_stream().synchronize
        fns = {name: (lambda f=f: (f(), sync())) for name, f in fns.items()}
    evict = None
    if cold:  # rewrite a buffer of twice the last-level cache (or 64 MiB) before each batch
        junk = np.zeros(max(_cache_bytes() * 2, 64 << 20) // 8)
        evict = lambda: np.add(junk, 1.0, out=junk)
    per_rank = per_call_us(fns, repeat, batch_s, lambda name: name.split(" ", 1)[1], evict)
    us = {name: worst_rank(t) for name, t in per_rank.items()}
    rows = []
    for name, _, _, raw, ratio_target in CASES:
        row = {
            "case": name,
            "shape": [n, n],
            "dtensor_us": us[f"dtensor {name}"],
            "python_us": us[f"python {name}"],
            "execute_us": us[f"execute {name}"],
            "raw": raw,
            "raw_us": us.get(f"raw {name}"),
        }
        if raw is None:
            row["target"] = "dtensor_us < 5"
            row["ok"] = row["dtensor_us"] < 5.0
        elif n <= 64:
            row["target"] = "dtensor_us < raw_us + 5"
            row["ok"] = row["dtensor_us"] < row["raw_us"] + 5.0
        else:
            row["ratio"] = row["dtensor_us"] / row["raw_us"]
            row["target"] = f"ratio <= {ratio_target}"
            row["ok"] = row["ratio"] <= ratio_target
        rows.append(row)
    return rows


def report(doc: dict) -> str:
    """The figures as a table. **Local**."""
    rows = [(r["case"], f"{r['shape'][0]}x{r['shape'][1]}", r["dtensor_us"], r["python_us"],
             r["execute_us"], r["raw"] or "-", r["raw_us"], r.get("ratio"), r["target"], r["ok"])
            for r in doc["results"]]
    return table(("case", "N x N", "dtensor us", "python us", "execute us", "raw", "raw us",
                  "ratio", "target", "ok"), rows,
                 title=f"redistribute on {doc['world_size']} ranks, {doc['device']}, "
                       f"{doc['statistic']}")


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--out", help="also write the JSON document to this file")
    p.add_argument("--repeat", type=int, default=41, help="batches per figure")
    p.add_argument("--sizes", type=int, nargs="+", default=[8, 2048], help="N of NxN")
    p.add_argument("--batch-ms", type=float, default=1.0, help="length of one batch")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="mesh device")
    p.add_argument("--cold", action="store_true",
                   help="evict the CPU caches before every timed batch")
    p.add_argument("--quiet", action="store_true", help="no progress lines (on stderr)")
    args = p.parse_args(argv)
    mesh = dt.init_device_mesh((WORLD.Get_size(),), device=args.device)
    progress = Progress("redistribute", len(args.sizes),
                        enabled=WORLD.Get_rank() == 0 and not args.quiet)
    results = []
    for n in args.sizes:
        results.extend(measure(mesh, n, args.repeat, args.batch_ms / 1e3, args.cold))
        progress(f"{n}x{n}")
    doc = {
        "benchmark": "redistribute",
        "world_size": WORLD.Get_size(),
        "device": args.device,
        "comm_path": getattr(mesh.get_group(0), "path", "host"),
        "dtype": "float32",
        "statistic": "median of batched per-call times per rank, then max over ranks",
        "batch_ms": args.batch_ms,
        "cold_caches": args.cold,
        # whether tensors from shm_min_bytes move through node-shared memory (redistribute.shm)
        "shared_memory": shm.enabled(),
        "shm_min_bytes": shm.MIN_BYTES,
        "results": results,
    }
    if WORLD.Get_rank() == 0:
        emit(doc, args.out, report(doc))
    return doc


if __name__ == "__main__":
    main()
