"""Data parallelism of the GPT: ``dt.replicate`` with gradient buckets against one all-reduce
per parameter and against DTensor-level data parallelism.

Run as ``python -m launch -n 2 -m launch.bench.ddp_buckets [--repeat N] [--out FILE]``. The
model is the GPT of :mod:`launch.examples.gpt` (``--d-model``, ``--layers``, ``--block``,
``--vocab``; each rank runs ``--batch`` sequences of its own), trained with AdamW. Sides,
taking turns step by step (the order rotated every round), each with its own model and
optimizer where the layout differs:

- ``local``: the model without data parallelism (no communication): the step's compute;
- ``ddp_<cap>mb_<path>``: ``dt.replicate(model, bucket_cap_mb=cap)`` for each cap of
  ``--caps`` (0: one all-reduce per parameter), with each asynchronous path of
  ``dtensor.parallel._replicate.ASYNC_PATH`` (``start``: ``Iallreduce`` started in the
  backward's thread, polled by later hooks; ``submit``: started and waited for on the worker
  thread); the two paths of one cap share one model;
- ``dtensor_dp``: the parameters as ``Replicate()`` DTensors and the batch a ``Shard(0)``
  DTensor: the dispatcher all-reduces each gradient (Partial -> Replicate) where backward
  produces it, blocking.

Figures (milliseconds, medians over ``--repeat`` rounds): ``step_ms``, the slowest rank's
step (zero_grad, forward, backward, optimizer step; the ranks meet at a barrier before each) and
``over_local_ms``, the median over the rounds of its difference from ``local``'s step in the
same round;
for the ddp sides ``exposed_ms``, the wait at the end of backward for the all-reduces not
finished yet, on the rank that finished backward last (the others also wait for it:
imbalance, not communication), ``allreduce_alone_ms``, the same buckets all-reduced again
right after the step with no computation beside them (the ranks start together; the slowest
rank's), and ``hidden_fraction``, the median over the rounds of 1 - exposed / alone: the
share of the all-reduce time that backward hid. Exposed and alone are taken in the same
round, so a load that comes and goes (a shared machine) meets both alike. The JSON document
goes to stdout (then the figures as a table) and, with ``--out FILE``, to a file.
"""

from __future__ import annotations

import os
import sys

# Run as a script, this file's folder is sys.path[0], where the sibling benchmark
# ``redistribute.py`` would shadow the ``redistribute`` package.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import statistics
import time
from typing import Any

from mpi4py import MPI

import dtensor as dt
from dtensor.parallel import _replicate
from launch.bench._common import Progress, bench_args, emit, environment, table, worst_rank
from launch.examples.gpt import GPT, GPTConfig, batch

PATHS = ("start", "submit")


def _dtensor_dp(model: GPT, mesh: dt.DeviceMesh) -> GPT:
    """``model`` with every parameter a ``Replicate()`` DTensor (tied ones stay tied)."""
    done: dict[int, Any] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in done:
                d = dt.distribute_tensor(p.detach(), mesh, [dt.Replicate()])
                done[id(p)] = dt.nn.Parameter(d)
            module._parameters[name] = done[id(p)]
    return model


class Side:
    """One way to run the step: a model, its optimizer, its inputs, its async path."""

    def __init__(self, name: str, model: GPT, inputs: tuple, path: str | None = None,
                 implicit: bool = False) -> None:
        self.name, self.model, self.inputs, self.path = name, model, inputs, path
        self.implicit = implicit
        self.opt = dt.optim.AdamW(model.parameters(), lr=1e-4)
        self.step_s: list[float] = []
        self.exposed_s: list[float] = []
        self.alone_s: list[float] = []

    def step(self, comm: Any) -> None:
        """One timed training step. **Collective**."""
        if self.path is not None:
            _replicate.ASYNC_PATH = self.path
        comm.Barrier()
        start = time.perf_counter()
        self.opt.zero_grad()
        if self.implicit:  # the local position ids meet Replicate parameters
            with dt.implicit_replication():
                self.model(*self.inputs).backward()
        else:
            self.model(*self.inputs).backward()
        self.opt.step()
        elapsed = time.perf_counter() - start
        self.step_s.append(worst_rank(elapsed, comm))
        if self.path is not None:
            state = self.model._replicate_state
            self.exposed_s.append(comm.allreduce(state.exposed_s, op=MPI.MIN))
            # the same all-reduces again, alone (the next pass refills every bucket)
            comm.Barrier()
            start = time.perf_counter()
            for b in state.buckets:
                state._start(b)
            for b in state.buckets:
                b.handle.wait()
            self.alone_s.append(worst_rank(time.perf_counter() - start, comm))
            state._reset()


def _ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 1)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = bench_args(
        __doc__.splitlines()[0], argv,
        d_model={"type": int, "default": 256, "help": "model width"},
        layers={"type": int, "default": 4, "help": "transformer blocks"},
        block={"type": int, "default": 64, "help": "sequence length"},
        vocab={"type": int, "default": 4096, "help": "vocabulary size"},
        batch={"type": int, "default": 8, "help": "sequences per rank"},
        caps={"default": "25,4,0", "help": "bucket caps in MiB, comma-separated"},
    )
    comm = MPI.COMM_WORLD
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.block, n_layer=args.layers,
                    n_head=max(1, args.d_model // 64), d_model=args.d_model)
    mesh = dt.init_device_mesh((comm.size,))
    idx, tgt = batch(cfg, args.batch * comm.size, seed=0)
    mine = slice(comm.rank * args.batch, (comm.rank + 1) * args.batch)
    local_in = (dt.tensor(idx[mine]), dt.tensor(tgt[mine]))

    def gpt() -> GPT:
        dt.manual_seed(0)
        return GPT(cfg)

    sides = [Side("local", gpt(), local_in)]
    caps = [float(c) for c in args.caps.split(",")]
    for cap in caps:
        model = dt.replicate(gpt(), mesh, bucket_cap_mb=cap)
        for path in PATHS:
            sides.append(Side(f"ddp_{cap:g}mb_{path}", model, local_in, path))
        sides[-1].opt = sides[-2].opt  # one model, one optimizer
    shape = (args.batch * comm.size, cfg.block_size)
    dp_in = tuple(dt.DTensor.from_local(t, mesh, [dt.Shard(0)], shape=shape)
                  for t in local_in)
    sides.append(Side("dtensor_dp", _dtensor_dp(gpt(), mesh), dp_in, implicit=True))

    for side in sides:  # warm up: caches, the allocator, first-use communicators
        side.step(comm)
        side.step_s.clear()
        side.exposed_s.clear()
        side.alone_s.clear()
    progress = Progress("ddp_buckets", args.repeat, enabled=comm.rank == 0 and not args.quiet)
    for r in range(args.repeat):
        k = r % len(sides)
        for side in sides[k:] + sides[:k]:
            side.step(comm)
        progress(f"round of {len(sides)} sides")

    local = sides[0].step_s
    results: dict[str, Any] = {}
    for side in sides:
        paired = [s - base for s, base in zip(side.step_s, local)]
        entry: dict[str, Any] = {"step_ms": _ms(side.step_s), "over_local_ms": _ms(paired)}
        if side.path is not None:
            alone, exposed = _ms(side.alone_s), _ms(side.exposed_s)
            hidden = [1.0 - e / a for e, a in zip(side.exposed_s, side.alone_s)]
            entry.update(
                buckets=len(side.model._replicate_state.buckets), exposed_ms=exposed,
                allreduce_alone_ms=alone,
                hidden_fraction=round(max(0.0, statistics.median(hidden)), 2),
            )
        results[side.name] = entry
    n_bytes = sum(p.numel() * p.element_size() for p in sides[0].model.parameters())
    result = {
        "benchmark": "ddp_buckets",
        "ranks": comm.size,
        "model": {"d_model": cfg.d_model, "n_layer": cfg.n_layer, "n_head": cfg.n_head,
                  "block_size": cfg.block_size, "vocab_size": cfg.vocab_size,
                  "batch_per_rank": args.batch, "param_MiB": round(n_bytes / 2**20, 2)},
        "repeat": args.repeat,
        "sides": results,
        "environment": environment(),
    }
    if comm.rank == 0:
        rows = [(name, e["step_ms"], e["over_local_ms"], e.get("buckets"), e.get("exposed_ms"),
                 e.get("allreduce_alone_ms"), e.get("hidden_fraction"))
                for name, e in results.items()]
        report = table(("side", "step ms", "+local ms", "buckets", "exposed ms", "alone ms",
                        "hidden"), rows,
                       title=f"GPT d_model {cfg.d_model}, {cfg.n_layer} layers, {comm.size} ranks "
                             "(medians)")
        emit(result, args.out, report)
    return result


if __name__ == "__main__":
    main()
