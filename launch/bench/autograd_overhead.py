"""Recording overhead of autograd per op at 8x8: an op on inputs that require grad against
the same op on inputs that do not.

Run as ``python -m launch -n 2 -m launch.bench.autograd_overhead [--repeat N] [--out FILE]``.
Autograd is active in the process (a leaf that requires grad exists) for every figure. For
8x8 float32 local tensors and DTensors (``Shard(0)`` on a 1-D mesh of every rank) it times
each op three ways, interleaved sample by sample:

- ``no_grad_us``: inputs that do not require grad (what every no-grad op pays);
- ``leaf_us``: inputs that are leaves requiring grad (the op records a node);
- ``intermediate_us``: inputs that are outputs of recorded ops (the node keeps what its
  formula reads, stand-ins for the rest).

``overhead_us`` is the larger of ``leaf_us`` and ``intermediate_us`` less ``no_grad_us``;
the target is ``<= 3`` µs (``overhead_met``). ``paired_overhead_us`` takes that difference
sample by sample (the three calls of a sample run back to back) before the median, so that
the drift of an op's own cost between samples (an op with a collective) cancels
(``paired_met``). Figures: medians per rank, then the worst rank.

Output: JSON on stdout (``--out FILE`` too), then a table, from rank 0.
"""

from __future__ import annotations

import os
import statistics
import sys

# Run as a script, this file's folder is sys.path[0], where the sibling benchmark
# ``redistribute.py`` would shadow the ``redistribute`` package.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import numpy as np
from mpi4py import MPI

import dtensor as dt
from launch.bench._common import (
    Progress,
    bench_args,
    emit,
    environment,
    per_call_us,
    table,
    worst_rank,
)

#: Recording overhead per op allowed over the no-grad call (µs).
TARGET_US = 3.0

OPS = {
    "add": lambda x, y: x + y,
    "mul": lambda x, y: x * y,
    "relu": lambda x, y: x.relu(),
    "sum": lambda x, y: x.sum(),
    "matmul": lambda x, y: x @ y,
    "reshape": lambda x, y: x.reshape(4, 16),
    "getitem": lambda x, y: x[:, 2:6],
    "softmax": lambda x, y: x.softmax(-1),
    # keyword arguments, as most programs pass them
    "softmax(dim=)": lambda x, y: x.softmax(dim=-1),
    "sum(dim=, keepdim=)": lambda x, y: x.sum(dim=1, keepdim=True),
}


def main(argv: list[str] | None = None) -> dict:
    """Time every op three ways; rank 0 prints the JSON. **Collective**."""
    args = bench_args(__doc__.splitlines()[0], argv)
    world = MPI.COMM_WORLD
    mesh = dt.init_device_mesh((world.Get_size(),))
    a = np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32)

    def make(kind: str, grad: bool):
        t = (dt.from_numpy(a.copy()) if kind == "local"
             else dt.distribute_tensor(a.copy(), mesh, [dt.Shard(0)]))
        return t.requires_grad_() if grad else t

    dt.from_numpy(a.copy()).requires_grad_()  # autograd active from here on
    progress = Progress("autograd_overhead", 2, enabled=world.rank == 0 and not args.quiet)
    figures = {}
    for kind in ("local", "dtensor"):
        plain = make(kind, False), make(kind, False)
        leaves = make(kind, True), make(kind, True)
        inner = leaves[0] * 1.0, leaves[1] * 1.0
        for name, op in OPS.items():
            calls = {"no_grad": (op, plain), "leaf": (op, leaves), "intermediate": (op, inner)}
            samples: dict[str, list[float]] = {k: [] for k in calls}
            for _ in range(args.repeat):
                for k, (f, (x, y)) in calls.items():
                    samples[k] += per_call_us(lambda f=f, x=x, y=y: f(x, y), repeat=1,
                                              number=300, warmup=30)
            row = {f"{k}_us": round(worst_rank(statistics.median(v), world), 3)
                   for k, v in samples.items()}
            row["overhead_us"] = round(
                max(row["leaf_us"], row["intermediate_us"]) - row["no_grad_us"], 3)
            row["overhead_met"] = row["overhead_us"] <= TARGET_US
            # the same, paired: per sample (the three calls ran back to back), then median
            paired = [max(lf, im) - ng for ng, lf, im in
                      zip(samples["no_grad"], samples["leaf"], samples["intermediate"])]
            row["paired_overhead_us"] = round(worst_rank(statistics.median(paired), world), 3)
            row["paired_met"] = row["paired_overhead_us"] <= TARGET_US
            figures[f"{kind}.{name}"] = row
        progress(f"{kind}: {len(OPS)} ops")
    doc = {
        "ranks": world.Get_size(), "environment": environment(), "target_us": TARGET_US,
        "figures": figures, "met": all(r["overhead_met"] for r in figures.values()),
        "paired_met": all(r["paired_met"] for r in figures.values()),
    }
    if world.Get_rank() == 0:
        emit(doc, args.out, report(doc))
    return doc


def report(doc: dict) -> str:
    """The figures as a table. **Local**."""
    rows = [(name, r["no_grad_us"], r["leaf_us"], r["intermediate_us"], r["overhead_us"],
             r["paired_overhead_us"], r["overhead_met"] and r["paired_met"])
            for name, r in doc["figures"].items()]
    return table(("op", "no_grad us", "leaf us", "intermediate us", "overhead us",
                  "paired us", f"<= {doc['target_us']:g} us"), rows,
                 title=f"autograd's recording overhead, 8x8 float32, {doc['ranks']} ranks",
                 notes=[(f"every op within the target: median {doc['met']}, paired "
                        f"{doc['paired_met']}")])


if __name__ == "__main__":
    main()
