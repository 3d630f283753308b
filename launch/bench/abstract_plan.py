"""Predicting a training step on an abstract mesh: the seconds to trace it, in one process.

Run as ``python -m launch.bench.abstract_plan [--repeat N] [--out FILE]`` (one process, no
``mpiexec``). For the MLP and the transformer of ``launch/examples/_training.py`` (the
examples' sizes, and a transformer of GPT-2-medium width: batch 512, seq 128, dim 1024,
16 heads, vocab 32000), laid out as the examples' ``2d`` strategy (batch over ``dp``,
Megatron over ``tp``) on ``dt.AbstractMesh`` meshes up to (64, 8) (512 ranks), it times one
training step (forward and backward, parameters and batch made metadata-only) and its
trace by ``dt.debug.explain``, and reports what they predict: collectives and their bytes
on the worst rank (``CommDebugMode``), and the per-rank peak memory
(``dt.abstract_memory_stats()``).

With ``--auto`` it also times ``dt.auto_shard`` searching each model's layout on the
(64, 8) mesh (Adam, from the ``2d`` layout; inputs searched from replicated) and reports the
plan: candidates traced, predicted step time and peak, and the placements. ``--models``
picks models (comma-separated names of :data:`MODELS`).

Output: JSON on stdout (``--out FILE`` too): per model and mesh, the median seconds of the
step and of the traced step, the collectives, their bytes and the peak bytes; then the same
as a table.
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

import dtensor as dt
from launch.bench._common import Progress, bench_args, emit, environment, table
from launch.examples import _training as T
from placements.types import placement_list

MODELS = {
    "mlp": lambda: T.mlp_model(),
    "transformer": lambda: T.transformer_model(),
    "transformer-1024": lambda: T.transformer_model(batch=512, seq=128, dim=1024, heads=16,
                                                    vocab=32000),
}
MESHES = ((2, 2), (8, 8), (64, 8))


def _inputs(model: T.TrainModel, mesh: dt.AbstractMesh) -> tuple[dict, dict]:
    """Metadata-only parameters (leaves) and batch of the ``2d`` layout on ``mesh``."""
    params = {n: dt.abstract_tensor(s, mesh, T.layout(model, "2d", n), requires_grad=True)
              for n, s in model.shapes.items()}
    batch = {n: dt.abstract_like(a, mesh, [dt.Replicate()] * 2 if n == "mask"
                                 else T.layout(model, "2d", "batch"))
             for n, a in model.batch(0).items()}
    return params, batch


def _step(model: T.TrainModel, params: dict, batch: dict) -> object:
    loss = model.loss(params, batch)
    loss.backward()
    return loss


def _figures(model: T.TrainModel, mesh: dt.AbstractMesh, repeat: int) -> dict:
    steps, traces = [], []
    for _ in range(repeat):
        params, batch = _inputs(model, mesh)
        dt.reset_abstract_peak()
        with dt.debug.CommDebugMode() as mode:
            start = time.perf_counter()
            _step(model, params, batch)
            steps.append(time.perf_counter() - start)
        peak = dt.abstract_memory_stats()["peak_bytes"]
        del params, batch
        start = time.perf_counter()
        trace = dt.debug.explain(_step, model, *_inputs(model, mesh))
        traces.append(time.perf_counter() - start)
    return {
        "step_s": round(statistics.median(steps), 4),
        "explain_s": round(statistics.median(traces), 4),
        "first_step_s": round(steps[0], 4),
        "ops_traced": len(trace.ops),
        "collectives": mode.get_total_counts(),
        "collective_bytes": mode.get_total_bytes(),
        "peak_bytes": peak,
    }


def _search(model: T.TrainModel) -> dict:
    """Time ``dt.auto_shard`` of ``model``'s training step on the abstract (64, 8) mesh."""
    mesh = dt.AbstractMesh((64, 8), ("dp", "tp"))
    params, batch = _inputs(model, mesh)
    batch = {n: dt.abstract_like(b, mesh, [dt.Replicate()] * 2) for n, b in batch.items()}
    start = time.perf_counter()
    plan = dt.auto_shard(model.loss, params, batch, mesh,
                         optimizer=lambda ps: dt.optim.Adam(ps, lr=1e-3))
    seconds = time.perf_counter() - start
    return {
        "auto_shard_s": round(seconds, 2),
        "candidates_traced": len(plan.candidates),
        "predicted_step_s": plan.predicted_time,
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "placements": {n: placement_list(p)
                       for n, p in {**plan.placements, **plan.input_placements}.items()},
    }


def report(doc: dict) -> str:
    """The figures as tables. **Local**."""
    rows = [(name, r["step_s"], r["explain_s"], r["first_step_s"], r["ops_traced"],
             r["collectives"], r["collective_bytes"], f"{r['peak_bytes'] / 2**20:.2f}")
            for name, r in doc["results"].items()]
    out = table(("model mesh", "step s", "explain s", "first step s", "ops traced",
                 "collectives", "collective bytes", "peak MiB"), rows,
                title="one training step on an abstract mesh (medians)")
    if "auto_shard" in doc:
        rows = [(name, s["auto_shard_s"], s["candidates_traced"], s["predicted_step_s"],
                 f"{s['predicted_peak_bytes'] / 2**20:.2f}")
                for name, s in doc["auto_shard"].items()]
        out += "\n\n" + table(("model mesh", "auto_shard s", "traced", "predicted step s",
                                "predicted peak MiB"), rows, title="auto_shard searches")
    return out


def main(argv: list[str] | None = None) -> None:
    """Time the traces (and with ``--auto`` the searches) and print the JSON and the tables.
    **Local**."""
    args = bench_args(
        __doc__.splitlines()[0], argv,
        auto={"action": "store_true", "help": "also time auto_shard on the (64, 8) mesh"},
        models={"default": ",".join(MODELS), "help": "comma-separated model names"},
    )
    names = args.models.split(",")
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        raise SystemExit(f"abstract_plan: unknown models {unknown}; choose from {list(MODELS)}")
    progress = Progress("abstract_plan", len(names) * (len(MESHES) + args.auto),
                        enabled=not args.quiet)
    dt.debug.clear_caches()
    results, searches = {}, {}
    for name in names:
        model = MODELS[name]()
        for shape in MESHES:
            mesh = dt.AbstractMesh(shape, ("dp", "tp"))
            key = f"{name} {shape[0]}x{shape[1]}"
            results[key] = _figures(model, mesh, args.repeat)
            progress(f"{key}: step {results[key]['step_s']} s")
        if args.auto:
            searches[f"{name} 64x8"] = _search(model)
            progress(f"{name} 64x8: auto_shard {searches[f'{name} 64x8']['auto_shard_s']} s")
    doc = {"benchmark": "abstract_plan", "environment": environment(), "results": results}
    if args.auto:
        doc["auto_shard"] = searches
    emit(doc, args.out, report(doc))


if __name__ == "__main__":
    main()
