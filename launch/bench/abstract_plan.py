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

The GPT under every strategy: ``python -m launch.bench.abstract_plan --model gpt2-124m
--mesh 64x8`` (``--model`` one of :data:`launch.examples.gpt_predict.CONFIGS`: GPT-2 124M,
12 layers, d 768, 12 heads, seq 1024, vocab 50257; ``gpt-1.3b``, 24 layers, d 2048, 16
heads, seq 2048; the training example's ``tiny`` and ``small``) predicts one training step
(forward, backward, AdamW) of each strategy of :mod:`launch.examples.gpt_strategies` on the
mesh (``D x T``: ``D`` data-parallel groups of ``T`` ranks, e.g. 64 nodes of 8; or
``PP x DP x TP``, e.g. ``8x8x8``, for the pipelined strategies ``pp``, ``pp_dp``,
``pp_fsdp``, ``pp_tp``, ``pp_fsdp_tp`` and the context-parallel ``cp``, ``dp_cp``; see
:func:`launch.examples.gpt_predict.layout` for how each strategy uses it; a strategy the
model's sizes do not allow is listed with the reason) with
:func:`launch.examples.gpt_predict.predict`: per-rank peak memory, the collectives' bytes
per step by kind, the step time (``--calibration FILE``, default built-in constants), and
the search's choice: the fastest strategy whose predicted peak fits ``--memory-budget``
(default 80GB; ``GB`` 1e9 bytes, ``GiB`` 2**30, or bytes). ``--batch``: the global batch in
sequences (default: one per rank of the mesh); ``--dtype bfloat16`` computes in bfloat16
(FSDP: float32 master weights and reductions). A pipelined strategy is predicted for each
micro-batch count of ``--microbatches`` (default ``p, 2p, 4p, 8p`` that divide a replica's
batch) and schedule of ``--schedules`` (default ``1f1b,interleaved``, the latter with 2
stages per rank); the table shows the one chosen (the fastest that fits) and a note the
others; the columns ``P2P`` (point-to-point bytes per step) and ``bubble`` (its idle share).
Output: JSON, then a table.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

# Run as a script, this file's folder is sys.path[0], where the sibling benchmark
# ``redistribute.py`` would shadow the ``redistribute`` package.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import dtensor as dt
from launch.bench._common import Progress, bench_args, emit, environment, table
from launch.examples import _training as T
from launch.examples.gpt_predict import ALL_STRATEGIES
from launch.examples.gpt_strategies import STRATEGIES
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


_UNITS = {"kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20,
          "gib": 2**30, "tib": 2**40, "b": 1}


def parse_bytes(text: str) -> int:
    """``"80GB"`` (1e9), ``"80GiB"`` (2**30), ``"1e9"`` (bytes) as bytes. **Local**."""
    t = text.strip().lower()
    for unit in sorted(_UNITS, key=len, reverse=True):
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * _UNITS[unit])
    return int(float(t))


def parse_mesh(text: str) -> tuple[int, ...]:
    """``"64x8"`` as ``(64, 8)``, ``"8x8x8"`` as ``(8, 8, 8)``. **Local**."""
    try:
        shape = tuple(int(v) for v in text.lower().split("x"))
    except ValueError:
        shape = ()
    if not shape or len(shape) > 3 or min(shape) < 1:
        raise SystemExit(f"abstract_plan: --mesh {text!r} is not D, DxT or PPxDPxTP "
                         "(e.g. 64x8, 8x8x8)")
    return shape


def microbatch_options(p: int, per_replica: int, given: Sequence[int] | None = None
                       ) -> list[int]:
    """The micro-batch counts tried for a pipeline of ``p`` stages: ``given``, or ``p``,
    ``2p``, ``4p``, ``8p``; those that divide the ``per_replica`` sequences (at least one:
    the largest divisor of ``per_replica`` up to ``p`` when none does). **Local**."""
    cands = list(given) if given else [p, 2 * p, 4 * p, 8 * p]
    out = [m for m in cands if m >= 1 and per_replica % m == 0]
    if not out and not given:
        out = [max(d for d in range(1, min(p, per_replica) + 1) if per_replica % d == 0)]
    return out


def _pipeline_variants(name: str, cfg: Any, mesh: tuple[int, ...], batch: int,
                       microbatches: Sequence[int] | None, schedules: Sequence[str]
                       ) -> list[dict[str, Any]]:
    """The (micro-batches, schedule, stages per rank) tried for pipelined strategy
    ``name``: interleaved with 2 stages per rank where the blocks allow."""
    from launch.examples.gpt_predict import layout  # lazy: only the GPT mode needs it

    lay = layout(name, mesh)
    per = batch // lay.n_data if batch % lay.n_data == 0 else batch
    out = []
    for m in microbatch_options(lay.pp, per, microbatches):
        for s in schedules:
            v = 2 if s == "interleaved" else 1
            if v * lay.pp <= cfg.n_layer:
                out.append({"microbatches": m, "schedule": s, "stages_per_rank": v})
    return out or [{}]


def plan_gpt(model: str, mesh: tuple[int, ...], batch: int, budget: int, dtype: Any = None,
             calibration: Any = None, strategies: Sequence[str] = STRATEGIES,
             progress: Any = None, microbatches: Sequence[int] | None = None,
             schedules: Sequence[str] = ("1f1b", "interleaved")) -> dict:
    """Predict each strategy's training step of GPT ``model`` on ``mesh`` and choose the
    fastest whose predicted peak fits ``budget`` bytes per rank. **Local**.

    A pipelined strategy is predicted for each micro-batch count of
    :func:`microbatch_options` (``microbatches``, default ``p, 2p, 4p, 8p`` that divide a
    data-parallel replica's sequences) and each of ``schedules`` (interleaved: 2 stages per
    rank); its row is the fastest that fits (else the smallest peak), with the others under
    ``"variants"``.

    Returns ``{"strategies": {name: StepPrediction.to_dict() | {"error": why}},
    "choice": name or None, "seconds": ...}``.
    """
    # lazy: only this mode needs the predictor
    from launch.examples.gpt_predict import CONFIGS, PIPELINED, predict

    cfg = CONFIGS[model]
    start = time.perf_counter()
    rows: dict[str, dict] = {}
    for name in strategies:
        t0 = time.perf_counter()
        tried = []
        try:
            variants = (_pipeline_variants(name, cfg, mesh, batch, microbatches, schedules)
                        if name in PIPELINED else [{}])
            for kw in variants:
                p = predict(cfg, name, mesh, batch, dtype=dtype, calibration=calibration,
                            **kw)
                row = p.to_dict()
                row["fits"] = p.peak_bytes <= budget
                tried.append(row)
        except ValueError as e:
            rows[name] = {"error": str(e)}
            if progress is not None:
                progress(f"{name}: n/a")
            continue
        fit = [r for r in tried if r["fits"]]
        row = (min(fit, key=lambda r: r["time_s"]) if fit
               else min(tried, key=lambda r: r["peak_bytes"]))
        if name in PIPELINED:
            row["variants"] = [{k: r[k] for k in ("microbatches", "schedule", "stages_per_rank",
                                                  "time_s", "peak_bytes", "bubble_fraction",
                                                  "fits")} for r in tried]
        row["predict_s"] = round(time.perf_counter() - t0, 3)
        rows[name] = row
        if progress is not None:
            progress(f"{name}: peak {p.peak_bytes / 2**30:.2f} GiB, step {p.time_s:.3g} s")
    fitting = [n for n, r in rows.items() if r.get("fits")]
    choice = min(fitting, key=lambda n: rows[n]["time_s"]) if fitting else None
    return {"strategies": rows, "choice": choice,
            "seconds": round(time.perf_counter() - start, 2)}


def gpt_report(doc: dict) -> str:
    """The GPT's predictions as a table, and the choice. **Local**."""
    g = 2**30
    rows, notes = [], []
    for name, r in doc["strategies"].items():
        if "error" in r:
            notes.append(f"{name}: n/a ({r['error']})")
            continue
        kinds = r["comm_bytes"]
        pipe = "-"
        if r.get("pp", 1) > 1:
            v = r["stages_per_rank"]
            pipe = f"{r['pp']}x{r['microbatches']} {r['schedule']}" + (f" v{v}" if v > 1 else "")
            tried = ", ".join(f"m={t['microbatches']} {t['schedule']}: {t['time_s']:.3g} s"
                              + ("" if t["fits"] else " (does not fit)")
                              for t in r.get("variants", ()))
            notes.append(f"{name}: {r['microbatches']} micro-batches, {r['schedule']} chosen "
                         f"of {tried}; stage blocks {r['stage_layers']}")
        elif r.get("cp", 1) > 1:
            pipe = f"cp {r['cp']}"
        rows.append((name, r["ranks"], r["local_batch"], pipe, f"{r['peak_bytes'] / g:.2f}",
                     r["fits"], f"{r['state_bytes'] / g:.3f}", f"{r['activation_bytes'] / g:.2f}",
                     f"{r['comm_total_bytes'] / g:.3f}",
                     *(f"{kinds.get(k, 0) / g:.3f}" for k in (
                         "all_gather", "reduce_scatter", "all_reduce", "all_to_all", "p2p")),
                     f"{r.get('bubble_fraction', 0.0):.0%}",
                     f"{r['time_s']:.3f}", f"{r['exposed_comm_s']:.3f}"))
    notes.append(f"choice: {doc['choice'] or 'none fits'} (the fastest predicted step within "
                 f"the budget); {doc['seconds']:.1f} s for the predictions")
    title = (f"GPT {doc['model']} on a {'x'.join(map(str, doc['mesh']))} mesh, batch "
             f"{doc['batch']} sequences, {doc['dtype']}, budget "
             f"{doc['memory_budget'] / 1e9:g} GB per rank (GiB, seconds)")
    return table(("strategy", "ranks", "seq/rank", "pp/cp", "peak", "fits", "state", "act",
                  "comm", "AG", "RS", "AR", "A2A", "P2P", "bubble", "step s", "exposed s"), rows,
                 title=title, notes=notes, align="lrrlrlrrrrrrrrrrr")


def main(argv: list[str] | None = None) -> None:
    """Time the traces (and with ``--auto`` the searches) and print the JSON and the tables;
    with ``--model``, predict the GPT's strategies and choose one. **Local**."""
    args = bench_args(
        __doc__.splitlines()[0], argv,
        auto={"action": "store_true", "help": "also time auto_shard on the (64, 8) mesh"},
        models={"default": ",".join(MODELS), "help": "comma-separated model names"},
        model={"help": "a GPT of launch.examples.gpt_predict.CONFIGS (gpt2-124m, gpt-1.3b, "
                       "tiny, small): predict its strategies instead"},
        mesh={"default": "64x8", "help": "the GPT's mesh, D or DxT"},
        batch={"type": int, "help": "the GPT's global batch (default: one per rank)"},
        memory_budget={"default": "80GB", "help": "per-rank bytes (80GB, 80GiB, bytes)"},
        dtype={"default": "float32", "choices": ("float32", "bfloat16"),
               "help": "compute dtype (FSDP: float32 master weights and reductions)"},
        calibration={"help": "a calibration JSON file (default: built-in constants)"},
        strategies={"default": ",".join(ALL_STRATEGIES), "help": "the GPT's strategies"},
        microbatches={"help": "a pipeline's micro-batch counts to try, comma-separated "
                              "(default: p, 2p, 4p, 8p that divide a replica's batch)"},
        schedules={"default": "1f1b,interleaved",
                   "help": "pipeline schedules to try (gpipe, 1f1b, interleaved: 2 stages per "
                           "rank)"},
    )
    if args.model is not None:
        from launch.examples.gpt_predict import CONFIGS  # lazy: only this mode needs it

        if args.model not in CONFIGS:
            raise SystemExit(f"abstract_plan: unknown --model {args.model!r}; choose from "
                             f"{list(CONFIGS)}")
        mesh = parse_mesh(args.mesh)
        batch = args.batch or math.prod(mesh)
        budget = parse_bytes(args.memory_budget)
        cal = dt.autoshard.load_calibration(args.calibration) if args.calibration else None
        dtype = dt.bfloat16 if args.dtype == "bfloat16" else None
        strategies = args.strategies.split(",")
        progress = Progress("abstract_plan", len(strategies), enabled=not args.quiet)
        micro = ([int(v) for v in args.microbatches.split(",")] if args.microbatches
                 else None)
        doc = {"benchmark": "abstract_plan", "model": args.model, "mesh": list(mesh),
               "batch": batch, "dtype": args.dtype, "memory_budget": budget,
               **plan_gpt(args.model, mesh, batch, budget, dtype, cal, strategies, progress,
                          micro, args.schedules.split(",")),
               "environment": environment()}
        emit(doc, args.out, gpt_report(doc))
        return
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
