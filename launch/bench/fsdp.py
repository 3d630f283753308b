"""``fully_shard`` on the GPT of ``launch/examples/gpt.py``: step time with and without
prefetch, the share of all-gather time hidden behind compute, and the memory per rank of
each strategy beside the theory.

Run as ``python -m launch -n 2 -m launch.bench.fsdp [--d-model 256] [--layers 4]
[--seq 128] [--vocab 4096] [--batch 4] [--repeat 10] [--strategies LIST] [--out FILE]``.

* Prefetch: two FSDP (ZeRO-3) copies of the model, one with the default prefetch (the next
  group's all-gather started as a group's forward or backward begins), one with prefetch
  turned off (``set_modules_to_forward_prefetch([])`` and ``..._backward_prefetch([])`` on
  every module); their training steps (forward, backward, AdamW) take turns, the ranks meet
  at a barrier before each. Per step: the seconds the all-gathers took (on the worker thread
  that runs them) and the seconds the training thread waited for them; hidden =
  1 - waited / took. Medians over the steps, worst rank.
* Memory: for each strategy, one model at a time: ``allocated_bytes`` after a step's
  ``optimizer.step()`` (parameters, gradients and Adam state, before ``zero_grad``) and the
  step's ``peak_allocated_bytes``; the theory of the first is 16 bytes per parameter
  (float32 parameter, gradient, two Adam moments) divided as the strategy divides them.

Output: JSON on stdout (``--out FILE`` too), then the figures as tables.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time

# Run as a script, this file's folder is sys.path[0], where the sibling benchmark
# ``redistribute.py`` would shadow the ``redistribute`` package.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

from mpi4py import MPI

import dtensor as dt
from launch.bench._common import Progress, bench_args, emit, environment, table, worst_rank
from launch.examples.gpt import GPTConfig, batch
from launch.examples.gpt_strategies import build, supported

COMM = MPI.COMM_WORLD


def _step(run, opt, i, cfg, batch_size):
    idx, tgt = batch(cfg, batch_size * run.n_data, i)
    loss = run.model(*run.inputs(idx, tgt))
    loss.backward()
    opt.step()
    opt.zero_grad()


def _no_prefetch(model):
    for m in model.modules():
        if isinstance(m, dt.FSDPModule):
            m.set_modules_to_forward_prefetch([])
            m.set_modules_to_backward_prefetch([])


def prefetch(cfg, batch_size, repeat):
    """Step seconds and hidden all-gather shares with and without prefetch."""
    runs = {"prefetch": build("fsdp", cfg), "no_prefetch": build("fsdp", cfg)}
    _no_prefetch(runs["no_prefetch"].model)
    opts = {k: dt.optim.AdamW(r.model.parameters(), lr=1e-3) for k, r in runs.items()}
    samples = {k: {"step_s": [], "gather_s": [], "wait_s": []} for k in runs}
    for i in range(repeat + 2):
        for k, run in runs.items():
            stats = run.model._fsdp_state.ctx.stats if run.model._fsdp_state.ctx else None
            if stats is not None:
                stats.reset()
            COMM.Barrier()
            t0 = time.perf_counter()
            _step(run, opts[k], i, cfg, batch_size)
            took = time.perf_counter() - t0
            stats = run.model._fsdp_state.ctx.stats
            if i >= 2:  # warm: buffers touched, forward order known
                samples[k]["step_s"].append(took)
                samples[k]["gather_s"].append(stats.gather_s)
                samples[k]["wait_s"].append(stats.wait_s)
    out = {}
    for k, s in samples.items():
        step = worst_rank(statistics.median(s["step_s"]), COMM)
        gather = worst_rank(statistics.median(s["gather_s"]), COMM)
        wait = worst_rank(statistics.median(s["wait_s"]), COMM)
        out[k] = {"step_ms": round(step * 1e3, 1), "all_gather_ms": round(gather * 1e3, 1),
                  "waited_ms": round(wait * 1e3, 1),
                  "hidden": round(max(0.0, 1 - wait / gather), 3) if gather else None}
    out["speedup"] = round(out["no_prefetch"]["step_ms"] / out["prefetch"]["step_ms"], 3)
    return out


def _theory(name, cfg, run, n):
    """16 bytes per parameter (parameter, gradient, two Adam moments), divided as the
    strategy divides the parameters."""
    total = sharded = 0
    for p in run.model.parameters():
        numel = p.numel()
        total += numel
        if isinstance(p, dt.DTensor) and any(isinstance(pl, dt.Shard) for pl in p.placements):
            sharded += numel
    if name in ("fsdp", "zero2", "fsdp_int"):
        return 16 * total / n
    if name in ("tp", "tp_sp"):
        return 16 * (sharded / n + (total - sharded))
    return 16 * total


def memory(cfg, batch_size, names):
    out = {}
    n = COMM.size
    for name in names:
        if not supported(name, n):
            continue
        gc.collect()
        run = build(name, cfg)
        opt = dt.optim.AdamW(run.model.parameters(), lr=1e-3)
        for i in range(2):
            _step(run, opt, i, cfg, batch_size)
        gc.collect()
        dt.reset_peak_memory_stats()
        before = dt.memory_stats()["allocated_bytes"]
        idx, tgt = batch(cfg, batch_size * run.n_data, 2)
        loss = run.model(*run.inputs(idx, tgt))
        loss.backward()
        opt.step()
        state = dt.memory_stats()["allocated_bytes"]
        peak = dt.memory_stats()["peak_allocated_bytes"]
        opt.zero_grad()
        del loss
        theory = _theory(name, cfg, run, n)
        out[name] = {
            "model_state_mb": round(worst_rank(state, COMM) / 2**20, 2),
            "theory_mb": round(theory / 2**20, 2),
            "peak_mb": round(worst_rank(peak, COMM) / 2**20, 2),
            "at_rest_before_step_mb": round(worst_rank(before, COMM) / 2**20, 2),
        }
        del run, opt
    return out


def report(result: dict) -> str:
    """The figures as tables. **Local**."""
    pre = result["prefetch"]
    rows = [(k, r["step_ms"], r["all_gather_ms"], r["waited_ms"], r["hidden"])
            for k, r in pre.items() if isinstance(r, dict)]
    m = result["model"]
    out = table(("fsdp", "step ms", "all-gather ms", "waited ms", "hidden"), rows,
                title=(f"GPT d_model {m['d_model']}, {m['layers']} layers, seq {m['seq']}, "
                       f"{result['ranks']} ranks (medians, worst rank)"),
                notes=[f"prefetch speedup: {pre['speedup']}"])
    rows = [(k, r["model_state_mb"], r["theory_mb"], r["peak_mb"], r["at_rest_before_step_mb"])
            for k, r in result["memory"].items()]
    return out + "\n\n" + table(("strategy", "state MiB", "theory MiB", "peak MiB",
                                  "at rest MiB"), rows, title="memory per rank (worst rank)")


def main(argv=None) -> None:
    args = bench_args(
        __doc__.splitlines()[0],
        argv,
        repeat=10,
        d_model={"type": int, "default": 256, "help": "model width"},
        layers={"type": int, "default": 4, "help": "transformer blocks"},
        seq={"type": int, "default": 128, "help": "sequence length"},
        vocab={"type": int, "default": 4096, "help": "vocabulary size"},
        batch={"type": int, "default": 4, "help": "sequences per data-parallel rank"},
        heads={"type": int, "default": 8, "help": "attention heads"},
        strategies={"default": "replicate,dp,zero2,fsdp,tp",
                    "help": "the strategies of the memory table"},
    )
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers,
                    n_head=args.heads, d_model=args.d_model, bias=False)
    progress = Progress("fsdp", 2, enabled=COMM.rank == 0 and not args.quiet)
    pre = prefetch(cfg, args.batch, args.repeat)
    progress(f"prefetch: {pre['prefetch']['step_ms']} ms per step, without "
             f"{pre['no_prefetch']['step_ms']} ms")
    mem = memory(cfg, args.batch, args.strategies.split(","))
    progress(f"memory of {len(mem)} strategies")
    result = {
        "benchmark": "fsdp",
        "ranks": COMM.size,
        "model": {"d_model": cfg.d_model, "layers": cfg.n_layer, "seq": cfg.block_size,
                  "vocab": cfg.vocab_size, "params": cfg.n_params(),
                  "batch_per_rank": args.batch},
        "prefetch": pre,
        "memory": mem,
        "environment": environment(),
    }
    if COMM.rank == 0:
        emit(result, args.out, report(result))


if __name__ == "__main__":
    main()
