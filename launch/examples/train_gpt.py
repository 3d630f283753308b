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

Checkpoints (one strategy only): ``--save DIR`` writes a ``dt.save`` checkpoint at the end
(and every ``--save-every N`` steps, replacing the previous one); ``--resume DIR`` continues
one, under any strategy and rank count: the parameters, the AdamW moments and step counts
(``dt.checkpoint.get_state_dict``: global tensors keyed by parameter name, so any saved
layout loads into any other; names without activation checkpointing's wrapper), the
learning-rate schedule (its length, warmup and state), the step counter and the data
position (micro-batches drawn, and the data seed). ``--steps`` counts the steps of this run;
``--total-steps`` the schedule's length (default ``--steps``; a resumed run keeps the
checkpoint's), so ``--steps 100 --total-steps 200 --save DIR`` then ``--resume DIR --steps
100`` trains what ``--steps 200`` trains. A resumed run takes the checkpoint's learning
rates and AdamW options (``--lr`` is not read), and casts a saved tensor of another dtype
to its own (``--dtype`` may differ). The configs have no dropout: there is no random state
to carry. A checkpoint of another model config is refused, naming each parameter whose
shape differs.
"""

from __future__ import annotations

import argparse
import dataclasses
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
#: What a checkpoint's ``"meta"`` string (JSON) says it is.
CKPT_FORMAT = ("train_gpt", 1)
#: The wrapper module that activation checkpointing puts in parameter paths.
_WRAPPED = "_checkpoint_wrapped_module."


class ResumeError(Exception):
    """A checkpoint that this run cannot continue (another model, a missing folder)."""


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


def _plain(name: str) -> str:
    """A parameter's name without activation checkpointing's wrapper (the same under
    ``--ac`` and without)."""
    return name.replace(_WRAPPED, "")


def _dtype_name(dtype: object) -> str:
    import numpy as np  # lazy: one dtype name

    return np.dtype(dtype).name


def _dtype_of(name: str) -> object:
    return getattr(dt, name)


def _named_params(model: object) -> dict[str, object]:
    """Plain name -> parameter (a tied parameter under its first name)."""
    out: dict[str, object] = {}
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out[_plain(name)] = p
    return out


def save_checkpoint(path: str, run: object, opt: object, meta: dict) -> float:
    """Save the model, the optimizer (by parameter name, global tensors in the strategy's
    layout) and ``meta`` (the step, data position, schedule and model description) with
    ``dt.save``; the seconds it took. **Collective**."""
    t0 = time.perf_counter()
    msd, osd = dt.checkpoint.get_state_dict(run.model, opt)
    meta = {**meta,
            "params": {_plain(k): {"shape": list(v.shape), "dtype": _dtype_name(v.dtype)}
                       for k, v in msd.items()},
            "optim_state": {_plain(n): {k: _dtype_name(v.dtype) if hasattr(v, "dtype") else None
                                        for k, v in s.items()}
                            for n, s in osd["state"].items()}}
    state = {
        "meta": json.dumps(meta),
        "model": {_plain(k): v for k, v in msd.items()},
        "optim": {"state": {_plain(n): s for n, s in osd["state"].items()},
                  "param_groups": [{**g, "params": [_plain(n) for n in g["params"]]}
                                   for g in osd["param_groups"]]},
    }
    dt.save(state, path)
    return COMM.allreduce(time.perf_counter() - t0, op=MPI.MAX)


def read_meta(path: str) -> dict:
    """The ``"meta"`` of a checkpoint written by :func:`save_checkpoint` (no tensor is
    read). **Collective**."""
    if not (Path(path) / "metadata.json").is_file():
        raise ResumeError(f"--resume {path}: no checkpoint there (no metadata.json)")
    state = dt.load({"meta": ""}, path)
    try:
        meta = json.loads(state["meta"])
    except (TypeError, ValueError):
        meta = None
    if not isinstance(meta, dict) or tuple(meta.get("format", ())) != CKPT_FORMAT:
        raise ResumeError(f"--resume {path}: not a checkpoint of train_gpt.py (its 'meta' "
                          f"is {str(state['meta'])[:80]!r})")
    return meta


def check_model(path: str, meta: dict, model: object, model_name: str) -> None:
    """Raise :class:`ResumeError` naming every parameter whose name or shape differs
    between the checkpoint and ``model``. **Local**."""
    saved = meta["params"]
    mine = {_plain(k): list(v.shape) for k, v in model.state_dict().items()}
    problems = []
    for n, shape in mine.items():
        if n not in saved:
            problems.append(f"{n} {tuple(shape)} is not in the checkpoint")
        elif saved[n]["shape"] != shape:
            problems.append(f"{n} has shape {tuple(saved[n]['shape'])} in the checkpoint "
                            f"but {tuple(shape)} in this model")
    problems += [f"{n} {tuple(saved[n]['shape'])} of the checkpoint is not in this model"
                 for n in saved if n not in mine]
    if problems:
        more = f"; and {len(problems) - 5} more" if len(problems) > 5 else ""
        raise ResumeError(
            f"--resume {path}: the checkpoint holds another model (--model "
            f"{meta.get('model')}: {meta.get('config')}) than this run's (--model "
            f"{model_name}): {'; '.join(problems[:5])}{more}")


def load_checkpoint(path: str, meta: dict, run: object, opt: object) -> None:
    """Fill the model's parameters and the optimizer's state from the checkpoint at
    ``path``, each resharded onto this strategy's layout (and cast to its dtype).
    **Collective**."""
    params = _named_params(run.model)
    model_sd = run.model.state_dict()
    # templates in this run's layouts and the saved dtypes, that dt.load fills
    model_t = {_plain(k): v.detach().clone().to(_dtype_of(meta["params"][_plain(k)]["dtype"]))
               for k, v in model_sd.items()}
    optim_t: dict = {}
    for n, kinds in meta["optim_state"].items():
        p = params[n]
        optim_t[n] = {k: 0 if d is None else p.detach().clone().zero_().to(_dtype_of(d))
                      for k, d in kinds.items()}
    _, fresh = dt.checkpoint.get_state_dict(run.model, opt)
    groups = [{**g, "params": [_plain(n) for n in g["params"]]} for g in fresh["param_groups"]]
    state = dt.load({"model": model_t, "optim": {"state": optim_t, "param_groups": groups}},
                    path)
    real: dict[str, str] = {}  # plain name -> this model's (first) name
    for n, _ in run.model.named_parameters():
        real.setdefault(_plain(n), n)
    osd = {"state": {real[n]: s for n, s in state["optim"]["state"].items()},
           "param_groups": [{**g, "params": [real[n] for n in g["params"]]}
                            for g in state["optim"]["param_groups"]]}
    by_key = {_plain(k): k for k in model_sd}
    dt.checkpoint.set_state_dict(
        run.model, opt, model_state_dict={by_key[k]: v for k, v in state["model"].items()},
        optim_state_dict=osd)


def train(name: str, cfg: GPTConfig, data: ByteData, args: argparse.Namespace,
          peak_flops: float) -> list[dict]:
    """One strategy's run: the metrics of every step. **Collective**."""
    dtype = dt.bfloat16 if args.dtype == "bfloat16" else None
    run = build(name, cfg, seed=args.seed, ac=args.ac, dtype=dtype)
    opt = dt.optim.AdamW(run.model.parameters(), lr=args.lr, weight_decay=0.1)
    start, position = 0, 0  # the first step, the micro-batches drawn before it
    warmup, total = args.warmup, args.total_steps or args.steps
    if args.resume:
        meta = read_meta(args.resume)
        check_model(args.resume, meta, run.model, args.model)
        warmup, total = meta["schedule"]["warmup"], meta["schedule"]["total_steps"]
        for flag, mine, saved in (("--warmup", args.warmup_given, warmup),
                                  ("--total-steps", args.total_steps, total)):
            if mine is not None and mine != saved:
                raise ResumeError(f"--resume {args.resume}: {flag} {mine} differs from the "
                                  f"checkpoint's schedule ({flag} {saved})")
    sched = _scheduler(opt, warmup, total)
    if args.resume:
        t0 = time.perf_counter()
        load_checkpoint(args.resume, meta, run, opt)
        sched.load_state_dict(meta["schedule"]["state"])
        start, position = meta["step"], meta["data"]["position"]
        data.seed = meta["data"]["seed"]
        seconds = COMM.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        _say(f"{name:>9} resumed step {start} (data position {position}, lr "
             f"{sched.get_last_lr()[0]:.3e}) from {args.resume}, saved under "
             f"{meta['strategy']} at {meta['ranks']} ranks, in {seconds:.2f} s")
    last = start + args.steps - 1

    def save(step: int) -> None:
        meta = {"format": list(CKPT_FORMAT), "model": args.model,
                "config": dataclasses.asdict(cfg), "step": step + 1,
                "data": {"position": position, "seed": data.seed,
                         "source": args.data or "docstrings"},
                "schedule": {"warmup": warmup, "total_steps": total,
                             "state": sched.state_dict()},
                "strategy": name, "ranks": COMM.size, "dtype": args.dtype}
        seconds = save_checkpoint(args.save, run, opt, meta)
        _say(f"{name:>9} saved step {step + 1} to {args.save} in {seconds:.2f} s")

    tokens = args.batch * cfg.block_size * args.grad_accum
    flops = cfg.flops_per_token() * tokens
    cores = 1 if name == "local" else COMM.size  # every rank runs the whole local model
    comm_bytes = 0
    rows = []
    for step in range(start, last + 1):
        dt.reset_peak_memory_stats()
        COMM.Barrier()
        t0 = time.perf_counter()
        loss_sum = 0.0
        mode = dt.debug.CommDebugMode() if step == start else None
        if mode is not None:
            mode.__enter__()
        try:
            for micro in range(args.grad_accum):
                idx, tgt = data.batch(position, args.batch, cfg.block_size)
                position += 1
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
        if (step + 1) % args.eval_interval == 0 or step == last:
            row["val_loss"] = _val_loss(run, data, cfg, args.batch, step)
        rows.append(row)
        val = f" | val {row['val_loss']:.4f}" if "val_loss" in row else ""
        _say(f"{name:>9} step {step:4d} | loss {row['loss']:.4f}{val} | "
             f"{row['tokens_per_s']:8.0f} tok/s | MFU {100 * row['mfu']:5.1f}% | "
             f"peak {peak / MiB:7.1f} MiB | comm {comm_bytes / MiB:7.2f} MiB")
        if args.save and (step == last or (args.save_every and (step + 1) % args.save_every
                                           == 0)):
            save(step)
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
    p.add_argument("--steps", type=int, default=200, help="steps of this run")
    p.add_argument("--total-steps", type=int, default=argparse.SUPPRESS,
                   help="the learning-rate schedule's length (default: --steps; a resumed "
                        "run keeps its checkpoint's)")
    p.add_argument("--batch", type=int, default=8, help="global batch in sequences")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=argparse.SUPPRESS,
                   help="linear warmup steps (default: 20; a resumed run keeps its "
                        "checkpoint's)")
    p.add_argument("--eval-interval", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peak-gflops", type=float, help="matmul peak per core (default: measure)")
    p.add_argument("--rtol", type=float, default=1e-4,
                   help="largest relative loss difference from the first strategy")
    p.add_argument("--json", help="write the metrics here")
    p.add_argument("--png", help="write the loss and throughput curves here")
    p.add_argument("--save", metavar="DIR",
                   help="write a checkpoint (dt.save) here at the end (one strategy only)")
    p.add_argument("--save-every", type=int, metavar="N",
                   help="with --save: also every N steps (the step count a multiple of N)")
    p.add_argument("--resume", metavar="DIR",
                   help="continue the checkpoint in DIR, saved under any strategy and rank "
                        "count (one strategy only)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and train every strategy. **Collective**."""
    args = parser().parse_args(argv)
    args.warmup_given = getattr(args, "warmup", None)  # None: not given
    args.warmup = 20 if args.warmup_given is None else args.warmup_given
    args.total_steps = getattr(args, "total_steps", None)
    cfg = CONFIGS[args.model]
    names = [ALIASES.get(s, s) for s in args.strategy.split(",") if s]
    for s in names:
        if not supported(s, COMM.size):
            parser().error(f"strategy {s!r} does not run at {COMM.size} ranks")
    if (args.save or args.resume) and len(names) != 1:
        flags = " and ".join(f for f, v in (("--save", args.save), ("--resume", args.resume))
                             if v)
        parser().error(f"{flags} take one strategy; --strategy gives {len(names)} "
                       f"({','.join(names)})")
    if args.save_every is not None and (not args.save or args.save_every < 1):
        parser().error(f"--save-every {args.save_every} needs --save DIR and N >= 1")
    if args.steps < 1:
        parser().error(f"--steps {args.steps}: a run trains at least one step")
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
    try:
        results = {s: train(s, cfg, data, args, peak) for s in names}
    except ResumeError as e:  # every rank raises it alike (the same files and model)
        _say(f"train_gpt.py: error: {e}")
        return 2
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
                              "ranks": COMM.size, "resume": args.resume,
                              "save": args.save},
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
