"""Small-op latency: DTensor (compiled fast path and Python path) vs numpy vs PyTorch DTensor.

Run as ``timeout 600 mpiexec -n 2 python -m launch.bench.small_ops`` (a 1-D mesh of 2) or
``-n 4`` (a 2x2 mesh). For each op on 8x8 float32 operands it reports, in microseconds per
call (median over batched samples on each rank, then the worst rank):

- ``numpy_us``: the same computation with numpy on this rank's local arrays (with
  ``--device cuda``: on the local cupy arrays, through numpy's dispatch to cupy);
- ``fast_us``: the DTensor op served by the compiled fast path;
- ``python_us``: the same op on the Python dispatcher (``dt.debug.set_fastpath(False)``,
  measured in the same run);
- ``torch_us``: PyTorch's DTensor on a gloo process group with the same mesh and placements
  (when torch is importable; CPU only);
- the overheads ``fast_us - numpy_us`` and ``python_us - numpy_us`` and the ratios
  ``python_us / fast_us`` and ``torch_us / fast_us``;
- next to each median, the fastest sample (``*_min_us``): on a shared machine it shows the
  uncontended figure.

``--breakdown`` adds, per op, where a fast-path call spends its time: the kernel on the local
arrays, the wrap of the output (Tensor + DTensor), and the rest (argument binding, key build
and lookup), plus the Python path's bind+key+lookup (host meshes only). ``--device cuda``
builds the mesh on the GPUs and ends every timed call with a stream synchronize. Output:
JSON on stdout (``--out FILE`` too), then a table, and with ``--png FILE.png`` (or
``--plot``) a bar chart (needs matplotlib; without it the run says so).
"""

from __future__ import annotations

import os
import sys

# Run as a script, this file's folder is sys.path[0], where the sibling benchmark
# ``redistribute.py`` would shadow the ``redistribute`` package.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import statistics
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

import dtensor as dt
from dtensor.dispatch import dispatcher as _dispatch
from dtensor.local.backend import array_module
from dtensor.local.tensor import wrap_array
from launch.bench._common import (
    Progress,
    bench_args,
    emit,
    environment,
    numpy_gelu,
    numpy_softmax,
    per_call_us,
    ratio,
    save_png,
    table,
    torch_process_group,
    worst_rank,
)

SHAPE = (8, 8)
TARGETS = {"add_overhead_us": 0.5, "other_overhead_us": 1.5, "fast_vs_python": 5.0,
           "fast_vs_torch_add": 5.0}
# ops whose overhead has no target
NO_TARGET = ("to_local", "from_local")


def _local(d: dt.DTensor):
    """The local array of ``d``: numpy on the host, the device array (cupy) on a GPU mesh."""
    return d.to_local().numpy() if d.device_mesh.device_type == "cpu" else d.to_local()._arr


def _cases(mesh: dt.DeviceMesh, rest: list) -> dict[str, dict]:
    """Per op: the DTensor call, the array-module call on the local arrays (numpy on the
    host; numpy's functions dispatch to cupy on a GPU mesh), the expression."""
    rng = np.random.default_rng(0)
    g = rng.standard_normal(SHAPE).astype(np.float32)
    h = rng.standard_normal(SHAPE).astype(np.float32)
    s0, s1, r = [dt.Shard(0), *rest], [dt.Shard(1), *rest], [dt.Replicate(), *rest]
    x = dt.distribute_tensor(g, mesh, s0, src_data_rank=None)
    y = dt.distribute_tensor(h, mesh, s0, src_data_rank=None)
    w = dt.distribute_tensor(h, mesh, r, src_data_rank=None)
    x1 = dt.distribute_tensor(g, mesh, s1, src_data_rank=None)
    w0 = dt.distribute_tensor(h, mesh, s0, src_data_rank=None)
    xa, ya, wa = _local(x), _local(y), _local(w)
    x1a, w0a = _local(x1), _local(w0)
    xl = x.to_local()
    shape = x.shape
    cases = {
        "add": (lambda: x + y, lambda: xa + ya, "x + y"),
        "mul_scalar": (lambda: x * 2.5, lambda: xa * 2.5, "x * 2.5"),
        "relu": (lambda: x.relu(), lambda: np.maximum(xa, 0), "x.relu()"),
        "gelu": (lambda: dt.gelu(x), lambda: numpy_gelu(xa), "F.gelu(x)"),
        "sum": (lambda: x.sum(), lambda: xa.sum(), "x.sum()"),
        "sum_dim1": (lambda: x.sum(dim=1), lambda: xa.sum(axis=1), "x.sum(dim=1)"),
        "mean": (lambda: x.mean(), lambda: xa.mean(), "x.mean()"),
        "mm_S0_R": (lambda: x @ w, lambda: xa @ wa, "x @ w"),
        "mm_S1_S0_partial": (lambda: x1 @ w0, lambda: x1a @ w0a, "x1 @ w0"),
        "view": (lambda: x.view(-1), lambda: xa.reshape(-1), "x.view(-1)"),
        "t": (lambda: x.t(), lambda: xa.T, "x.t()"),
        "reshape": (lambda: x.reshape(2, 32), lambda: xa.reshape(-1, 32), "x.reshape(2, 32)"),
        "softmax": (lambda: x.softmax(dim=-1), lambda: numpy_softmax(xa), "x.softmax(-1)"),
        "getitem_slice": (lambda: x[:, 2:6], lambda: xa[:, 2:6], "x[:, 2:6]"),
        "to_local": (lambda: x.to_local(), lambda: xa, "x.to_local()"),
        "from_local": (
            lambda: dt.DTensor.from_local(xl, mesh, s0, shape=shape),
            lambda: xa,
            "DTensor.from_local(xl, mesh, [S(0)], shape=...)",
        ),
    }
    return {k: {"dt": d, "np": n, "expr": e} for k, (d, n, e) in cases.items()}


def _torch_cases(comm: MPI.Comm, mesh_shape: tuple[int, ...]) -> dict[str, Callable] | None:
    """PyTorch DTensor twins of the cases on a gloo group (None when torch is missing)."""
    try:
        import torch
        import torch.nn.functional as F
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    except ImportError:
        return None
    teardown = torch_process_group(comm)
    tmesh = init_device_mesh("cpu", mesh_shape)
    rest = [Replicate()] * (len(mesh_shape) - 1)
    s0, s1, r = [Shard(0), *rest], [Shard(1), *rest], [Replicate(), *rest]
    rng = np.random.default_rng(0)
    g = torch.from_numpy(rng.standard_normal(SHAPE).astype(np.float32))
    h = torch.from_numpy(rng.standard_normal(SHAPE).astype(np.float32))
    x, y = distribute_tensor(g, tmesh, s0), distribute_tensor(h, tmesh, s0)
    w = distribute_tensor(h, tmesh, r)
    x1, w0 = distribute_tensor(g, tmesh, s1), distribute_tensor(h, tmesh, s0)
    xl = x.to_local()
    return {
        "add": lambda: x + y,
        "mul_scalar": lambda: x * 2.5,
        "relu": lambda: x.relu(),
        "gelu": lambda: F.gelu(x),
        "sum": lambda: x.sum(),
        "sum_dim1": lambda: x.sum(dim=1),
        "mean": lambda: x.mean(),
        "mm_S0_R": lambda: x @ w,
        "mm_S1_S0_partial": lambda: x1 @ w0,
        "view": lambda: x.view(-1),
        "t": lambda: x.t(),
        "reshape": lambda: x.reshape(2, 32),
        "softmax": lambda: x.softmax(dim=-1),
        "getitem_slice": lambda: x[:, 2:6],
        "to_local": lambda: x.to_local(),
        "from_local": lambda: DTensor.from_local(
            xl, tmesh, s0, shape=torch.Size(SHAPE), stride=(SHAPE[1], 1)
        ),
        "_teardown": teardown,
    }


def _time(fn: Callable, repeat: int, comm: MPI.Comm) -> float:
    """Worst-rank median microseconds per call. **Collective**."""
    return _time2(fn, repeat, comm)[0]


def _time2(fn: Callable, repeat: int, comm: MPI.Comm) -> tuple[float, float]:
    """Worst-rank (median, min) microseconds per call. **Collective**."""
    comm.Barrier()
    samples = per_call_us(fn, repeat=repeat)
    return (round(worst_rank(statistics.median(samples), comm), 3),
            round(worst_rank(min(samples), comm), 3))


def _breakdown(case: Callable, repeat: int, comm: MPI.Comm) -> dict[str, float]:
    """Kernel / wrap / dispatch split of one fast-path call (and the Python bind+lookup)."""
    out = case()
    if not isinstance(out, dt.DTensor):
        return {}
    name, info, values = _capture(case)
    if info is None:
        return {}
    entry = _dispatch.lookup(info, list(values))[0]
    if entry.direct is None:
        return {}
    locals_ = [v.to_local() if isinstance(v, dt.DTensor) else v for v in values]
    kernel = entry.kernel
    arr = out.to_local().numpy()
    spec = out.spec
    binder = _dispatch.binder_of(info)
    fast = _time(case, repeat, comm)
    k = _time(lambda: kernel(*locals_), repeat, comm)
    wrap = _time(lambda: dt.DTensor._make(wrap_array(arr), spec), repeat, comm)
    py_lookup = _time(lambda: _dispatch.lookup(info, binder.bind(values, {})), repeat, comm)
    return {
        "op": name,
        "fast_total_us": fast,
        "kernel_us": k,
        "wrap_us": wrap,
        "bind_key_lookup_us": round(max(fast - k - wrap, 0.0), 3),
        "python_bind_key_lookup_us": py_lookup,
    }


def _capture(case: Callable) -> tuple[str | None, object, tuple]:
    """The op and bound values of the one dispatch ``case`` makes (via the Python path)."""
    seen: list = []
    real = _dispatch.lookup

    def spy(info, values, *rest):
        seen.append((info, tuple(values)))
        return real(info, values, *rest)

    was_fast = dt.debug.fastpath_status()["active"]
    dt.debug.set_fastpath(False)
    _dispatch.lookup = spy
    try:
        case()
    finally:
        _dispatch.lookup = real
        dt.debug.set_fastpath(was_fast)
    if len(seen) != 1:
        return None, None, ()
    info, values = seen[0]
    return info.name, info, values


def run(args) -> dict:
    comm = MPI.COMM_WORLD
    if comm.size == 4:
        mesh_shape = (2, 2)
    else:
        mesh_shape = (comm.size,)
    mesh = dt.init_device_mesh(mesh_shape, device=args.device)
    cases = _cases(mesh, [dt.Replicate()] * (len(mesh_shape) - 1))
    if args.device != "cpu":  # every timed call ends with the device idle
        sync = array_module(args.device).cuda.get_current_stream().synchronize
        for case in cases.values():
            for k in ("dt", "np"):
                case[k] = lambda f=case[k]: (f(), sync())
    status = dt.debug.fastpath_status()
    # PyTorch's DTensor runs on gloo (host memory): compared on the CPU only
    torch_cases = None if args.no_torch or args.device != "cpu" else _torch_cases(
        comm, mesh_shape
    )
    results = {}
    progress = Progress("small_ops", len(cases), enabled=comm.rank == 0 and not args.quiet)
    for name, case in cases.items():
        row = {"expr": case["expr"]}
        row["numpy_us"], row["numpy_min_us"] = _time2(case["np"], args.repeat, comm)
        if status["available"]:
            dt.debug.set_fastpath(True)
            row["fast_us"], row["fast_min_us"] = _time2(case["dt"], args.repeat, comm)
        dt.debug.set_fastpath(False)
        row["python_us"], row["python_min_us"] = _time2(case["dt"], args.repeat, comm)
        dt.debug.set_fastpath(status["available"])
        if torch_cases is not None:
            row["torch_us"], row["torch_min_us"] = _time2(torch_cases[name], args.repeat, comm)
        best = row.get("fast_us", row["python_us"])
        row["overhead_us"] = round(best - row["numpy_us"], 3)
        row["python_overhead_us"] = round(row["python_us"] - row["numpy_us"], 3)
        row["python_over_fast"] = ratio(row["python_us"], best)
        if "torch_us" in row:
            row["torch_over_fast"] = ratio(row["torch_us"], best)
        if name not in NO_TARGET:
            limit = TARGETS["add_overhead_us" if name == "add" else "other_overhead_us"]
            row["overhead_target_us"] = limit
            row["overhead_met"] = row["overhead_us"] <= limit
        results[name] = row
        progress(f"{name}: {row.get('fast_us', row['python_us'])} us")
    doc = {
        "benchmark": "small_ops",
        "shape": list(SHAPE),
        "dtype": "float32",
        "ranks": comm.size,
        "mesh": list(mesh_shape),
        "device": args.device,
        "fastpath": status,
        "torch": torch_cases is not None,
        "units": "microseconds per call, median over samples, worst rank",
        "environment": environment(),
        "targets": TARGETS,
        "ops": results,
    }
    if args.breakdown:
        doc["breakdown"] = {
            name: _breakdown(case["dt"], args.repeat, comm)
            for name, case in cases.items() if name not in NO_TARGET
        }
    if torch_cases is not None:
        torch_cases["_teardown"]()
    return doc


def _plot(doc: dict, path: str) -> bool:
    """The bar chart of every op's figures (log scale). **Local**. False (after saying so)
    when matplotlib is not installed."""

    def draw(plt):
        names = list(doc["ops"])
        cols = [c for c in ("numpy_us", "fast_us", "python_us", "torch_us")
                if all(c in doc["ops"][n] for n in names)]
        fig, ax = plt.subplots(figsize=(14, 5))
        width = 0.8 / len(cols)
        for i, c in enumerate(cols):
            ax.bar([j + i * width for j in range(len(names))],
                   [doc["ops"][n][c] for n in names], width, label=c[:-3])
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names, rotation=45,
                      ha="right")
        ax.set_ylabel("µs per call (worst rank median)")
        ax.set_yscale("log")
        ax.set_title(f"small ops, 8x8 float32, mesh {tuple(doc['mesh'])}")
        ax.legend()
        fig.tight_layout()
        return fig

    return save_png(path, draw)


def report(doc: dict) -> str:
    """The figures as a table. **Local**."""
    ops = doc["ops"]
    cols = [c for c in ("numpy_us", "fast_us", "python_us", "torch_us")
            if any(c in r for r in ops.values())]
    rows = []
    for name, r in ops.items():
        met = r.get("overhead_met")
        rows.append((name, *(r.get(c) for c in cols), r["overhead_us"],
                     "-" if met is None else ("ok" if met else "MISS"), r["python_over_fast"],
                     *((r.get("torch_over_fast"),) if "torch_us" in cols else ())))
    head = ("op", *(c.replace("_us", " us") for c in cols), "overhead us", "target",
            "python/fast", *(("torch/fast",) if "torch_us" in cols else ()))
    missed = sum(r.get("overhead_met") is False for r in ops.values())
    return table(head, rows,
                 title=f"small ops, 8x8 float32, mesh {tuple(doc['mesh'])}, {doc['device']}; "
                       f"{doc['units']}",
                 notes=[(f"overhead (best path - numpy) targets: add "
                        f"{doc['targets']['add_overhead_us']} us, others "
                        f"{doc['targets']['other_overhead_us']} us; {missed} missed")])


def main(argv: list[str] | None = None) -> None:
    args = bench_args(
        __doc__.splitlines()[0],
        argv,
        breakdown={"action": "store_true", "help": "also split fast-path calls into parts"},
        no_torch={"action": "store_true", "help": "skip the PyTorch DTensor comparison"},
        png={"help": "write a PNG bar chart here (needs matplotlib)"},
        plot={"dest": "png", "help": "the same as --png"},
        device={"default": "cpu", "choices": ["cpu", "cuda"], "help": "mesh device"},
    )
    doc = run(args)
    if MPI.COMM_WORLD.rank == 0:
        emit(doc, args.out, report(doc))
        if args.png:
            _plot(doc, args.png)


if __name__ == "__main__":
    main()
