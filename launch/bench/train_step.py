"""One training step of the tensor-parallel MLP: dtensor against PyTorch DTensor.

Run as ``python -m launch -n 2 launch/bench/train_step.py``. The model is the MLP of the
training examples (:func:`launch.examples._training.mlp_model`: ``relu(x @ w1 + b1) @ w2 +
b2``, mean squared error) with ``dim = hidden = N`` for each ``N`` of ``--sizes`` and a
batch of ``--batch`` rows, laid out tensor-parallel on a 1-D mesh of all ranks (``w1``/``b1``
column-, ``w2`` row-sharded, the batch replicated) and trained with SGD (momentum 0.9). The
same model runs on PyTorch's DTensor over a gloo group in the same job, from the same
initial values; the samples of both are taken in turns. Per size, worst-rank medians in
microseconds:

- ``ours_step_us`` / ``torch_step_us``: one step (zero_grad, forward, backward, optimizer
  step) and their ratio ``speedup`` (target: at least 3);
- ``ours_forward_us`` / ``torch_forward_us``: the forward under ``no_grad``;
- ``ours_forward_grad_us``: the forward that records the graph;
- the first step's losses of both (they agree).

``small_ops``: the small-op cases of :mod:`launch.bench.small_ops` (8x8 float32, no tensor
requiring grad) timed before autograd becomes active in this process and again after the
training steps: the no-grad path must not get slower. Output: JSON (``--out`` too), then
the tables; a progress line per size on stderr (``--quiet`` silences them).
"""

from __future__ import annotations

import os
import sys

# Run as a script, this file's folder is sys.path[0], where the sibling benchmark
# ``redistribute.py`` would shadow the ``redistribute`` package.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import statistics
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from mpi4py import MPI

import dtensor as dt
from launch.bench._common import (
    Progress,
    agreed_number,
    bench_args,
    emit,
    environment,
    per_call_us,
    ratio,
    table,
    torch_process_group,
    worst_rank,
)
from launch.bench.small_ops import _cases as small_op_cases
from launch.examples._training import TrainModel, make_optimizer, mlp_model, place

TARGET_SPEEDUP = 3.0
LR = 0.05


def _ours(model: TrainModel, mesh: dt.DeviceMesh) -> dict[str, Callable[[], Any]]:
    """The step, the no-grad forward and the recording forward on DTensors."""
    params = place(model, "tp", mesh, model.init())
    batch = place(model, "tp", mesh, model.batch(0), batch=True)
    opt = make_optimizer("sgd", list(params.values()), LR)
    fns = _step_and_forward(model, params, batch, opt, dt.no_grad)
    return {**fns, "forward_grad": lambda: model.loss(params, batch)}


def _step_and_forward(model: TrainModel, params: dict, batch: dict, opt: Any,
                      no_grad: Callable[[], Any]) -> dict[str, Callable[[], Any]]:
    """One training step (zero_grad, loss, backward, optimizer step) and the forward
    under ``no_grad``, written once for both libraries."""

    def step() -> Any:
        opt.zero_grad()
        loss = model.loss(params, batch)
        loss.backward()
        opt.step()
        return loss

    def forward() -> Any:
        with no_grad():
            return model.loss(params, batch)

    return {"step": step, "forward": forward}


def _torch(model: TrainModel, tmesh: Any) -> dict[str, Callable[[], Any]]:
    """The same step and no-grad forward on PyTorch DTensors (the model's loss is written
    with methods both libraries have)."""
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    def placement(p: dt.Placement) -> Any:
        return Shard(p.dim) if isinstance(p, dt.Shard) else Replicate()

    def dist(a: np.ndarray, pl: list) -> Any:
        return distribute_tensor(torch.from_numpy(a.copy()), tmesh, pl, src_data_rank=None)

    params = {n: torch.nn.Parameter(dist(a, [placement(model.tp[n])]))
              for n, a in model.init().items()}
    batch = {n: dist(a, [Replicate()]) for n, a in model.batch(0).items()}
    opt = torch.optim.SGD(list(params.values()), lr=LR, momentum=0.9)
    return _step_and_forward(model, params, batch, opt, torch.no_grad)


def _interleaved(fns: Mapping[str, Callable[[], Any]], comm: MPI.Comm,
                 budget_s: float) -> dict[str, float]:
    """Worst-rank median microseconds per call of each of ``fns``, their samples taken in
    turns (one sample of each per round), so that a change of the machine's load falls on
    all alike. The calls per sample are agreed across ranks per function; the rounds are
    what fits in ``budget_s`` per function (3 to 15). **Collective**."""
    plan = {}
    for name, fn in fns.items():
        fn()
        comm.Barrier()
        plan[name] = agreed_number(fn, comm, 0.002)
    rounds = min(max(int(budget_s / max(s for _, s in plan.values())), 3), 15)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            comm.Barrier()
            samples[name] += per_call_us(fn, repeat=1, number=plan[name][0], warmup=0)
    return {name: round(worst_rank(statistics.median(v), comm), 2)
            for name, v in samples.items()}


def _small_ops(mesh: dt.DeviceMesh, repeat: int, comm: MPI.Comm) -> dict[str, tuple]:
    """Worst-rank (median, fastest sample) microseconds of every small-op case (no tensor
    requires grad)."""
    out = {}
    for name, case in small_op_cases(mesh, []).items():
        comm.Barrier()
        samples = per_call_us(case["dt"], repeat=repeat)
        out[name] = (round(worst_rank(statistics.median(samples), comm), 3),
                     round(worst_rank(min(samples), comm), 3))
    return out


def _loss(value: Any) -> float:
    return float(value.full_tensor().item())


def run(args: Any) -> dict[str, Any]:
    comm = MPI.COMM_WORLD
    mesh = dt.init_device_mesh((comm.size,))
    before = _small_ops(mesh, args.repeat, comm)  # autograd not active yet
    teardown = None if args.no_torch else torch_process_group(comm)
    tmesh = None
    if teardown is not None:
        from torch.distributed.device_mesh import init_device_mesh

        tmesh = init_device_mesh("cpu", (comm.size,))
    results = []
    progress = Progress("train_step", len(args.sizes),
                        enabled=comm.rank == 0 and not args.quiet)
    for n in args.sizes:
        model = mlp_model(args.batch, n, n)
        ours = _ours(model, mesh)
        row: dict[str, Any] = {"n": n, "batch": args.batch,
                               "loss_ours": _loss(ours["step"]())}
        theirs = _torch(model, tmesh) if tmesh is not None else None
        if theirs is not None:
            row["loss_torch"] = _loss(theirs["step"]())
        fns = {f"ours_{k}_us": f for k, f in ours.items()}
        if theirs is not None:
            fns.update({f"torch_{k}_us": f for k, f in theirs.items()})
        row.update(_interleaved(fns, comm, args.budget))
        if theirs is not None:
            row["speedup"] = ratio(row["torch_step_us"], row["ours_step_us"])
            row["forward_speedup"] = ratio(row["torch_forward_us"], row["ours_forward_us"])
        results.append(row)
        progress(f"N {n}: ours {row['ours_step_us']:.0f} us per step")
    after = _small_ops(mesh, args.repeat, comm)
    if teardown is not None:
        teardown()
    small = {name: {"before_us": before[name][0], "after_us": after[name][0],
                    "before_min_us": before[name][1], "after_min_us": after[name][1],
                    "after_over_before": ratio(after[name][0], before[name][0]),
                    "min_after_over_before": ratio(after[name][1], before[name][1])}
             for name in before}
    speedups = [r["speedup"] for r in results if "speedup" in r]
    return {
        "benchmark": "train_step",
        "model": "mlp, tensor parallel (w1/b1 Shard(1)/Shard(0), w2 Shard(0)), SGD momentum",
        "ranks": comm.size,
        "fastpath": dt.debug.fastpath_status()["active"],
        "torch": tmesh is not None,
        "units": "microseconds per call, median over samples, worst rank",
        "environment": environment(),
        "target_speedup": TARGET_SPEEDUP,
        "speedup_met": bool(speedups) and min(speedups) >= TARGET_SPEEDUP,
        "results": results,
        "small_ops": small,
    }


def report(doc: Mapping[str, Any]) -> str:
    """The figures as markdown tables. **Local**."""

    def get(r: Mapping[str, Any], k: str) -> str:
        return "-" if k not in r else f"{r[k]:.1f}"

    rows = [(str(r["n"]), get(r, "ours_step_us"), get(r, "torch_step_us"),
             str(r.get("speedup", "-")), get(r, "ours_forward_us"), get(r, "torch_forward_us"),
             get(r, "ours_forward_grad_us"),
             f"{r['loss_ours']:.6f} / " + (f"{r['loss_torch']:.6f}" if "loss_torch" in r
                                           else "-"))
            for r in doc["results"]]
    steps = table(("N", "ours step", "torch step", "speedup", "ours fwd no_grad",
                   "torch fwd no_grad", "ours fwd recording", "loss ours / torch"), rows,
                  markdown=True, align="lrrrrrrl")
    rows = [(name, f"{s['before_us']:.2f}", f"{s['after_us']:.2f}", str(s["after_over_before"]),
             f"{s['before_min_us']:.2f} / {s['after_min_us']:.2f}")
            for name, s in doc["small_ops"].items()]
    small = table(("small op (no grad)", "before autograd", "after", "after / before",
                   "fastest sample before / after"), rows, markdown=True, align="lrrrr")
    return steps + "\n\n" + small


def _sizes(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def main(argv: list[str] | None = None) -> None:
    args = bench_args(
        __doc__.splitlines()[0],
        argv,
        sizes={"type": _sizes, "default": (64, 256), "help": "dim = hidden, comma-separated"},
        batch={"type": int, "default": 8, "help": "rows of the batch"},
        budget={"type": float, "default": 1.0, "help": "seconds of samples per figure"},
        no_torch={"action": "store_true", "help": "skip the PyTorch DTensor comparison"},
    )
    doc = run(args)
    if MPI.COMM_WORLD.rank == 0:
        emit(doc, args.out, report(doc))


if __name__ == "__main__":
    main()
