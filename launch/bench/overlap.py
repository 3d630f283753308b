"""Asynchronous redistribute against blocking, and persistent all-gathers.

Run as ``python -m launch -n 2 -m launch.bench.overlap [--out FILE]`` (the figures are
stated for 2 ranks on one node). It reports, in microseconds (the worst rank's median):

- ``persistent``: an 8x8 float32 ``S(0) -> R`` through ``x.redistribute`` with persistent
  all-gathers on and off (``redistribute.comm.set_persistent``, switched on every rank
  together before each batch), against the raw blocking ``Allgather`` of the same bytes
  (same send and receive sizes) and a raw persistent ``Allgather_init`` request (Start +
  Wait), variants interleaved batch by batch (order rotated each repeat); besides the
  medians, ``paired_*`` are medians of per-repeat differences (``paired_over_raw_us``:
  persistent minus raw ``Allgather``, the issue's margin; ``paired_gain_us``: blocking
  minus persistent), which cancel the load that both batches of a repeat met;
- ``overlap``: a loop of ``h = a @ b`` (local matmul) -> ``x.redistribute(S(0) -> R)``
  -> ``h @ b`` with the redistribute blocking, or started asynchronously before the first
  matmul and waited for before the second (the matmul does not depend on it), per
  iteration, for a small (latency-bound: one ``Iallgather``) and a large (bandwidth-bound:
  shared-memory exchange on the worker thread) ``x``; ``medium`` has the same loop for a
  ``--medium`` ``x`` (one ``Ialltoallw``: above the all-gather limit, below the
  shared-memory one). Each case names the path its asynchronous redistribute takes;
- ``slow_peer`` (small ``x``; ``medium`` has it for its size): the same loop where, each
  iteration, one rank (in turn) arrives late (sleeps ``--delay-ms`` first): blocking makes
  every rank wait for the late one, the asynchronous loop computes meanwhile;
  ``slow_peer_off_cpu`` replaces each matmul by a sleep as long as it (work that leaves
  the core free: a device kernel, I/O), which isolates the protocol from the two ranks'
  competition for two cores;
- ``progress`` (large size; ``progress_medium`` for the medium one): how a nonblocking MPI
  all-gather (raw ``Iallgather``) progresses under MPICH while the caller computes: waited
  only at the end, polled with ``Test`` between chunks of the computation; and the
  asynchronous redistribute of the same tensor, waited at the end (``dtensor_async``) or
  with :func:`redistribute.worker.poll` between the chunks (``dtensor_polled``), whose path
  is named (``worker_thread`` keeps the name of the first). Run it again with
  ``MPIR_CVAR_ASYNC_PROGRESS=1`` to time MPICH's progress thread (the JSON records it).

The JSON document goes to stdout (then the figures as tables) and, with ``--out FILE``, to a
file.
"""

from __future__ import annotations

import os
import sys

# Run as a script, this file's folder is sys.path[0], which holds modules named like
# packages of dtensor's (``redistribute``).
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import statistics
import time

import numpy as np
from mpi4py import MPI

import dtensor as dt
from launch.bench._common import Progress, bench_args, emit, environment, table, worst_rank
from redistribute import comm as rcomm
from redistribute import execute as rexec
from redistribute import worker
from redistribute.plan import plan

WORLD = MPI.COMM_WORLD
S0, R = [dt.Shard(0)], [dt.Replicate()]


def _interleaved(
    variants: dict,
    repeat: int,
    number: int,
    before: dict | None = None,
    pairs: dict | None = None,
) -> dict[str, float]:
    """Median microseconds per call of each variant, batches of ``number`` calls
    interleaved (the order rotated every repeat, so that no variant always follows the
    same one), ranks meeting at a barrier before each batch; the worst rank's.
    ``before[name]()``, when given, runs (untimed, on every rank) before each batch.
    ``pairs`` maps a name to two variants ``(a, b)``: its figure is the median over the
    repeats of ``a``'s batch minus ``b``'s of the same repeat (paired: both met the same
    load), the worst rank's."""
    samples: dict[str, list[float]] = {k: [] for k in variants}
    before = before or {}
    names = list(variants)
    for name, fn in variants.items():  # warm-up
        before.get(name, _nothing)()
        for _ in range(number):
            fn()
    for i in range(repeat):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            fn = variants[name]
            before.get(name, _nothing)()
            WORLD.Barrier()
            start = time.perf_counter_ns()
            for _ in range(number):
                fn()
            samples[name].append((time.perf_counter_ns() - start) / number / 1e3)
    figures = {k: statistics.median(v) for k, v in samples.items()}
    for name, (a, b) in (pairs or {}).items():
        figures[name] = statistics.median([x - y for x, y in zip(samples[a], samples[b])])
    return {k: round(worst_rank(v, WORLD), 3) for k, v in figures.items()}


def _nothing() -> None:
    pass


def persistent_case(repeat: int, number: int) -> dict:
    mesh = dt.init_device_mesh((WORLD.size,))
    x = dt.distribute_tensor(np.ones((8, 8), np.float32), mesh, S0)
    nbytes = x.to_local().numpy().nbytes
    send, recv = np.ones(nbytes, np.uint8), np.empty(nbytes * WORLD.size, np.uint8)
    raw_req = WORLD.Allgather_init([send, MPI.BYTE], [recv, MPI.BYTE])

    def on() -> None:
        x.redistribute(mesh, R)

    def raw() -> None:
        WORLD.Allgather([send, MPI.BYTE], [recv, MPI.BYTE])

    def raw_persistent() -> None:
        raw_req.Start()
        raw_req.Wait()

    prev = rcomm.set_persistent(True)
    try:
        persistent = rcomm.persistent_enabled()
        variants = {"persistent": on, "blocking": on, "raw": raw, "raw_persistent": raw_persistent}
        switch = {"persistent": lambda: rcomm.set_persistent(True),
                  "blocking": lambda: rcomm.set_persistent(False)}  # fmt: skip
        pairs = {"over_raw": ("persistent", "raw"), "gain": ("blocking", "persistent"),
                 "blocking_over_raw": ("blocking", "raw")}  # fmt: skip
        figures = _interleaved(variants, repeat, number, switch, pairs)
    finally:
        rcomm.set_persistent(prev)
        raw_req.Free()
    return {
        "case": "8x8 float32 S(0)->R",
        "persistent_available": persistent,
        "dtensor_persistent_us": figures["persistent"],
        "dtensor_blocking_us": figures["blocking"],
        "raw_allgather_us": figures["raw"],
        "raw_persistent_us": figures["raw_persistent"],
        "gain_us": round(figures["blocking"] - figures["persistent"], 3),
        "over_raw_us": round(figures["persistent"] - figures["raw"], 3),
        "paired_over_raw_us": figures["over_raw"],
        "paired_gain_us": figures["gain"],
        "paired_blocking_over_raw_us": figures["blocking_over_raw"],
    }


def _path(x, mesh) -> str:
    """The path of ``x.redistribute(mesh, R, async_op=True)``: its executor's handle."""
    spec, local = x._spec, x.to_local().numpy()
    steps = plan(spec, tuple(R))
    handle = rexec.execute_async(steps, local, spec, mesh._coord, mesh._dim_comms)
    handle.wait()
    return "nonblocking" if type(handle) is worker.Started else "worker thread"


def _loop(x, mesh, work, asynchronous: bool, iters: int, delay_s: float) -> float:
    """Seconds per iteration of work -> redistribute -> work (worst rank)."""
    WORLD.Barrier()
    start = time.perf_counter()
    for i in range(iters):
        if delay_s and i % WORLD.size == WORLD.rank:
            time.sleep(delay_s)  # this rank is late this iteration
        if asynchronous:
            y = x.redistribute(mesh, R, async_op=True)
            work()
            y.wait()
        else:
            work()
            y = x.redistribute(mesh, R)
        work()
        del y
    per = (time.perf_counter() - start) / iters
    return worst_rank(per, WORLD)


def overlap_case(
    n: int, rows: int, iters: int, repeat: int, delay_ms: float, off_cpu: bool = False
) -> dict:
    """The loop with ``n x n`` matmuls as the work; ``off_cpu``: a sleep as long as the
    matmul instead, standing for work that leaves this core free (a device kernel, I/O)."""
    mesh = dt.init_device_mesh((WORLD.size,))
    rng = np.random.default_rng(0)
    a, b = rng.random((n, n), np.float32), rng.random((n, n), np.float32)
    x = dt.distribute_tensor(np.ones((rows, rows), np.float32), mesh, S0)
    t0 = time.perf_counter()
    for _ in range(3):
        (a @ b) @ b
    matmul_us = (time.perf_counter() - t0) / 3 * 1e6

    def work() -> None:
        if off_cpu:
            time.sleep(matmul_us / 2e6)
        else:
            a @ b

    timed = {"blocking": [], "async": []}
    for _ in range(repeat):
        for mode, samples in timed.items():
            samples.append(_loop(x, mesh, work, mode == "async", iters, delay_ms / 1e3))
    block, asyn = (statistics.median(timed[m]) * 1e6 for m in ("blocking", "async"))
    return {
        "work": "sleep as long as the matmul" if off_cpu else "matmul",
        "matmul": f"2 x ({n}x{n}) @ ({n}x{n}) float32",
        "redistribute": f"({rows}x{rows}) float32 S(0)->R",
        "async_path": _path(x, mesh),
        "late_rank_delay_ms": delay_ms,
        "matmuls_us": round(worst_rank(matmul_us, WORLD), 1),
        "blocking_us_per_iter": round(block, 1),
        "async_us_per_iter": round(asyn, 1),
        "saved": round(1 - asyn / block, 3) if block else 0.0,
    }


def progress_case(rows: int, n: int, repeat: int) -> dict:
    """A raw Iallgather of rows x rows float32 while computing ``n x n`` matmuls in 8
    chunks: waited at the end only, polled between chunks; and the asynchronous
    redistribute of the same tensor, waited at the end or polled between chunks."""
    mesh = dt.init_device_mesh((WORLD.size,))
    rng = np.random.default_rng(1)
    a, b = rng.random((n, n), np.float32), rng.random((n, n), np.float32)
    mine = rows * rows * 4 // WORLD.size
    send, recv = np.ones(mine, np.uint8), np.empty(mine * WORLD.size, np.uint8)
    x = dt.distribute_tensor(np.ones((rows, rows), np.float32), mesh, S0)

    def compute(poll=None) -> None:
        for _ in range(8):
            a @ b
            if poll is not None:
                poll()

    def wait_at_end() -> None:
        req = WORLD.Iallgather([send, MPI.BYTE], [recv, MPI.BYTE])
        compute()
        req.Wait()

    def polled() -> None:
        req = WORLD.Iallgather([send, MPI.BYTE], [recv, MPI.BYTE])
        compute(req.Test)
        req.Wait()

    def dtensor_async() -> None:
        y = x.redistribute(mesh, R, async_op=True)
        compute()
        y.wait()

    def dtensor_polled() -> None:
        y = x.redistribute(mesh, R, async_op=True)
        compute(worker.poll)
        y.wait()

    def blocking() -> None:
        WORLD.Allgather([send, MPI.BYTE], [recv, MPI.BYTE])
        compute()

    def compute_only() -> None:
        compute()

    variants = {"compute_only": compute_only, "blocking": blocking, "wait_at_end": wait_at_end,
                "polled": polled, "dtensor_async": dtensor_async,
                "dtensor_polled": dtensor_polled}  # fmt: skip
    figures = _interleaved(variants, repeat, 1)
    figures["worker_thread"] = figures["dtensor_async"]
    return {
        "gather": f"({rows}x{rows}) float32 over {WORLD.size} ranks",
        "compute": f"8 x ({n}x{n}) @ ({n}x{n}) float32",
        "async_path": _path(x, mesh),
        "async_progress_thread": os.environ.get("MPIR_CVAR_ASYNC_PROGRESS", "0"),
        **{f"{k}_us": v for k, v in figures.items()},
    }


def main(argv: list[str] | None = None) -> dict:
    args = bench_args(
        __doc__.splitlines()[0],
        argv,
        number={"type": int, "default": 2000, "help": "calls per batch (persistent case)"},
        iters={"type": int, "default": 20, "help": "loop iterations per overlap sample"},
        matmul={"type": int, "default": 256, "help": "matmul size n (n x n)"},
        small={"type": int, "default": 8, "help": "rows of the latency-bound redistribute"},
        medium={"type": int, "default": 256, "help": "rows of the Ialltoallw-sized one"},
        large={"type": int, "default": 2048, "help": "rows of the bandwidth-bound one"},
        delay_ms={"type": float, "default": 2.0, "help": "lateness of the slow peer"},
    )
    repeat = args.repeat
    progress = Progress("overlap", 9, enabled=WORLD.rank == 0 and not args.quiet)

    def done(name: str, value: dict) -> dict:
        progress(name)
        return value

    doc = {
        "benchmark": "overlap",
        "ranks": WORLD.size,
        "env": environment(),
        "persistent": done("persistent", persistent_case(repeat, args.number)),
        "overlap": [
            done(f"overlap {rows} rows", overlap_case(args.matmul, rows, args.iters, repeat, 0.0))
            for rows in (args.small, args.large)
        ],
        "slow_peer": done("slow peer", overlap_case(args.matmul, args.small, args.iters, repeat,
                                                    args.delay_ms)),
        "slow_peer_off_cpu": done("slow peer off cpu", overlap_case(
            args.matmul, args.small, args.iters, repeat, args.delay_ms, off_cpu=True
        )),
        "medium": {
            "overlap": done("medium overlap", overlap_case(args.matmul, args.medium, args.iters,
                                                           repeat, 0.0)),
            "slow_peer": done("medium slow peer", overlap_case(
                args.matmul, args.medium, args.iters, repeat, args.delay_ms)),
        },
        "progress": done("progress", progress_case(args.large, args.matmul, repeat)),
        "progress_medium": done("progress medium",
                                progress_case(args.medium, args.matmul, repeat)),
    }
    if WORLD.rank == 0:
        emit(doc, args.out, report(doc))
    return doc


def report(doc: dict) -> str:
    """The figures as tables. **Local**."""
    p = doc["persistent"]
    out = table(("8x8 S(0)->R", "us"), [
        (k.removesuffix("_us"), p[k]) for k in (
            "dtensor_persistent_us", "dtensor_blocking_us", "raw_allgather_us",
            "raw_persistent_us", "paired_over_raw_us", "paired_gain_us")],
        title=f"persistent all-gathers, {doc['ranks']} ranks (worst rank's median)")
    cases = [("overlap", c) for c in doc["overlap"]] + [
        ("slow peer", doc["slow_peer"]), ("slow peer off cpu", doc["slow_peer_off_cpu"]),
        ("medium overlap", doc["medium"]["overlap"]),
        ("medium slow peer", doc["medium"]["slow_peer"])]
    rows = [(name, c["redistribute"], c["async_path"], c["blocking_us_per_iter"],
             c["async_us_per_iter"], c["saved"]) for name, c in cases]
    out += "\n\n" + table(("case", "redistribute", "async path", "blocking us/iter",
                            "async us/iter", "saved"), rows,
                           title="matmul -> redistribute -> matmul loop")
    keys = ("compute_only", "blocking", "wait_at_end", "polled", "dtensor_async",
            "dtensor_polled")
    rows = [(name, c["gather"], *(c[f"{k}_us"] for k in keys))
            for name, c in (("large", doc["progress"]), ("medium", doc["progress_medium"]))]
    return out + "\n\n" + table(("progress", "gather", *(f"{k} us" for k in keys)), rows)


if __name__ == "__main__":
    main()
