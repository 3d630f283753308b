"""The GPT of ``launch/examples/gpt.py`` trained by dtensor and by PyTorch side by side: the
same model, the same initial weights, the same batches, each parallel layout against its
torch counterpart.

Run as ``python -m launch -n 2 launch/bench/gpt_vs_torch.py --model small --steps 12
--warmup 3 --strategy local,dp,fsdp,tp [--out FILE] [--profile]`` (``--repeat R`` instead
of ``--steps``: R timed steps after the warm-up, 9 by default).

Modes (``--strategy``, comma-separated), dtensor's layout (``gpt_strategies.build``) against
torch's (``launch/bench/_torch_gpt.py``), all on MPI ranks; torch on gloo:

* ``local``: the whole model on every rank, eager, no communication, against a plain
  ``nn.Module`` (every rank runs both; tokens/s is one rank's);
* ``dp``: dtensor data parallelism (``Replicate()`` parameters, the batch ``Shard(0)``)
  against ``DistributedDataParallel``; ``replicate``: ``dt.replicate`` (dtensor's DDP:
  bucketed asynchronous all-reduce) against the same;
* ``fsdp``: ``dt.fully_shard`` on every block, then the root, against FSDP2
  (``torch.distributed.fsdp.fully_shard``, the same wrapping);
* ``tp``: ``dt.parallelize_module`` with the Megatron plan (``wq``/``wk``/``wv``/``fc``
  colwise, ``wo``/``proj`` rowwise) against ``torch.distributed.tensor.parallel.
  parallelize_module`` with the same plan.

The torch model is a module-for-module twin of ``gpt.GPT`` (the same parameter names and
shapes); dtensor's initial weights (full tensors, gathered where sharded) are copied into it
through numpy before torch lays it out. Both train with AdamW (lr ``--lr``, betas (0.9,
0.999), eps 1e-8, weight decay 0.1, each library's default implementation) on the same
global batches of byte-level docstring text (``launch/examples/text_data.py``); every
data-parallel rank takes its own rows, tensor parallelism feeds the whole batch. A step is
forward, backward, ``optimizer.step()``, ``zero_grad()``.

Timing: the two libraries' steps take turns in one job (dtensor's step then torch's on
even steps, torch's then dtensor's on odd ones; the ranks meet at a barrier before each).
The first ``--warmup`` steps of each are left out; the figure is the median over the
remaining steps of the slowest rank's step time. Tokens/s is the global batch's tokens
(``--batch`` x sequence) over that time (``local``: every rank runs the whole batch, so it
is one rank's); ``ratio`` is dtensor's tokens/s over torch's (target: at least 1).
Forward, backward and optimizer medians are reported apart, with the process's CPU time per
step (every thread; a figure that other programs' load on the machine does not inflate, but
MPI's busy-waiting inside dtensor's collectives does, where gloo's waits sleep) and its
minor page faults per step. Fairness: torch runs ``torch.set_num_threads(T)`` (and one
inter-op thread) with ``T`` dtensor's BLAS threads per rank (``OPENBLAS_NUM_THREADS``, which
the launcher sets to 1: two ranks on two cores get one core each), unless
``--torch-threads`` says otherwise.

Memory: both libraries live in one process, so the process's peak RSS would charge each
with the other's memory. Memory is measured in its own phase instead, after the timing
(so the one-time costs of loading code and initializing each library, paid during the
timing steps, are charged to neither): for each side in turn, everything of the timing
phase freed (``gc``, ``dt.empty_cache()``, ``malloc_trim``), the resident set read
(``VmRSS``) and the peak reset (``/proc/self/clear_refs``), then the side builds its model
and optimizer and runs 2 steps (the second reaches the steady peak: optimizer state
allocated, one step's activations live); its figure is the peak (``VmHWM``) minus the
resident set before. Worst rank. Where the peak cannot be reset, the growth of
``ru_maxrss`` is used instead (a lower bound; the JSON names the method). For dtensor the
JSON adds its allocator's peak of live tensor bytes and the bytes its pool holds at the end
(live or cached for reuse), and the growth of the node-shared memory resident in the
process (``RssShmem``): dtensor's buffers are node-shared segments, and a rank that copies
out of a peer's segment maps all of it, so ``shmem`` beyond ``reserved`` is peers' memory
that this rank's RSS counts too (the peer's RSS counts it as well).

Losses: the first step's losses (the global batch's mean) of the two sides and their
relative difference (float32 rounding only: the same weights and data), and the largest
relative difference over all steps.

``--profile``: after the timing, rank 0 profiles ``--profile-steps`` dtensor steps of each
mode with cProfile and prints the functions with the most own time (the other ranks run
the same steps unprofiled).

Output: JSON, then markdown tables (``--out`` writes the JSON too); a progress line per
step and per mode on stderr (``--quiet`` silences them). ``--no-torch`` runs dtensor's
side alone; without torch installed the script says so and does the same (exit status 0).
"""

from __future__ import annotations

import os
import sys

# Run as a script, this file's folder is sys.path[0], where the sibling benchmark
# ``redistribute.py`` would shadow the ``redistribute`` package.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import gc
import importlib.util
import resource
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import numpy as np
from mpi4py import MPI

import dtensor as dt
from launch.bench._common import Progress, bench_args, emit, environment, ratio, table
from launch.examples.gpt import GPTConfig
from launch.examples.gpt_strategies import build
from launch.examples.text_data import VOCAB, ByteData, docstring_text

COMM = MPI.COMM_WORLD
MiB = 2**20
TARGET_RATIO = 1.0
CONFIGS = {
    "tiny": GPTConfig(vocab_size=VOCAB, block_size=64, n_layer=2, n_head=4, d_model=64,
                      bias=False),
    "small": GPTConfig(vocab_size=VOCAB, block_size=256, n_layer=6, n_head=6, d_model=384,
                       bias=False),
}
#: mode -> (dtensor strategy of ``gpt_strategies``, torch counterpart)
MODES = {
    "local": ("local", "nn.Module"),
    "dp": ("dp", "DDP"),
    "replicate": ("replicate", "DDP"),
    "fsdp": ("fsdp", "FSDP2 fully_shard"),
    "tp": ("tp", "parallelize_module"),
}
PHASES = ("forward", "backward", "optimizer")
WEIGHT_DECAY = 0.1
MEMORY_STEPS = 2


def _say(*args: object) -> None:
    if COMM.rank == 0:
        print(*args, flush=True)


# -- torch.distributed over the MPI ranks ---------------------------------------------------------
def torch_init(threads: int) -> Callable[[], None]:
    """Start torch's gloo process group over COMM_WORLD: rank and world size from MPI,
    ``MASTER_ADDR=127.0.0.1`` and a free port that rank 0 picks and broadcasts; torch set to
    ``threads`` intra-op threads and one inter-op thread. **Collective**. Returns the
    teardown."""
    import torch
    import torch.distributed as tdist

    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set (inter-op work has started): leave it
        pass
    port = None
    if COMM.rank == 0:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = COMM.bcast(port, root=0)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    tdist.init_process_group("gloo", init_method="env://", rank=COMM.rank,
                             world_size=COMM.size)
    return tdist.destroy_process_group


# -- memory ------------------------------------------------------------------------------------------
def _status_kib(key: str, default: int | None = None) -> int:
    """A ``/proc/self/status`` figure in KiB (``default`` where there is none)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        if default is None:
            raise
    if default is None:
        raise KeyError(key)
    return default


def _reset_peak() -> bool:
    """Reset the process's peak RSS (``VmHWM``); False where Linux does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _trim() -> None:
    """Give freed heap memory back to the system (glibc), so the resident set is live data."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def rss_growth(fn: Callable[[], Any]) -> tuple[int, str]:
    """Bytes by which this process's peak resident set rose above its resident set before
    ``fn()`` (freed memory trimmed first), and the method used. **Local**."""
    gc.collect()
    dt.empty_cache()
    _trim()
    try:
        base = _status_kib("VmRSS")
        method = "VmHWM - VmRSS" if _reset_peak() else None
    except (OSError, KeyError):
        base, method = None, None
    if method is None:  # the peak cannot be reset: the growth of ru_maxrss, a lower bound
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        fn()
        return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024, \
            "ru_maxrss delta"
    fn()
    return (_status_kib("VmHWM") - base) * 1024, method


# -- the two sides -----------------------------------------------------------------------------------
def full_weights(model: Any) -> dict[str, np.ndarray]:
    """Every parameter of a dtensor model as a full float32 numpy array, by name.
    **Collective** when parameters are DTensors (sharded ones are gathered)."""
    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        if isinstance(t, dt.DTensor):
            t = t.full_tensor()
        out[name] = np.array(t.numpy(), dtype=np.float32, copy=True)
    return out


class Side:
    """One library's model, optimizer and step, timed by phase."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.times: list[list[float]] = []  # per step: forward, backward, optimizer seconds
        self.faults: list[int] = []  # per step: minor page faults of the process
        self.cpu: list[float] = []  # per step: CPU seconds of the process (every thread)
        self.losses: list[float] = []

    def step(self, idx: np.ndarray, tgt: np.ndarray) -> Any:
        clock = time.perf_counter
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        cpu = time.process_time()
        t0 = clock()
        loss = self.forward(idx, tgt)
        t1 = clock()
        loss.backward()
        t2 = clock()
        self.opt.step()
        self.opt.zero_grad()
        t3 = clock()
        self.times.append([t1 - t0, t2 - t1, t3 - t2])
        self.cpu.append(time.process_time() - cpu)
        self.faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
        return loss


class DtSide(Side):
    def __init__(self, mode: str, cfg: GPTConfig, args: Any) -> None:
        super().__init__("dtensor")
        self.run = build(MODES[mode][0], cfg, seed=args.seed)
        self.opt = dt.optim.AdamW(self.run.model.parameters(), lr=args.lr,
                                  weight_decay=WEIGHT_DECAY)

    def forward(self, idx: np.ndarray, tgt: np.ndarray) -> Any:
        return self.run.model(*self.run.inputs(idx, tgt))

    def loss_value(self, loss: Any) -> float:
        return self.run.loss_value(loss)


class TorchSide(Side):
    def __init__(self, mode: str, cfg: GPTConfig, args: Any,
                 weights: dict[str, np.ndarray]) -> None:
        super().__init__("torch")
        import torch  # lazy: torch is never a dependency; only the torch side needs it

        from launch.bench import _torch_gpt  # lazy: it imports torch

        self.torch = torch
        self.model, self.n_data, self.data_rank = _torch_gpt.build(
            mode, cfg, weights, COMM.rank, COMM.size)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=args.lr,
                                     weight_decay=WEIGHT_DECAY)

    def forward(self, idx: np.ndarray, tgt: np.ndarray) -> Any:
        per = idx.shape[0] // self.n_data
        lo, hi = self.data_rank * per, (self.data_rank + 1) * per
        return self.model(self.torch.from_numpy(idx[lo:hi]), self.torch.from_numpy(tgt[lo:hi]))

    def loss_value(self, loss: Any) -> float:
        value = float(loss.detach().item())
        return value if self.n_data == 1 else COMM.allreduce(value) / COMM.size


def _median_worst(times: list[list[float]], warmup: int) -> tuple[float, dict[str, float]]:
    """Median over the timed steps of the slowest rank's step seconds, and per phase the
    median of the slowest rank's phase seconds. **Collective**."""
    a = np.ascontiguousarray(np.asarray(times[warmup:], dtype=np.float64))
    worst_phase = np.empty_like(a)
    COMM.Allreduce(a, worst_phase, op=MPI.MAX)
    worst_step = np.empty(len(a))
    COMM.Allreduce(np.ascontiguousarray(a.sum(axis=1)), worst_step, op=MPI.MAX)
    phases = {p: float(np.median(worst_phase[:, j])) for j, p in enumerate(PHASES)}
    return float(np.median(worst_step)), phases


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _memory_of(make: Callable[[], Side], batches: list) -> tuple[int, str, dict[str, int]]:
    """Worst rank's RSS growth over building a side and running its first steps, the
    method, and worst rank's dtensor allocator figures over that run (``peak_allocated``:
    the most bytes live in its tensors at once; ``reserved``: what its pool held at the
    end, live or cached for reuse)."""
    stats: dict[str, int] = {}

    def run() -> None:
        shmem = _status_kib("RssShmem", 0) * 1024  # after rss_growth freed what it could
        dt.reset_peak_memory_stats()
        side = make()
        for idx, tgt in batches[:MEMORY_STEPS]:
            side.step(idx, tgt)
        mem = dt.memory_stats()
        stats.update(peak_allocated=mem["peak_allocated_bytes"], reserved=mem["reserved_bytes"])
        stats["shmem"] = _status_kib("RssShmem", 0) * 1024 - shmem
        COMM.Barrier()

    COMM.Barrier()
    grown, method = rss_growth(run)
    stats = {k: int(COMM.allreduce(v, op=MPI.MAX)) for k, v in stats.items()}
    return int(COMM.allreduce(grown, op=MPI.MAX)), method, stats


def profile_dt(mode: str, cfg: GPTConfig, args: Any, batches: list, top: int = 30) -> str:
    """cProfile of ``--profile-steps`` dtensor steps of ``mode`` on rank 0 (every rank runs
    them); the report by own time, on rank 0. **Collective**."""
    import cProfile
    import io
    import pstats

    side = DtSide(mode, cfg, args)
    for idx, tgt in batches[:2]:  # warm
        side.step(idx, tgt)
    prof = cProfile.Profile() if COMM.rank == 0 else None
    COMM.Barrier()
    if prof:
        prof.enable()
    for idx, tgt in batches[2:2 + args.profile_steps]:
        side.step(idx, tgt)
    if prof:
        prof.disable()
    COMM.Barrier()
    if prof is None:
        return ""
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf).strip_dirs().sort_stats("tottime")
    stats.print_stats(top)
    return buf.getvalue()


def run_mode(mode: str, cfg: GPTConfig, args: Any, batches: list,
             progress: Callable[..., None]) -> dict[str, Any]:
    """Time both sides of ``mode`` in turns (dtensor's alone with ``args.no_torch``), then
    measure their memory. **Collective**."""
    ours = DtSide(mode, cfg, args)
    weights = full_weights(ours.run.model)
    theirs = None if args.no_torch else TorchSide(mode, cfg, args, weights)
    sides = [s for s in (ours, theirs) if s is not None]
    for i, (idx, tgt) in enumerate(batches):
        for side in (sides if i % 2 == 0 else sides[::-1]):
            COMM.Barrier()
            loss = side.step(idx, tgt)
            side.losses.append(side.loss_value(loss))
            del loss
        progress(f"{mode}: step {i + 1} of {len(batches)}", step=False)
    tokens = args.batch * cfg.block_size
    row: dict[str, Any] = {"dtensor": MODES[mode][0],
                           "torch": None if theirs is None else MODES[mode][1]}
    for side in sides:
        step, phases = _median_worst(side.times, args.warmup)
        key = side.name
        row[f"{key}_step_ms"] = round(step * 1e3, 2)
        row[f"{key}_phases_ms"] = {p: round(s * 1e3, 2) for p, s in phases.items()}
        row[f"{key}_tokens_per_s"] = round(tokens / step, 1)
        row[f"{key}_losses"] = side.losses
        row[f"{key}_cpu_ms"] = round(1e3 * COMM.allreduce(
            statistics.median(side.cpu[args.warmup:]), op=MPI.MAX), 2)
        row[f"{key}_page_faults"] = int(COMM.allreduce(
            statistics.median(side.faults[args.warmup:]), op=MPI.MAX))
    row["loss0_dtensor"] = ours.losses[0]
    if theirs is not None:
        row["ratio"] = ratio(row["dtensor_tokens_per_s"], row["torch_tokens_per_s"])
        row["loss0_torch"] = theirs.losses[0]
        row["loss0_rel_diff"] = _rel(ours.losses[0], theirs.losses[0])
        row["max_rel_loss_diff"] = max(_rel(a, b) for a, b in zip(ours.losses, theirs.losses))
    del ours, theirs, sides
    if not args.no_memory:
        progress(f"{mode}: memory", step=False)
        grown, method, stats = _memory_of(lambda: DtSide(mode, cfg, args), batches)
        row["dtensor_rss_mib"] = round(grown / MiB, 1)
        row["dtensor_peak_allocated_mib"] = round(stats["peak_allocated"] / MiB, 1)
        row["dtensor_reserved_mib"] = round(stats["reserved"] / MiB, 1)
        row["dtensor_shmem_mib"] = round(stats["shmem"] / MiB, 1)
        if not args.no_torch:
            grown, method, _ = _memory_of(lambda: TorchSide(mode, cfg, args, weights), batches)
            row["torch_rss_mib"] = round(grown / MiB, 1)
        row["rss_method"] = method
    if "ratio" in row:
        row["target_met"] = row["ratio"] >= TARGET_RATIO
    return row


def report(result: dict[str, Any]) -> str:
    """The tables of a result: per mode the step figures, then per side the phases."""
    rows = result["modes"]
    main = table(
        ("mode", "dtensor", "torch", "dtensor ms", "torch ms", "dtensor tok/s", "torch tok/s",
         "ratio", "dtensor RSS MiB", "torch RSS MiB", "loss0 rel diff"),
        [(m, r["dtensor"], r["torch"] or "-", r["dtensor_step_ms"], r.get("torch_step_ms"),
          r["dtensor_tokens_per_s"], r.get("torch_tokens_per_s"), r.get("ratio"),
          r.get("dtensor_rss_mib"), r.get("torch_rss_mib"), r.get("loss0_rel_diff"))
         for m, r in rows.items()],
        markdown=True, title=result["title"])
    phases = table(
        ("mode", "side", "forward ms", "backward ms", "optimizer ms", "CPU ms", "page faults"),
        [(m, side, *(r[f"{side}_phases_ms"][p] for p in PHASES), r[f"{side}_cpu_ms"],
          r[f"{side}_page_faults"])
         for m, r in rows.items() for side in ("dtensor", "torch") if f"{side}_cpu_ms" in r],
        markdown=True)
    return main + "\n\n" + phases


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, run every mode, print the JSON and the tables.
    **Collective**."""
    blas = int(os.environ.get("OPENBLAS_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS")
               or os.cpu_count() or 1)
    args = bench_args(
        __doc__.split("\n\n")[0], argv, repeat=9,
        model={"choices": sorted(CONFIGS), "default": "small", "help": "the GPT's sizes"},
        strategy={"default": "local,dp,fsdp,tp",
                  "help": f"comma-separated modes of {', '.join(MODES)}"},
        steps={"type": int, "help": "steps per side, warm-up included (instead of "
               "--warmup plus --repeat)"},
        warmup={"type": int, "default": 3, "help": "first steps left out of the timing"},
        batch={"type": int, "default": 8, "help": "global batch in sequences"},
        lr={"type": float, "default": 1e-3, "help": "AdamW's learning rate"},
        seed={"type": int, "default": 0,
              "help": "the seed of the weights and the batches (default: %(default)s)"},
        torch_threads={"type": int, "default": blas,
                       "help": "torch intra-op threads (dtensor's BLAS threads)"},
        no_torch={"action": "store_true", "help": "dtensor's side only"},
        no_memory={"action": "store_true", "help": "skip the memory phase"},
        profile={"action": "store_true", "help": "cProfile dtensor steps of each mode"},
        profile_steps={"type": int, "default": 3, "help": "steps --profile profiles"},
    )
    if args.steps is None:
        args.steps = args.warmup + args.repeat
    cfg = CONFIGS[args.model]
    modes = [m for m in args.strategy.split(",") if m]
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"gpt_vs_torch: no mode {m!r}; the modes are {', '.join(MODES)}")
    if args.steps <= args.warmup:
        raise SystemExit(f"gpt_vs_torch: --steps {args.steps} leaves no timed step after "
                         f"--warmup {args.warmup}")
    if args.batch % COMM.size and any(m in ("dp", "replicate", "fsdp") for m in modes):
        raise SystemExit(f"gpt_vs_torch: --batch {args.batch} does not split over "
                         f"{COMM.size} ranks")
    torch_version = None
    if not args.no_torch and importlib.util.find_spec("torch") is None:
        _say("gpt_vs_torch: torch is not installed, so there is nothing to compare with "
             "(pip install torch, the CPU wheel); dtensor's side only.")
        args.no_torch = True
    teardown = None
    if not args.no_torch:
        import torch

        torch_version = torch.__version__
        teardown = torch_init(args.torch_threads)
    data = ByteData(docstring_text(), seed=args.seed)
    batches = [data.batch(i, args.batch, cfg.block_size) for i in range(args.steps)]
    tokens = args.batch * cfg.block_size
    title = (f"GPT {args.model}: {cfg.n_params()} parameters, batch {args.batch} x "
             f"{cfg.block_size} ({tokens} tokens per step), {COMM.size} ranks; "
             f"{args.steps - args.warmup} timed steps after {args.warmup} warm-up, in turns; "
             + (f"torch {torch_version} with {args.torch_threads} thread(s) per rank "
                f"(dtensor's BLAS threads: {blas})" if torch_version else "no torch"))
    progress = Progress("gpt_vs_torch", len(modes), enabled=COMM.rank == 0 and not args.quiet)
    rows: dict[str, dict[str, Any]] = {}
    profiles: dict[str, str] = {}
    try:
        for mode in modes:
            rows[mode] = r = run_mode(mode, cfg, args, batches, progress)
            versus = ("" if args.no_torch else
                      f", torch {r['torch_step_ms']:.1f} ms; ratio {r['ratio']:.2f}")
            progress(f"{mode}: dtensor {r['dtensor_step_ms']:.1f} ms per step{versus}")
            if args.profile:
                profiles[mode] = profile_dt(mode, cfg, args, batches)
                _say(f"-- cProfile of dtensor {mode}, {args.profile_steps} steps, rank 0\n"
                     f"{profiles[mode]}")
    finally:
        if teardown is not None:
            teardown()
    result = {
        "benchmark": "gpt_vs_torch", "title": title, "model": args.model,
        "config": asdict(cfg), "n_params": cfg.n_params(), "ranks": COMM.size,
        "batch": args.batch, "seq": cfg.block_size, "tokens_per_step": tokens,
        "steps": args.steps, "warmup": args.warmup, "lr": args.lr,
        "weight_decay": WEIGHT_DECAY, "torch": torch_version,
        "torch_threads": None if args.no_torch else args.torch_threads,
        "blas_threads": blas, "memory_steps": MEMORY_STEPS, "target_ratio": TARGET_RATIO,
        "targets_met": {m: r["target_met"] for m, r in rows.items() if "target_met" in r},
        "modes": rows, "environment": environment(),
    }
    if COMM.rank == 0:
        emit(result, args.out, report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
