"""FSDP's training step beside dp's, in parts: wall, CPU, page faults, gather and wait times.

Run as ``python -m launch -n 2 -m launch.bench.fsdp_parts [--model small] [--repeat 8]
[--micro 20] [--strategies dp,fsdp-nopool,fsdp] [--out FILE]`` (from ``tests/``, so that
the compiled package runs).

* The parts: per strategy, the strategy sweep's step of the GPT family ``gpt-<model>``
  (:class:`launch.experiments._gpt_family.GPTFamily`: SGD and ``clip_grad_norm_``, its
  global batch). ``fsdp-nopool`` is FSDP built with ``DTENSOR_FSDP_POOL=0`` (every gathered
  buffer's pages given back, so each all-gather faults them in again). All the steps are
  built and warmed (two steps each) first, then timed in turns, one step of each per pass,
  the ranks meeting at a barrier before each. Per step: wall ms (and its forward, backward
  and optimizer parts), the process's CPU ms (all threads), the calling thread's CPU ms,
  the rest (``other``: the redistribute worker thread that runs FSDP's all-gathers, and
  MPI), minor page faults (``ru_minflt``, also those of the forward and the backward), and
  FSDP's own figures: the seconds inside the gather jobs, the caller's wait for them, the
  seconds of the gradient reductions. Medians over ``--repeat`` passes, every rank's row.
* The microbenchmark: ten matmuls of the model's MLP shape (this rank's tokens x d_model
  @ d_model x 4 d_model) alone, and while the redistribute worker runs all-gathers of one
  transformer block's parameters in a loop (on the world communicator's twin, as FSDP's
  prefetch does), enough of them to outlast the matmuls. CPU and wall ms of the ten
  matmuls, medians over ``--micro`` samples, every rank's row; the wall ratio beside /
  alone is what the calibration's ``overlap_slowdown`` measures.

Output: JSON on stdout (``--out FILE`` too), then the figures as tables; progress lines
on stderr.
"""

from __future__ import annotations

import os
import resource
import statistics
import sys
import time

# Run as a script, this file's folder is sys.path[0], where the sibling benchmark
# ``redistribute.py`` would shadow the ``redistribute`` package.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import numpy as np
from mpi4py import MPI

import dtensor as dt
from launch.bench._common import Progress, bench_args, emit, environment, table, worst_rank
from launch.experiments._gpt_family import BATCH, GPTFamily
from redistribute import worker

COMM = MPI.COMM_WORLD
NOPOOL = "-nopool"
#: The per-step figures, in table order.
KEYS = ("wall", "fwd", "bwd", "opt", "cpu", "main", "other", "faults", "faults_fwd",
        "faults_bwd", "gather", "wait", "reduce")


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _fsdp_stats(step):
    """FSDP's gather / wait / reduce counters of a step's model (None: not FSDP)."""
    state = getattr(step.strategy_run.model, "_fsdp_state", None)
    return None if state is None or state.ctx is None else state.ctx.stats


def _build(family: GPTFamily, names: list[str]) -> dict:
    """Every strategy's step, built in order (``-nopool``: with ``DTENSOR_FSDP_POOL=0``,
    read when FSDP's groups are made). **Collective**."""
    world = COMM.size
    allowed = family.strategies(world)
    steps = {}
    before = os.environ.get("DTENSOR_FSDP_POOL")
    try:
        for name in names:
            base = name.removesuffix(NOPOOL)
            if base not in allowed or (name.endswith(NOPOOL) and base != "fsdp"):
                raise SystemExit(
                    f"fsdp_parts: --strategies {name!r} does not run for {family.name} at "
                    f"{world} ranks; choose among {', '.join(allowed)} and fsdp{NOPOOL}")
            os.environ["DTENSOR_FSDP_POOL"] = "0" if name.endswith(NOPOOL) else "1"
            steps[name] = family.build(base, optimizer="sgd", clip=1.0)
    finally:
        if before is None:
            os.environ.pop("DTENSOR_FSDP_POOL", None)
        else:
            os.environ["DTENSOR_FSDP_POOL"] = before
    return steps


def _one_step(step) -> dict[str, float]:
    """One timed step of ``step``, in parts (see the module docstring). **Collective**."""
    stats = _fsdp_stats(step)
    if stats is not None:
        stats.reset()
    COMM.Barrier()
    f0 = _faults()
    c0, m0, w0 = time.process_time(), time.thread_time(), time.perf_counter()
    step.forward()
    w1, fa = time.perf_counter(), _faults()
    step.backward()
    w2, fb = time.perf_counter(), _faults()
    step.optimizer()
    w3 = time.perf_counter()
    c1, m1 = time.process_time(), time.thread_time()
    f1 = _faults()
    out = {"wall": (w3 - w0) * 1e3, "fwd": (w1 - w0) * 1e3, "bwd": (w2 - w1) * 1e3,
           "opt": (w3 - w2) * 1e3, "cpu": (c1 - c0) * 1e3, "main": (m1 - m0) * 1e3,
           "other": (c1 - c0 - (m1 - m0)) * 1e3, "faults": f1 - f0, "faults_fwd": fa - f0,
           "faults_bwd": fb - fa}
    if stats is not None:
        out.update(gather=stats.gather_s * 1e3, wait=stats.wait_s * 1e3,
                   reduce=stats.reduce_s * 1e3)
    return out


def parts(steps: dict, repeat: int, progress: Progress) -> dict[str, list[dict]]:
    """Every rank's medians per strategy: ``{strategy: [rank 0's, rank 1's, ...]}`` on
    rank 0 (None on the others). **Collective**."""
    for name, step in steps.items():
        step.run()
        step.run()
    progress(f"{len(steps)} strategies built and warmed")
    samples: dict[str, dict[str, list[float]]] = {n: {k: [] for k in KEYS} for n in steps}
    for i in range(repeat):
        for name, step in steps.items():
            for k, v in _one_step(step).items():
                samples[name][k].append(v)
        progress(f"pass {i + 1}/{repeat}: " + ", ".join(
            f"{n} {samples[n]['wall'][-1]:.0f} ms" for n in steps))
    medians = {n: {k: (round(statistics.median(v), 2) if v else None) for k, v in s.items()}
               for n, s in samples.items()}
    every = COMM.gather(medians, root=0)
    if COMM.rank:
        return None
    return {n: [rank[n] for rank in every] for n in steps}


def micro(family: GPTFamily, samples: int, progress: Progress) -> dict:
    """Ten MLP-shaped matmuls alone and beside the worker's all-gathers of one block's
    parameters (see the module docstring). **Collective**."""
    cfg, world = family.cfg, COMM.size
    rows = max(1, BATCH[family.size] * cfg.block_size // world)
    d, hidden = cfg.d_model, 4 * cfg.d_model
    rng = np.random.default_rng(0)
    a = dt.from_numpy(rng.standard_normal((rows, d)).astype(np.float32))
    b = dt.from_numpy(rng.standard_normal((d, hidden)).astype(np.float32))
    flops = 2 * rows * d * hidden
    block = sum(int(np.prod(s)) for n, s in family.shapes.items() if n.startswith("blocks.0."))
    elems = -(-block // world)
    send = np.ones(elems, np.float32)
    recv = np.empty(elems * world, np.float32)
    group = dt.init_device_mesh((world,)).get_group(0).twin()

    def gathers(k: int) -> None:
        for _ in range(k):
            group.allgatherv(send, recv, [elems] * world, what="bench")

    def matmuls(k: int = 10) -> tuple[float, float]:
        c0, w0 = time.thread_time(), time.perf_counter()
        for _ in range(k):
            a @ b
        return time.thread_time() - c0, time.perf_counter() - w0

    alone_gather = []
    for _ in range(5):
        COMM.Barrier()
        t0 = time.perf_counter()
        gathers(1)
        alone_gather.append(time.perf_counter() - t0)
    gather_s = statistics.median(alone_gather)
    matmul_s = statistics.median(matmuls()[1] for _ in range(3))
    # enough gathers to outlast the matmuls, the same count on every rank
    count = int(worst_rank(int(2 * matmul_s / max(gather_s, 1e-6)) + 2, COMM))
    times: dict[str, list[tuple[float, float]]] = {"alone": [], "beside": []}
    early = 0
    for _ in range(samples):
        COMM.Barrier()
        times["alone"].append(matmuls())
        COMM.Barrier()
        handle = worker.submit(lambda: gathers(count))
        times["beside"].append(matmuls())
        early += handle.done()
        handle.wait()
    progress(f"microbenchmark: {samples} samples, {count} gathers each")
    mine = {}
    for k, v in times.items():
        cpu = statistics.median(c for c, _ in v)
        wall = statistics.median(w for _, w in v)
        mine[k] = {"cpu_ms": round(cpu * 1e3, 2), "wall_ms": round(wall * 1e3, 2),
                   "gflops_per_cpu_s": round(10 * flops / cpu / 1e9, 2) if cpu else None,
                   "gflops_per_wall_s": round(10 * flops / wall / 1e9, 2)}
    mine["wall_beside_over_alone"] = round(mine["beside"]["wall_ms"] / mine["alone"]["wall_ms"],
                                           3)
    every = COMM.gather(mine, root=0)
    return {"matmul": [rows, d, hidden], "gather_mib": round(elems * world * 4 / 2**20, 2),
            "gather_alone_ms": round(worst_rank(gather_s, COMM) * 1e3, 2),
            "gathers_per_sample": count,
            "samples_gathers_ended_first": int(worst_rank(early, COMM)),
            "ranks": every}


def report(result: dict) -> str:
    """The figures as tables. **Local**."""
    m = result["model"]
    heads = ("strategy", "rank", "wall ms", "fwd ms", "bwd ms", "opt ms", "cpu ms", "main ms",
             "other ms", "faults", "faults fwd", "faults bwd", "gather ms", "wait ms",
             "reduce ms")
    rows = [(name, r, *(row[k] for k in KEYS))
            for name, ranks in result["parts"].items() for r, row in enumerate(ranks)]
    out = table(heads, rows,
                title=(f"gpt-{m['size']} (batch {m['batch']} x {m['seq']}, SGD + clipping), "
                       f"{result['ranks']} ranks: medians of {result['repeat']} steps per "
                       "strategy, every rank"),
                notes=[("cpu: the whole process; main: the caller's thread; other: the rest "
                       "(the worker thread, MPI); faults: ru_minflt")])
    mi = result["micro"]
    rows = [(r, k, v[k]["cpu_ms"], v[k]["wall_ms"], v[k]["gflops_per_cpu_s"],
             v[k]["gflops_per_wall_s"], v["wall_beside_over_alone"] if k == "beside" else None)
            for r, v in enumerate(mi["ranks"]) for k in ("alone", "beside")]
    rows_, hidden_ = mi["matmul"][0], mi["matmul"][2]
    notes = [(f"all-gather of {mi['gather_mib']} MiB alone: {mi['gather_alone_ms']} ms; "
             f"{mi['gathers_per_sample']} per sample; samples where they ended before the "
             f"matmuls: {mi['samples_gathers_ended_first']}")]
    return out + "\n\n" + table(
        ("rank", "matmuls", "cpu ms", "wall ms", "GFLOP/s cpu", "GFLOP/s wall", "wall ratio"),
        rows, notes=notes,
        title=(f"10 matmuls {rows_}x{mi['matmul'][1]} @ {mi['matmul'][1]}x{hidden_}, alone "
               f"and beside the worker's all-gathers (medians of {result['micro_samples']})"))


def main(argv=None) -> None:
    args = bench_args(
        __doc__.splitlines()[0],
        argv,
        repeat=8,
        model={"default": "small", "choices": ("tiny", "small"),
               "help": "the GPT family's size (gpt-tiny, gpt-small)"},
        micro={"type": int, "default": 20, "help": "samples of the microbenchmark"},
        strategies={"default": f"dp,fsdp{NOPOOL},fsdp",
                    "help": f"comma-separated; fsdp{NOPOOL}: FSDP with DTENSOR_FSDP_POOL=0"},
    )
    if args.repeat < 1 or args.micro < 1:
        raise SystemExit(f"fsdp_parts: --repeat {args.repeat} and --micro {args.micro} must "
                         "be at least 1")
    names = [n for n in args.strategies.split(",") if n]
    family = GPTFamily(args.model)
    progress = Progress("fsdp_parts", args.repeat + 2, enabled=COMM.rank == 0 and not args.quiet)
    steps = _build(family, names)
    got = parts(steps, args.repeat, progress)
    del steps
    mi = micro(family, args.micro, progress)
    if COMM.rank:
        return
    cfg = family.cfg
    result = {
        "benchmark": "fsdp_parts",
        "ranks": COMM.size,
        "model": {"size": args.model, "d_model": cfg.d_model, "layers": cfg.n_layer,
                  "seq": cfg.block_size, "batch": family.batch, "params": cfg.n_params()},
        "repeat": args.repeat,
        "micro_samples": args.micro,
        "parts": got,
        "micro": mi,
        "environment": environment(),
    }
    emit(result, args.out, report(result))


if __name__ == "__main__":
    main()
