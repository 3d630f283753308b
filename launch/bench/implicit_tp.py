"""Tensor parallelism left to the dispatcher against the explicit Megatron plan, on the GPT.

Run as ``python -m launch -n 2 launch/bench/implicit_tp.py [--layers 4] [--dim 256]
[--heads 8] [--seq 128] [--vocab 256] [--batch 8] [--repeat 10] [--out FILE]``. The GPT of
``launch/examples/gpt.py`` is laid out twice on a 1-D mesh of every rank, from the same
weights:

- ``implicit``: ``dt.distribute_module`` with Megatron's placements (the q/k/v and fc
  weights ``Shard(0)``, wo and proj ``Shard(1)``, the rest replicated) and a replicated
  batch; no reduce is written anywhere, the dispatcher chooses every collective;
- ``explicit``: ``dt.parallelize_module`` with the Megatron plan of ``tp_plan()``
  (ColwiseParallel / RowwiseParallel: the row-parallel outputs all-reduced by the style).

One step is forward, backward and ``zero_grad``; the two layouts take turns step by step.
Figures per layout: the median step time of the slowest rank, and the collectives and
bytes of one step (CommDebugMode, rank 0), next to Megatron's count (two all-reduces of
the ``(batch, seq, dim)`` activation per block forward, two backward). The losses of the
two layouts must agree (checked).

Output: JSON on stdout (``--out FILE`` too) and a table, from rank 0.
"""

from __future__ import annotations

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
from launch.bench._common import Progress, bench_args, emit, environment, table
from launch.examples.gpt import GPT, GPTConfig, batch, tp_plan

COLWISE = ("wq", "wk", "wv", "fc")
ROWWISE = ("wo", "proj")


def megatron_partition(name: str, module: object, mesh: object) -> None:
    """``distribute_module``'s partition_fn: Megatron's placements of the blocks' linears
    (column-parallel weight and bias ``Shard(0)``, row-parallel weight ``Shard(1)``).
    **Collective** (it scatters)."""
    leaf = name.rsplit(".", 1)[-1]
    for pname, p in list(module.named_parameters(recurse=False)):
        if leaf in COLWISE:
            pl = [dt.Shard(0)]
        elif leaf in ROWWISE and pname == "weight":
            pl = [dt.Shard(1)]
        else:
            continue
        module.register_parameter(
            pname, dt.nn.Parameter(dt.distribute_tensor(p.detach(), mesh, pl)))


def _layouts(cfg: GPTConfig, mesh: object, idx, tgt) -> dict:
    """name -> (model, inputs) for both layouts, from the same initial weights."""
    dt.manual_seed(0)
    implicit = dt.distribute_module(GPT(cfg), mesh, megatron_partition)
    rep = [dt.Replicate()]
    imp_in = (dt.distribute_tensor(dt.tensor(idx), mesh, rep),
              dt.distribute_tensor(dt.tensor(tgt), mesh, rep))
    dt.manual_seed(0)
    explicit = dt.parallelize_module(GPT(cfg), mesh, tp_plan())
    return {"implicit": (implicit, imp_in), "explicit": (explicit, (dt.tensor(idx),
                                                                    dt.tensor(tgt)))}


def _loss(loss: object) -> float:
    return float((loss.full_tensor() if isinstance(loss, dt.DTensor) else loss).item())


def main(argv: list[str] | None = None) -> dict:
    """Time both layouts; rank 0 prints the JSON and the table. **Collective**."""
    args = bench_args(
        __doc__.splitlines()[0], argv,
        layers={"type": int, "default": 4, "help": "transformer blocks"},
        dim={"type": int, "default": 256, "help": "model width"},
        heads={"type": int, "default": 8, "help": "attention heads"},
        seq={"type": int, "default": 128, "help": "sequence length"},
        vocab={"type": int, "default": 256, "help": "vocabulary"},
        batch={"type": int, "default": 8, "help": "sequences per step"},
        repeat=10,
    )
    world = MPI.COMM_WORLD
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers,
                    n_head=args.heads, d_model=args.dim)
    mesh = dt.init_device_mesh((world.size,))
    idx, tgt = batch(cfg, args.batch, 0)
    runs = _layouts(cfg, mesh, idx, tgt)
    comm, losses, times = {}, {}, {name: [] for name in runs}
    for name, (model, inputs) in runs.items():  # one untimed step each: caches, counts
        with dt.debug.CommDebugMode() as mode:
            loss = model(*inputs)
            loss.backward()
        model.zero_grad()
        losses[name] = _loss(loss)
        comm[name] = {"counts": mode.get_comm_counts(), "bytes": mode.get_total_bytes()}
    progress = Progress("implicit_tp", args.repeat, enabled=world.rank == 0 and not args.quiet)
    for _ in range(args.repeat):
        for name, (model, inputs) in runs.items():
            world.Barrier()
            start = time.perf_counter()
            loss = model(*inputs)
            loss.backward()
            model.zero_grad()
            times[name].append(time.perf_counter() - start)
        progress("one step of each layout")
    act = args.batch * args.seq * args.dim * 4
    result = {
        "benchmark": "implicit_tp",
        "ranks": world.size,
        "config": {"layers": args.layers, "dim": args.dim, "heads": args.heads,
                   "seq": args.seq, "vocab": args.vocab, "batch": args.batch},
        "megatron": {"all_reduce": 4 * args.layers if world.size > 1 else 0,
                     "bytes": 4 * args.layers * act if world.size > 1 else 0},
        "layouts": {},
        "env": environment(),
    }
    for name in runs:
        med = statistics.median(times[name])
        worst = world.allreduce(med, op=MPI.MAX)
        result["layouts"][name] = {"step_ms": worst * 1e3, "collectives": comm[name]["counts"],
                                   "bytes": comm[name]["bytes"], "loss": losses[name]}
    rel = abs(losses["implicit"] - losses["explicit"]) / abs(losses["explicit"])
    result["loss_rel_diff"] = rel
    if rel > 1e-4:
        raise SystemExit(f"implicit_tp: the layouts' losses differ: {losses}")
    if world.rank == 0:
        rows = [(name, r["step_ms"], sum(r["collectives"].values()), r["bytes"] / 1e6)
                for name, r in result["layouts"].items()]
        m = result["megatron"]
        rows.append(("megatron", None, m["all_reduce"], m["bytes"] / 1e6))
        emit(result, args.out, table(("layout", "step ms", "collectives", "MB per step"), rows,
                                     title=f"GPT tensor parallelism at {world.size} ranks"))
    return result


if __name__ == "__main__":
    main()
