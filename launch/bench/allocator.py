"""Benchmark of the caching CPU allocator and of the local tensor layer's overhead.

Two modes, one script (imports the installed dtensor, from any directory):

``python launch/bench/allocator.py [--repeat N] [--out FILE]``
    Single process. (1) allocate+free from the warm pool vs ``np.empty`` + first touch
    (one write per page), at 16 MiB (the target size) and 64 MiB; the pooled figures
    are given bare and with the same page touch. (1b) ``empty_array`` allocate+free
    against ``np.empty`` on N x N float32 for N = 8 to 4096 (target: at most 0.5 us up to
    1 MiB, as numpy's). (2) Local-layer overhead: ``a + b``,
    ``a.view(-1)`` and ``a.t()`` on 4x8 float32 ``dt.Tensor``s vs the numpy expressions.

``timeout 300 mpiexec -n 2 python launch/bench/allocator.py --mpi [--out FILE]``
    Collective. ``Allgather`` (buffer-based) of 8 MiB per rank (and 32 MiB per rank)
    into an output buffer taken from ``empty_array`` each iteration vs one freshly
    ``np.empty``'d each iteration. Each figure is the worst rank's median (MPI MAX over
    the per-rank medians); rank 0 prints the JSON.

Each mode prints the JSON document and then its figures as tables (``--out FILE`` writes
the JSON too).

Targets: warm-pool allocate+free of 16 MiB under 20 us; pooled Allgather at least 2x
faster than the fresh-buffer one at 16 MiB total. Both are reported with ``met`` flags.

Baselines: ``np_empty`` is a fresh buffer from ``np.empty`` each iteration;
``mmap`` is a buffer of never-touched pages (an anonymous mapping each iteration), i.e.
what a fresh buffer costs when the C allocator does not recycle one. glibc's malloc raises
its mmap threshold (up to 32 MiB) after the first large free and then keeps such buffers
in its heap, so a steady ``np.empty`` loop below ~32 MiB reuses already-touched pages and
behaves like the pool; beyond that every ``np.empty`` maps fresh pages (the 64 MiB and
32-MiB-per-rank figures).
"""

from __future__ import annotations

import os
import sys

# Run as a script, this file's folder is sys.path[0], where its modules would shadow the
# packages of the same name (launch/bench/redistribute.py): it goes; the installed packages
# are imported.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import mmap
import statistics
from typing import Any

import numpy as np

import dtensor as dt
from dtensor.local.allocator import empty_array
from launch.bench._common import (
    Progress,
    bench_args,
    each_call_us,
    emit,
    environment,
    per_call_us,
    ratio,
    summary,
    table,
    worst_rank,
)

MiB = 1 << 20
PAGE = mmap.PAGESIZE
WARM_POOL_TARGET_US = 20.0
ALLGATHER_TARGET_SPEEDUP = 2.0


def median(samples: list[float]) -> float:
    return round(statistics.median(samples), 3)


def fresh_pages(n: int) -> np.ndarray:
    """``n`` bytes of never-touched memory (a private anonymous mapping, unmapped when it
    dies): what ``np.empty`` returns when the C allocator maps fresh memory. Huge pages
    are advised where the OS has them, as numpy does for its large arrays.
    """
    buf = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(buf, np.uint8)


def bench_alloc(repeat: int) -> dict[str, Any]:
    """Warm-pool allocate+free vs ``np.empty`` + first touch, per size."""
    out: dict[str, Any] = {}
    for mib in (16, 64):
        n = mib * MiB

        def pooled(n: int = n) -> None:
            empty_array((n,), np.uint8)

        def pooled_touch(n: int = n) -> None:
            empty_array((n,), np.uint8)[::PAGE] = 1

        def fresh_touch(n: int = n) -> None:
            np.empty(n, np.uint8)[::PAGE] = 1

        def mmap_touch(n: int = n) -> None:
            fresh_pages(n)[::PAGE] = 1

        before = dt.memory_stats()
        pooled_us = per_call_us(pooled, repeat=repeat)
        pooled_touch_us = each_call_us(pooled_touch, repeat=repeat)
        after = dt.memory_stats()
        fresh_touch_us = each_call_us(fresh_touch, repeat=repeat)
        mmap_touch_us = each_call_us(mmap_touch, repeat=repeat)
        out[f"{mib}MiB"] = {
            "pooled_alloc_free": summary(pooled_us),
            "pooled_alloc_touch_free": summary(pooled_touch_us),
            "np_empty_touch_free": summary(fresh_touch_us),
            "mmap_touch_free": summary(mmap_touch_us),
            "speedup_vs_np_empty": ratio(median(fresh_touch_us), median(pooled_touch_us)),
            "speedup_vs_mmap": ratio(median(mmap_touch_us), median(pooled_touch_us)),
            "cache_misses_while_timed": after["cache_misses"] - before["cache_misses"],
        }
    warm = out["16MiB"]["pooled_alloc_free"]["median_us"]
    out["target_warm_pool_16MiB_us"] = {
        "limit": WARM_POOL_TARGET_US,
        "met": warm < WARM_POOL_TARGET_US,
    }
    return out


#: Square float32 arrays of these sides (256 B to 64 MiB) for :func:`bench_sizes`.
SIDES = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
#: Target of a pooled allocate+free up to 1 MiB (what ``numpy.empty`` costs, about).
SMALL_TARGET_US = 0.5


def bench_sizes(repeat: int) -> dict[str, Any]:
    """``empty_array`` allocate+free against ``np.empty`` on N x N float32, per size
    (medians of batched samples, the two interleaved)."""
    rows = {}
    for n in SIDES:
        shape = (n, n)
        ours = per_call_us(lambda shape=shape: empty_array(shape, np.float32), repeat=repeat)
        ref = per_call_us(lambda shape=shape: np.empty(shape, np.float32), repeat=repeat)
        rows[f"{n}x{n}"] = {
            "bytes": n * n * 4,
            "empty_array_us": median(ours),
            "np_empty_us": median(ref),
        }
    small = [r["empty_array_us"] for r in rows.values() if r["bytes"] <= MiB]
    rows["target_up_to_1MiB_us"] = {"limit": SMALL_TARGET_US, "met": max(small) <= SMALL_TARGET_US}
    return rows


def bench_local(repeat: int) -> dict[str, Any]:
    """Overhead of the local tensor layer on tiny tensors, against plain numpy."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    y = rng.standard_normal((4, 8)).astype(np.float32)
    a, b = dt.from_numpy(x), dt.from_numpy(y)
    if not np.array_equal((a + b).numpy(), x + y):
        raise RuntimeError("dt.Tensor addition disagrees with numpy")
    cases = {
        "add": (lambda: a + b, lambda: x + y),
        "view(-1) vs reshape(-1)": (lambda: a.view(-1), lambda: x.reshape(-1)),
        "t() vs .T": (lambda: a.t(), lambda: x.T),
    }
    out = {}
    for name, (ours, ref) in cases.items():
        ours_us = median(per_call_us(ours, repeat=repeat))
        numpy_us = median(per_call_us(ref, repeat=repeat))
        out[name] = {"dtensor_us": ours_us, "numpy_us": numpy_us, "ratio": ratio(ours_us, numpy_us)}
    return out


def bench_allgather(repeat: int) -> dict[str, Any]:
    """Allgather into pooled vs fresh output buffers; worst-rank medians. Collective."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    out: dict[str, Any] = {"ranks": size}
    for per_rank_mib in (8, 32):
        n = per_rank_mib * MiB
        send = np.full(n, rank % 251, np.uint8)

        def gather(recv: np.ndarray, send: np.ndarray = send, n: int = n) -> None:
            comm.Allgather(send, recv)
            firsts = recv[::n]
            if not np.array_equal(firsts, np.arange(size) % 251):
                raise RuntimeError(f"Allgather result is wrong on rank {rank}: {firsts}")

        variants = {
            "pooled": lambda n=n, gather=gather: gather(empty_array((size * n,), np.uint8)),
            "np_empty": lambda n=n, gather=gather: gather(np.empty(size * n, np.uint8)),
            "mmap": lambda n=n, gather=gather: gather(fresh_pages(size * n)),
        }
        samples: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(max(repeat // 5, 1)):  # interleaved, so machine drift hits all alike
            for name, fn in variants.items():
                samples[name] += each_call_us(fn, repeat=5, warmup=1, comm=comm)
        worst = {name: worst_rank(median(s), comm) for name, s in samples.items()}
        speedup = ratio(worst["np_empty"], worst["pooled"])
        entry = {
            "total_MiB": size * per_rank_mib,
            "pooled_us": worst["pooled"],
            "np_empty_us": worst["np_empty"],
            "mmap_us": worst["mmap"],
            "speedup_vs_np_empty": speedup,
            "speedup_vs_mmap": ratio(worst["mmap"], worst["pooled"]),
            "samples_per_rank": len(samples["pooled"]),
        }
        if per_rank_mib * size == 16:
            entry["target_speedup"] = {
                "limit": ALLGATHER_TARGET_SPEEDUP,
                "met": speedup >= ALLGATHER_TARGET_SPEEDUP,
            }
        out[f"{per_rank_mib}MiB_per_rank"] = entry
    return out


def report(result: dict[str, Any]) -> str:
    """The figures as tables, one per part that ran. **Local**."""
    parts = []
    if "alloc_free" in result:
        rows = [(size, r["pooled_alloc_free"]["median_us"],
                 r["pooled_alloc_touch_free"]["median_us"],
                 r["np_empty_touch_free"]["median_us"], r["mmap_touch_free"]["median_us"],
                 r["speedup_vs_np_empty"], r["speedup_vs_mmap"])
                for size, r in result["alloc_free"].items() if size.endswith("MiB")]
        target = result["alloc_free"]["target_warm_pool_16MiB_us"]
        parts.append(table(("size", "pooled us", "pooled+touch us", "np.empty+touch us",
                            "mmap+touch us", "x np.empty", "x mmap"), rows,
                           title="allocate + free (median us)",
                           notes=[(f"warm pool 16 MiB under {target['limit']} us: "
                                  f"{'met' if target['met'] else 'MISSED'}")]))
        sizes = result["alloc_free_by_size"]
        rows = [(k, r["bytes"], r["empty_array_us"], r["np_empty_us"])
                for k, r in sizes.items() if "bytes" in r]
        target = sizes["target_up_to_1MiB_us"]
        parts.append(table(("N x N float32", "bytes", "empty_array us", "np.empty us"), rows,
                           notes=[(f"up to 1 MiB within {target['limit']} us: "
                                  f"{'met' if target['met'] else 'MISSED'}")]))
        rows = [(k, r["dtensor_us"], r["numpy_us"], r["ratio"])
                for k, r in result["local_layer"].items()]
        parts.append(table(("local op", "dtensor us", "numpy us", "ratio"), rows))
    if "allgather" in result:
        rows = [(k, r["total_MiB"], r["pooled_us"], r["np_empty_us"], r["mmap_us"],
                 r["speedup_vs_np_empty"], r["speedup_vs_mmap"])
                for k, r in result["allgather"].items() if isinstance(r, dict)]
        parts.append(table(("per rank", "total MiB", "pooled us", "np.empty us", "mmap us",
                            "x np.empty", "x mmap"), rows,
                           title=f"Allgather over {result['allgather']['ranks']} ranks "
                                 "(worst rank's median)"))
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    args = bench_args(
        "caching allocator benchmark",
        argv,
        mpi={"action": "store_true", "help": "run the collective (Allgather) part"},
    )
    result: dict[str, Any] = {"benchmark": "allocator", "environment": environment()}
    if args.mpi:
        from mpi4py import MPI

        result["allgather"] = bench_allgather(args.repeat)
        if MPI.COMM_WORLD.Get_rank() != 0:
            return
    else:
        progress = Progress("allocator", 3, enabled=not args.quiet)
        result["alloc_free"] = bench_alloc(args.repeat)
        progress("allocate + free at 16 and 64 MiB")
        result["alloc_free_by_size"] = bench_sizes(args.repeat)
        progress("allocate + free by size")
        result["local_layer"] = bench_local(args.repeat)
        progress("local layer")
    result["memory_stats"] = dt.memory_stats()
    emit(result, args.out, report(result))


if __name__ == "__main__":
    main()
