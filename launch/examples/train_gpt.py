"""Train a GPT-2-style model on real text: ``python -m launch -n 2 launch/examples/train_gpt.py``.

The GPT of ``launch/examples/gpt.py`` (``--model tiny|small|medium``; small is 6 layers,
d_model 384, 6 heads, sequence 256: 10.8M parameters) on byte-level tokens of the
standard library's and numpy's docstrings (``launch/examples/text_data.py``) or of any
text file (``--data FILE``), with a held-out validation tail, AdamW with linear warmup and
cosine decay (``dt.optim.lr_scheduler``), under each of ``--strategy`` (comma-separated:
``local``, ``dp``, ``replicate``, ``fsdp`` (alias ``fsdp2``), ``zero2``, ``fsdp_int``,
``tp``, ``tp_sp``, ``fsdp_tp``, ``hsdp``; see ``launch/examples/gpt_strategies.py``).
``--dtype bfloat16`` computes in bfloat16 (FSDP: float32 master weights and reductions),
``--ac`` recomputes every block in backward, ``--grad-accum K`` accumulates K micro-batches
per step (without synchronizing gradients in between).

Every strategy sees the same global batch at every step (each data-parallel rank its own
rows of it). Each step prints one line: step, loss, validation loss (every
``--eval-interval`` steps), tokens/s, MFU against this machine's float32 matmul peak per
core (``launch/bench/peak.py``, measured at start unless ``--peak-gflops`` is given) times
the ranks that share the work (one for ``local``, which every rank runs whole), the worst
rank's peak memory and the bytes this rank's collectives moved in the
step (counted on the first step, whose pattern every step repeats). A final table compares
the strategies, with each one's largest loss difference from the first. ``--json FILE``
writes every figure per step; ``--png FILE`` the loss and throughput curves (matplotlib).
Exits 1 when a strategy's losses differ from the first strategy's by more than ``--rtol``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from mpi4py import MPI

import dtensor as dt
from launch.examples.gpt import GPTConfig
from launch.examples.gpt_strategies import FSDP, build, supported
from launch.examples.text_data import VOCAB, ByteData, docstring_text

COMM = MPI.COMM_WORLD
CONFIGS = {
    "tiny": GPTConfig(vocab_size=VOCAB, block_size=64, n_layer=2, n_head=4, d_model=64,
                      bias=False),
    "small": GPTConfig(vocab_size=VOCAB, block_size=256, n_layer=6, n_head=6, d_model=384,
                       bias=False),
    "medium": GPTConfig(vocab_size=VOCAB, block_size=512, n_layer=12, n_head=12, d_model=768,
                        bias=False),
}
ALIASES = {"fsdp2": "fsdp"}
MiB = 2**20


def _say(*args: object) -> None:
    if COMM.rank == 0:
        print(*args, flush=True)


def _scheduler(opt: object, warmup: int, steps: int) -> object:
    """Linear warmup from lr/10 over ``warmup`` steps, then cosine decay to lr/10."""
    lrs = dt.optim.lr_scheduler
    base = opt.param_groups[0]["lr"]
    if warmup <= 0:
        return lrs.CosineAnnealingLR(opt, T_max=max(steps, 1), eta_min=base / 10)
    return lrs.SequentialLR(opt, [
        lrs.LinearLR(opt, start_factor=0.1, end_factor=1.0, total_iters=warmup),
        lrs.CosineAnnealingLR(opt, T_max=max(steps - warmup, 1), eta_min=base / 10),
    ], milestones=[warmup])


def _micro_context(run: object, last: bool) -> object:
    """Gradient synchronization off for every micro-batch but the last."""
    model = run.model
    if run.name in FSDP:
        model.set_requires_gradient_sync(last)
    elif run.name == "replicate" and not last:
        return model.no_sync()
    import contextlib  # lazy: one context type

    return contextlib.nullcontext()


def _val_loss(run: object, data: ByteData, cfg: GPTConfig, batch: int, step: int) -> float:
    model = run.model
    model.eval()
    with dt.no_grad():
        idx, tgt = data.batch(step, batch, cfg.block_size, split="val")
        value = run.loss_value(model(*run.inputs(idx, tgt)))
    model.train()
    return value


def train(name: str, cfg: GPTConfig, data: ByteData, args: argparse.Namespace,
          peak_flops: float) -> list[dict]:
    """One strategy's run: the metrics of every step. **Collective**."""
    dtype = dt.bfloat16 if args.dtype == "bfloat16" else None
    run = build(name, cfg, seed=args.seed, ac=args.ac, dtype=dtype)
    opt = dt.optim.AdamW(run.model.parameters(), lr=args.lr, weight_decay=0.1)
    sched = _scheduler(opt, args.warmup, args.steps)
    tokens = args.batch * cfg.block_size * args.grad_accum
    flops = cfg.flops_per_token() * tokens
    cores = 1 if name == "local" else COMM.size  # every rank runs the whole local model
    comm_bytes = 0
    rows = []
    for step in range(args.steps):
        dt.reset_peak_memory_stats()
        COMM.Barrier()
        t0 = time.perf_counter()
        loss_sum = 0.0
        mode = dt.debug.CommDebugMode() if step == 0 else None
        if mode is not None:
            mode.__enter__()
        try:
            for micro in range(args.grad_accum):
                idx, tgt = data.batch(step * args.grad_accum + micro, args.batch,
                                      cfg.block_size)
                with _micro_context(run, micro == args.grad_accum - 1):
                    loss = run.model(*run.inputs(idx, tgt))
                    (loss * (1.0 / args.grad_accum) if args.grad_accum > 1 else loss).backward()
                loss_sum += run.loss_value(loss)
            dt.nn.utils.clip_grad_norm_(run.model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
        finally:
            if mode is not None:
                mode.__exit__(None, None, None)
                comm_bytes = mode.get_total_bytes()
        seconds = COMM.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        peak = COMM.allreduce(dt.memory_stats()["peak_allocated_bytes"], op=MPI.MAX)
        row = {"step": step, "loss": loss_sum / args.grad_accum, "seconds": seconds,
               "tokens_per_s": tokens / seconds,
               "mfu": flops / seconds / (peak_flops * cores),
               "peak_bytes": int(peak), "comm_bytes": int(comm_bytes)}
        if (step + 1) % args.eval_interval == 0 or step == args.steps - 1:
            row["val_loss"] = _val_loss(run, data, cfg, args.batch, step)
        rows.append(row)
        val = f" | val {row['val_loss']:.4f}" if "val_loss" in row else ""
        _say(f"{name:>9} step {step:4d} | loss {row['loss']:.4f}{val} | "
             f"{row['tokens_per_s']:8.0f} tok/s | MFU {100 * row['mfu']:5.1f}% | "
             f"peak {peak / MiB:7.1f} MiB | comm {comm_bytes / MiB:7.2f} MiB")
    return rows


def _plot(results: dict, path: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in results.items():
        steps = [r["step"] for r in rows]
        (line,) = ax1.plot(steps, [r["loss"] for r in rows], label=name)
        vals = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
        if vals:  # validation losses: dots of the strategy's colour
            ax1.plot(*zip(*vals), "o", markersize=3, color=line.get_color())
        ax2.plot(steps[1:], [r["tokens_per_s"] for r in rows[1:]], label=name)
    ax1.set_xlabel("step")
    ax1.set_ylabel("loss (nats/byte)")
    ax2.set_xlabel("step")
    ax2.set_ylabel("tokens/s")
    ax1.legend()
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=sorted(CONFIGS), default="small")
    p.add_argument("--data", help="a text file (default: stdlib and numpy docstrings)")
    p.add_argument("--strategy", default="local", help="comma-separated strategies")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--ac", action="store_true", help="activation checkpointing of the blocks")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=8, help="global batch in sequences")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--eval-interval", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peak-gflops", type=float, help="matmul peak per core (default: measure)")
    p.add_argument("--rtol", type=float, default=1e-4,
                   help="largest relative loss difference from the first strategy")
    p.add_argument("--json", help="write the metrics here")
    p.add_argument("--png", help="write the loss and throughput curves here")
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and train every strategy. **Collective**."""
    args = parser().parse_args(argv)
    cfg = CONFIGS[args.model]
    names = [ALIASES.get(s, s) for s in args.strategy.split(",") if s]
    for s in names:
        if not supported(s, COMM.size):
            parser().error(f"strategy {s!r} does not run at {COMM.size} ranks")
    text = Path(args.data).read_bytes() if args.data else docstring_text()
    data = ByteData(text, seed=args.seed)
    if args.peak_gflops:
        peak = args.peak_gflops * 1e9
    else:
        from launch.bench.peak import gflops  # lazy: only when measuring

        peak = COMM.allreduce(gflops(512, 5), op=MPI.MIN) * 1e9
    _say(f"GPT {args.model}: {cfg.n_params()} parameters, {cfg.flops_per_token()} FLOPs per "
         f"token; {len(data.train)} training bytes, {len(data.val)} validation bytes; "
         f"unigram baseline {data.unigram_loss():.4f} nats/byte; peak "
         f"{peak / 1e9:.1f} GFLOP/s per core x {COMM.size} ranks")
    results = {s: train(s, cfg, data, args, peak) for s in names}
    first = results[names[0]]
    status = 0
    _say("\nstrategy   final loss  val loss  tokens/s  MFU    peak MiB  comm MiB/step  "
         "max rel diff")
    summary = {}
    for s, rows in results.items():
        diff = max(abs(a["loss"] - b["loss"]) / max(abs(b["loss"]), 1.0)
                   for a, b in zip(rows, first))
        status |= diff > args.rtol
        warm = rows[1:] or rows
        tps = statistics.median(r["tokens_per_s"] for r in warm)
        mfu = statistics.median(r["mfu"] for r in warm)
        summary[s] = {"tokens_per_s": tps, "mfu": mfu, "max_rel_loss_diff": diff}
        _say(f"{s:<10} {rows[-1]['loss']:10.4f} {rows[-1].get('val_loss', float('nan')):9.4f} "
             f"{tps:9.0f} {100 * mfu:5.1f}% {max(r['peak_bytes'] for r in rows) / MiB:9.1f} "
             f"{rows[0]['comm_bytes'] / MiB:14.2f}  {diff:.2e}")
    if COMM.rank == 0:
        if args.json:
            doc = {"config": {**vars(cfg), "model": args.model, "dtype": args.dtype,
                              "ac": args.ac, "batch": args.batch,
                              "grad_accum": args.grad_accum, "steps": args.steps,
                              "ranks": COMM.size},
                   "n_params": cfg.n_params(), "flops_per_token": cfg.flops_per_token(),
                   "peak_flops_per_core": peak, "unigram_loss": data.unigram_loss(),
                   "strategies": results, "summary": summary}
            with open(args.json, "w", encoding="utf-8") as fh:
                json.dump(doc, fh, indent=1, default=float)
        if args.png and not _plot(results, args.png):
            print("--png: matplotlib is not installed (the [bench] extra); no plot written")
    if status:
        _say(f"LOSSES DIFFER: a strategy's loss left the first one's by more than {args.rtol}")
    return int(status)


if __name__ == "__main__":
    sys.exit(main())
