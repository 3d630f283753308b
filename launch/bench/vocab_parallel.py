"""Vocab-parallel cross entropy against gathering the logits.

Run as ``python -m launch -n 2 -m launch.bench.vocab_parallel [--rows 16] [--classes 32768]
[--repeat 20] [--out FILE]``. On a 1-D mesh of every rank, float32 logits of shape
``(rows, classes)`` sharded on the class dim (``Shard(1)``) and replicated targets: one
step is ``dt.cross_entropy(x, t).backward()``. It runs twice, interleaved sample by sample:

- ``vocab_parallel``: under the default cost model, which keeps the logits sharded at these
  sizes (two all-reduces of per-sample vectors forward, two in backward's softmax);
- ``gather``: under a cost model that makes all-reduces dear (1 s each), so the dispatcher
  gathers the logits instead (the only strategy before the vocab-parallel one).

The strategies take turns in blocks of :data:`BLOCK` steps, each block after an untimed step
that fills the caches emptied at the switch of cost model. Each sample starts after a
barrier and makes its own input. Figures: median milliseconds per rank, then the worst
rank; the collectives one step issued (CommDebugMode), so the strategies are visible.

Output: JSON on stdout (``--out FILE`` too), then a table, from rank 0.
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

import numpy as np
from mpi4py import MPI

import dtensor as dt
from launch.bench._common import Progress, bench_args, emit, environment, table, worst_rank
from redistribute.cost import CostModel, default_cost_model, set_default_cost_model

#: Timed steps of one strategy in a row.
BLOCK = 5
#: A cost model under which every all-reduce costs a second: the loss gathers the logits.
DATA_DEPENDENT = CostModel(per_kind={"all_reduce": {"alpha_s": 1.0}})


def _step(x: np.ndarray, t: dt.DTensor, mesh: dt.DeviceMesh) -> tuple[float, dict]:
    xd = dt.distribute_tensor(x, mesh, [dt.Shard(1)]).requires_grad_()
    MPI.COMM_WORLD.Barrier()
    start = time.perf_counter()
    with dt.debug.CommDebugMode() as mode:
        dt.cross_entropy(xd, t).backward()
    return time.perf_counter() - start, mode.get_comm_counts()


def main(argv: list[str] | None = None) -> dict:
    """Time both strategies; rank 0 prints the JSON. **Collective**."""
    args = bench_args(
        __doc__.splitlines()[0], argv,
        rows={"type": int, "default": 16, "help": "rows (samples) of the logits"},
        classes={"type": int, "default": 32768, "help": "classes (the sharded dim)"},
    )
    world = MPI.COMM_WORLD
    mesh = dt.init_device_mesh((world.Get_size(),))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.rows, args.classes)).astype(np.float32)
    t = dt.distribute_tensor(rng.integers(0, args.classes, (args.rows,)), mesh,
                             [dt.Replicate()])
    models = {"vocab_parallel": default_cost_model(), "gather": DATA_DEPENDENT}
    samples: dict[str, list[float]] = {name: [] for name in models}
    comm: dict[str, dict] = {}
    progress = Progress("vocab_parallel", -(-args.repeat // BLOCK),
                        enabled=world.Get_rank() == 0 and not args.quiet)
    try:
        while len(samples["gather"]) < args.repeat:
            for name, model in models.items():
                set_default_cost_model(model)
                dt.clear_caches()
                _step(x, t, mesh)
                for _ in range(min(BLOCK, args.repeat - len(samples[name]))):
                    seconds, comm[name] = _step(x, t, mesh)
                    samples[name].append(seconds)
            progress(f"{len(samples['gather'])} steps of each strategy")
    finally:
        set_default_cost_model(models["vocab_parallel"])
        dt.clear_caches()
    figures = {
        name: {"median_ms": round(worst_rank(statistics.median(s) * 1e3, world), 3),
               "collectives": {str(k): v for k, v in comm[name].items()}}
        for name, s in samples.items()
    }
    doc = {"ranks": world.Get_size(), "rows": args.rows, "classes": args.classes,
           "environment": environment(), "figures": figures}
    if world.Get_rank() == 0:
        rows = [(name, f["median_ms"], ", ".join(f"{v} {k}" for k, v in
                                                  f["collectives"].items()) or "none")
                for name, f in figures.items()]
        emit(doc, args.out, table(("strategy", "median ms", "collectives per step"), rows,
                                  title=f"cross_entropy + backward of ({args.rows}, "
                                        f"{args.classes}) logits, {doc['ranks']} ranks"))
    return doc


if __name__ == "__main__":
    main()
