"""Op cost against size: dtensor vs numpy vs PyTorch (local and DTensor), 8x8 to 4096x4096.

Run as ``python -m launch -n 2 launch/bench/size_sweep.py [--sizes 8,16,...] [--ops ...]
[--placements S0,R] [--quick] [--json OUT] [--png OUT]``. On a 1-D mesh of all launched
ranks, for each size N (N x N float32 global operands) and each placement of the operands
(``S0``: ``Shard(0)``; ``R``: ``Replicate()``), it times each op in four columns:

- ``ours``: the dtensor DTensor op (on the dispatch path that is active: the compiled fast
  path when built);
- ``numpy``: numpy on this rank's local arrays (the same local shapes as ours);
- ``torch_local``: PyTorch on the same local arrays, one thread;
- ``torch_dtensor``: PyTorch's DTensor on a gloo process group over the same ranks, one
  thread, same placements.

The torch columns need torch (``--no-torch`` leaves them out). Ops: ``add`` (x + y),
``mul_scalar`` (x * 2.5), ``relu``, ``gelu``, ``exp``, ``sum_dim1``, ``mean`` (full),
``amax_dim1``, ``softmax`` (dim 1), ``layer_norm`` (last dim, weight and bias),
``matmul`` (x @ w with an N x N replicated w: S(0) @ R, or R @ R), ``clone``,
``transpose_contiguous`` (x.t().contiguous()) and ``redistribute`` (S(0) -> R; on ``S0``
operands only). For ``redistribute`` the ``numpy`` column is the raw buffer-based
``Allgatherv`` of the numpy shards into a preallocated global array (the floor any
redistribute pays) and ``torch_local`` has no entry.

Every library is timed in the same run, interleaved per size (size, then placement, then
op, then library). A figure is the slowest rank's median microseconds per call: the ranks
agree on the calls per sample and the number of samples fits a time budget per figure
(``--budget``), so large sizes stay affordable. Rank 0 prints a markdown table with, per op
and size, whether ``ours <= 1.1 * best local + 1 us`` (best local: the smaller of numpy and
torch_local) and whether ``ours <= torch_dtensor``, and the count of misses of each.
``--json`` (or ``--out``) writes the results, ``--png`` a log-log chart of cost against
global bytes, one panel per op, one line per library and placement (needs matplotlib, the
``[bench]`` extra; without it the run says so). ``--quick``: sizes 8 to 1024 and a smaller
budget. A progress line per size and placement goes to stderr (``--quiet`` silences them).
"""

from __future__ import annotations

import os
import sys

# Run as a script, this file's folder is sys.path[0], where the sibling benchmark
# ``redistribute.py`` would shadow the ``redistribute`` package.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import argparse
import json
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

import dtensor as dt
from launch.bench import _common
from launch.bench._common import (
    Progress,
    environment,
    numpy_gelu,
    numpy_layer_norm,
    numpy_softmax,
    parser,
    torch_process_group,
    worst_rank_median_us,
)

OPS = (
    "add",
    "mul_scalar",
    "relu",
    "gelu",
    "exp",
    "sum_dim1",
    "mean",
    "amax_dim1",
    "softmax",
    "layer_norm",
    "matmul",
    "clone",
    "transpose_contiguous",
    "redistribute",
)
LIBS = ("ours", "numpy", "torch_local", "torch_dtensor")
SIZES = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
QUICK_SIZES = (8, 16, 32, 64, 128, 256, 512, 1024)
PLACEMENTS = ("S0", "R")
# ours passes the local check when ours <= LOCAL_FACTOR * best local + LOCAL_SLACK_US
LOCAL_FACTOR, LOCAL_SLACK_US = 1.1, 1.0
# time per figure (seconds) and the duration of one sample, default and --quick
BUDGET_S, QUICK_BUDGET_S = 0.05, 0.01
TARGET_S, QUICK_TARGET_S = 0.002, 0.001

Case = dict[str, Callable[[], Any] | None]


def _ours(mesh: dt.DeviceMesh, x: dt.DTensor, y: dt.DTensor, w: dt.DTensor,
          lw: dt.DTensor, lb: dt.DTensor) -> Case:
    n = x.shape[1]
    r = [dt.Replicate()]
    return {
        "add": lambda: x + y,
        "mul_scalar": lambda: x * 2.5,
        "relu": lambda: x.relu(),
        "gelu": lambda: dt.gelu(x),
        "exp": lambda: x.exp(),
        "sum_dim1": lambda: x.sum(dim=1),
        "mean": lambda: x.mean(),
        "amax_dim1": lambda: x.amax(dim=1),
        "softmax": lambda: x.softmax(dim=1),
        "layer_norm": lambda: dt.layer_norm(x, (n,), lw, lb),
        "matmul": lambda: x @ w,
        "clone": lambda: x.clone(),
        "transpose_contiguous": lambda: x.t().contiguous(),
        "redistribute": lambda: x.redistribute(mesh, r),
    }


def _numpy(comm: MPI.Comm, xa: np.ndarray, ya: np.ndarray, wa: np.ndarray, lwa: np.ndarray,
           lba: np.ndarray) -> Case:
    counts = comm.allgather(xa.size)
    gathered = np.empty((sum(counts) // max(xa.shape[1], 1), xa.shape[1]), xa.dtype)
    return {
        "add": lambda: xa + ya,
        "mul_scalar": lambda: xa * 2.5,
        "relu": lambda: np.maximum(xa, 0),
        "gelu": lambda: numpy_gelu(xa),
        "exp": lambda: np.exp(xa),
        "sum_dim1": lambda: xa.sum(axis=1),
        "mean": lambda: xa.mean(),
        "amax_dim1": lambda: xa.max(axis=1),
        "softmax": lambda: numpy_softmax(xa),
        "layer_norm": lambda: numpy_layer_norm(xa, lwa, lba),
        "matmul": lambda: xa @ wa,
        "clone": lambda: xa.copy(),
        "transpose_contiguous": lambda: np.ascontiguousarray(xa.T),
        "redistribute": lambda: comm.Allgatherv(xa, [gathered, counts]),
    }


def _torch(x: Any, y: Any, w: Any, lw: Any, lb: Any, redistribute: Callable | None) -> Case:
    """The cases on torch tensors or torch DTensors (the same calls serve both)."""
    import torch  # optional dependency: imported once torch_process_group found it
    import torch.nn.functional as F

    n = x.shape[1]
    return {
        "add": lambda: x + y,
        "mul_scalar": lambda: x * 2.5,
        "relu": lambda: torch.relu(x),
        "gelu": lambda: F.gelu(x),
        "exp": lambda: torch.exp(x),
        "sum_dim1": lambda: x.sum(dim=1),
        "mean": lambda: x.mean(),
        "amax_dim1": lambda: x.amax(dim=1),
        "softmax": lambda: x.softmax(dim=1),
        "layer_norm": lambda: F.layer_norm(x, (n,), lw, lb),
        "matmul": lambda: x @ w,
        "clone": lambda: x.clone(),
        "transpose_contiguous": lambda: x.t().contiguous(),
        "redistribute": redistribute,
    }


def _torch_dtensor(tmesh: Any, arrays: dict[str, np.ndarray], placement: str, n: int) -> Case:
    """The cases on PyTorch DTensors built from the same local arrays (no communication)."""
    import torch  # optional dependency: imported once torch_process_group found it
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def wrap(name: str, pl: Any) -> Any:
        a = arrays[name]
        return DTensor.from_local(torch.from_numpy(a), tmesh, [pl], run_check=False,
                                  shape=torch.Size(a.shape if pl == Replicate() else (n, n)),
                                  stride=(n, 1) if a.ndim == 2 else (1,))

    x_pl = Shard(0) if placement == "S0" else Replicate()
    x, y = wrap("x", x_pl), wrap("y", x_pl)
    w, lw, lb = (wrap(k, Replicate()) for k in ("w", "lw", "lb"))
    return _torch(x, y, w, lw, lb, lambda: x.redistribute(tmesh, [Replicate()]))


def _cases(comm: MPI.Comm, mesh: dt.DeviceMesh, tmesh: Any, placement: str, g: np.ndarray,
           h: np.ndarray, v: np.ndarray) -> dict[str, Case]:
    """Per library, the op calls on N x N operands with the given placement."""
    pl = [dt.Shard(0) if placement == "S0" else dt.Replicate()]
    r = [dt.Replicate()]
    x = dt.distribute_tensor(g, mesh, pl, src_data_rank=None)
    y = dt.distribute_tensor(h, mesh, pl, src_data_rank=None)
    w = dt.distribute_tensor(h, mesh, r, src_data_rank=None)
    lw = dt.distribute_tensor(v, mesh, r, src_data_rank=None)
    lb = dt.distribute_tensor(v[::-1].copy(), mesh, r, src_data_rank=None)
    arrays = {k: d.to_local().numpy() for k, d in
              {"x": x, "y": y, "w": w, "lw": lw, "lb": lb}.items()}
    cases = {
        "ours": _ours(mesh, x, y, w, lw, lb),
        "numpy": _numpy(comm, *arrays.values()),
    }
    if tmesh is not None:
        import torch  # optional dependency: tmesh exists only when torch imports

        cases["torch_local"] = _torch(*(torch.from_numpy(a) for a in arrays.values()), None)
        cases["torch_dtensor"] = _torch_dtensor(tmesh, arrays, placement, g.shape[0])
    return cases


def _verdicts(row: dict[str, Any]) -> None:
    """Add to ``row`` whether ours meets the local and the torch DTensor bounds."""
    local = [row[k] for k in ("numpy_us", "torch_local_us") if row.get(k) is not None]
    best = min(local)
    row["best_local_us"] = best
    row["within_local"] = row["ours_us"] <= LOCAL_FACTOR * best + LOCAL_SLACK_US
    t = row.get("torch_dtensor_us")
    row["within_torch_dtensor"] = None if t is None else row["ours_us"] <= t


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Time every (size, placement, op, library). **Collective**."""
    comm = MPI.COMM_WORLD
    mesh = dt.init_device_mesh((comm.size,))
    teardown = None if args.no_torch else torch_process_group(comm)
    tmesh = None
    if teardown is not None:
        from torch.distributed.device_mesh import init_device_mesh

        tmesh = init_device_mesh("cpu", (comm.size,))
    budget, target = (QUICK_BUDGET_S, QUICK_TARGET_S) if args.quick else (BUDGET_S, TARGET_S)
    budget = args.budget or budget
    rng = np.random.default_rng(0)
    rows = []
    progress = Progress("size_sweep", len(args.sizes) * len(args.placements),
                        enabled=comm.rank == 0 and not getattr(args, "quiet", False))
    for n in args.sizes:
        g = rng.standard_normal((n, n), dtype=np.float32)
        h = rng.standard_normal((n, n), dtype=np.float32)
        v = rng.standard_normal(n, dtype=np.float32)
        for placement in args.placements:
            cases = _cases(comm, mesh, tmesh, placement, g, h, v)
            for op in args.ops:
                if op == "redistribute" and placement != "S0":
                    continue
                row: dict[str, Any] = {"op": op, "placement": placement, "n": n,
                                       "bytes": n * n * 4}
                for lib in LIBS:
                    fn = cases[lib][op] if lib in cases else None
                    if fn is None:
                        row[f"{lib}_us"] = None
                        continue
                    us, repeat = worst_rank_median_us(fn, comm, budget_s=budget, target_s=target)
                    row[f"{lib}_us"] = round(us, 3)
                    row[f"{lib}_samples"] = repeat
                _verdicts(row)
                rows.append(row)
            progress(f"{n}x{n} {placement}: {len(args.ops)} ops")
            del cases
    if teardown is not None:
        teardown()
    return {
        "benchmark": "size_sweep",
        "ranks": comm.size,
        "mesh": [comm.size],
        "dtype": "float32",
        "units": "microseconds per call, median over samples, slowest rank",
        "sizes": list(args.sizes),
        "placements": list(args.placements),
        "ops": list(args.ops),
        "libraries": [lib for lib in LIBS if any(r[f"{lib}_us"] is not None for r in rows)],
        "quick": args.quick,
        "budget_s": budget,
        "bounds": {"local_factor": LOCAL_FACTOR, "local_slack_us": LOCAL_SLACK_US},
        "fastpath": dt.debug.fastpath_status()["path"],
        "torch": tmesh is not None,
        "environment": environment(),
        "results": rows,
        "misses": {
            "local": sum(not r["within_local"] for r in rows),
            "torch_dtensor": sum(r["within_torch_dtensor"] is False for r in rows),
        },
    }


def table(doc: dict[str, Any]) -> str:
    """The results as a markdown table, then the miss counts. **Local**."""

    def us(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    def mark(ok: bool | None) -> str:
        return "-" if ok is None else ("ok" if ok else "MISS")

    title = f"size sweep: mesh ({doc['ranks']},), float32 N x N, {doc['fastpath']} path"
    heads = ("op", "pl", "N", "ours", "numpy", "torch local", "torch DTensor",
             f"<= {LOCAL_FACTOR} x local + {LOCAL_SLACK_US:g} us", "<= torch DTensor")
    rows = [(r["op"], r["placement"], str(r["n"]), us(r["ours_us"]), us(r["numpy_us"]),
             us(r["torch_local_us"]), us(r["torch_dtensor_us"]), mark(r["within_local"]),
             mark(r["within_torch_dtensor"])) for r in doc["results"]]
    m, total = doc["misses"], len(doc["results"])
    return _common.table(heads, rows, title=f"{title}; {doc['units']}\n", markdown=True,
                         align="llrrrrrcc",
                         notes=[(f"\nmisses: {m['local']} of {total} against the best local; "
                                 f"{m['torch_dtensor']} against torch DTensor")])


def save_png(doc: dict[str, Any], path: str) -> bool:
    """Draw cost (us) against global bytes, log-log, one panel per op. **Local**.

    Returns False (draws nothing, and says so) when matplotlib is not installed.
    """

    def draw(plt: Any) -> Any:
        ops = [op for op in doc["ops"] if any(r["op"] == op for r in doc["results"])]
        cols = 4
        fig, axes = plt.subplots((len(ops) + cols - 1) // cols, cols, squeeze=False,
                                 figsize=(4 * cols, 3.2 * ((len(ops) + cols - 1) // cols)))
        styles = {"S0": "-", "R": "--"}
        colors = dict(zip(LIBS, ("C0", "C1", "C2", "C3")))
        for ax, op in zip(axes.flat, ops):
            for placement in doc["placements"]:
                rows = [r for r in doc["results"]
                        if r["op"] == op and r["placement"] == placement]
                for lib in doc["libraries"]:
                    points = [(r["bytes"], r[f"{lib}_us"]) for r in rows if r[f"{lib}_us"]]
                    if points:
                        ax.plot(*zip(*points), styles.get(placement, ":"), marker=".",
                                color=colors[lib], label=f"{lib} {placement}")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_title(op)
            ax.set_xlabel("global bytes")
            ax.set_ylabel("us per call")
        for ax in list(axes.flat)[len(ops):]:
            ax.set_visible(False)
        fig.suptitle(f"op cost against size, mesh ({doc['ranks']},), slowest rank's median "
                     "(solid: S0 operands, dashed: R)")
        fig.tight_layout(rect=(0, 0.06, 1, 1))
        fig.legend(*axes.flat[0].get_legend_handles_labels(), loc="lower center", ncol=8)
        return fig

    return _common.save_png(path, draw)


def _names(choices: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(t.strip() for t in text.split(",") if t.strip())
        bad = [t for t in names if t not in choices]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"{bad or text!r}: choose from {','.join(choices)}")
        return names

    return parse


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(t) for t in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: positive integers, comma-separated")
    return sizes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring). **Local**."""
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--sizes", type=_sizes, help="N values (default 8 to 4096; --quick: to 1024)")
    p.add_argument("--ops", type=_names(OPS), default=OPS, help=f"subset of {','.join(OPS)}")
    p.add_argument("--placements", type=_names(PLACEMENTS), default=PLACEMENTS,
                   help="operand placements: S0 (Shard(0)), R (Replicate())")
    p.add_argument("--quick", action="store_true", help="sizes 8 to 1024, smaller budget")
    p.add_argument("--budget", type=float, help="seconds of samples per figure")
    p.add_argument("--no-torch", action="store_true", help="leave out the torch columns")
    p.add_argument("--json", "--out", dest="json", help="write the results as JSON to this file")
    p.add_argument("--png", help="draw the log-log chart into this PNG file (matplotlib)")
    p.add_argument("--quiet", action="store_true", help="no progress lines (on stderr)")
    args = p.parse_args(argv)
    args.sizes = args.sizes or (QUICK_SIZES if args.quick else SIZES)
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the sweep and report on rank 0. **Collective**."""
    args = parse_args(argv)
    doc = run(args)
    if MPI.COMM_WORLD.rank == 0:
        print(table(doc), flush=True)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as handle:
                json.dump(doc, handle, indent=2)
        if args.png:
            save_png(doc, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
