"""The GPT's predicted training step against the measured one, per strategy.

Run as ``python -m launch -n 2 launch/bench/gpt_predict.py [--models tiny,small]
[--batch 8] [--strategies ...] [--dtype float32|bfloat16] [--out FILE]`` (2 or 4 ranks).
For each model of :data:`launch.examples.gpt_predict.CONFIGS` named and each strategy of
:mod:`launch.examples.gpt_strategies` that runs at this number of ranks, it predicts one
training step (forward, backward, ``AdamW.step()``) with
:func:`launch.examples.gpt_predict.predict` (metadata only, on every rank alike) and
measures it with :func:`launch.examples.gpt_predict.measure`: the per-rank peak of
``dt.memory_stats()`` (the largest rank), the model state (parameters, gradients, AdamW's
moments: ``allocated_bytes`` after ``optimizer.step()``) and the collectives' bytes by
kind (``CommDebugMode``, rank 0). ``--calibration FILE`` prices the step time with a
stored calibration (``launch/bench/calibrate.py``); the measured step time is printed
beside it.

``--repredict SWEEP.json --calibration CAL.json [--compute-scale S] [--clip C]`` measures
nothing (one process is enough): it prices again the strategies of a stored training sweep
(``launch/experiments/strategy_sweep.py --train --model gpt-SIZE --out SWEEP.json``) with
the calibration, three ways: *old*, without FSDP's copies and without the slowdown of
compute beside a collective (``copy_rate`` infinite, ``overlap_slowdown`` 1); *new*, as the
sweep prices with one core per rank (copies priced in line, ``overlap=False``); *new,
beside*, FSDP's prefetch beside the compute at the calibrated slowdown (``overlap=True``).
The compute scale is fitted to the sweep's measured ``local`` step as the sweep fits it
(unless ``--compute-scale``). Beside the measured steps it prints each predictor's Spearman
correlation (also without ``local``) and its choice (the smallest predicted step among the
distributed strategies) against the best measured step.

Output on rank 0: JSON, then a table (MiB; errors relative to the measurement);
progress lines on stderr (``--quiet``: none).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import replace

# Run as a script, this file's folder is sys.path[0], where the sibling benchmark
# ``redistribute.py`` would shadow the ``redistribute`` package.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

from mpi4py import MPI

import dtensor as dt
from launch.bench._common import Progress, bench_args, emit, environment, table
from launch.examples._training import make_optimizer
from launch.examples.gpt_predict import CONFIGS, measure, predict
from launch.examples.gpt_strategies import STRATEGIES, supported
from launch.experiments._gpt_family import BATCH, LR, _mesh_shape, _predicted
from launch.experiments._sweep import spearman

MiB = 2**20


def _mesh(name: str, world: int) -> tuple[int, ...]:
    return (2, 2) if name in ("fsdp_tp", "hsdp") else (world,)


def _err(pred: float, meas: float) -> float:
    return (pred - meas) / meas if meas else 0.0


def compare(model: str, name: str, batch: int, dtype: object, calibration: object) -> dict:
    """Predicted and measured figures of one strategy. **Collective**."""
    world = MPI.COMM_WORLD.size
    cfg = CONFIGS[model]
    t0 = time.perf_counter()
    try:
        p = predict(cfg, name, _mesh(name, world), batch, dtype=dtype, calibration=calibration)
    except ValueError as e:  # sizes the strategy cannot split (the same on every rank)
        return {"model": model, "strategy": name, "ranks": world, "error": str(e)}
    predict_s = time.perf_counter() - t0
    m = measure(cfg, name, batch, dtype=dtype)
    return {
        "model": model,
        "strategy": name,
        "ranks": world,
        "predict_s": round(predict_s, 3),
        "predicted": p.to_dict(),
        "measured": m,
        "peak_error": _err(p.peak_bytes, m["peak_bytes"]),
        "state_error": _err(p.state_bytes, m["state_bytes"]),
        "comm_exact": p.comm_bytes == m["comm_bytes"] and p.comm_counts == m["comm_counts"],
        "comm_error": _err(p.comm_total_bytes, sum(m["comm_bytes"].values())),
    }


def report(doc: dict) -> str:
    """The comparison as a table (MiB per rank; errors relative to the measurement)."""
    rows, notes = [], []
    for r in doc["results"]:
        if "error" in r:
            notes.append(f"{r['model']} {r['strategy']}: n/a ({r['error']})")
            continue
        p, m = r["predicted"], r["measured"]
        rows.append((r["model"], r["strategy"], f"{p['peak_bytes'] / MiB:.3f}",
                     f"{m['peak_bytes'] / MiB:.3f}", f"{100 * r['peak_error']:+.1f}%",
                     f"{p['state_bytes'] / MiB:.3f}", f"{m['state_bytes'] / MiB:.3f}",
                     f"{100 * r['state_error']:+.1f}%", f"{p['comm_total_bytes'] / MiB:.3f}",
                     f"{sum(m['comm_bytes'].values()) / MiB:.3f}", r["comm_exact"],
                     f"{1e3 * p['time_s']:.1f}", f"{1e3 * m['step_s']:.1f}"))
    title = (f"{doc['ranks']} ranks, batch {doc['batch']}, {doc['dtype']}: predicted against "
             "measured (MiB per rank; error = (predicted - measured) / measured)")
    return table(("model", "strategy", "peak pred", "peak meas", "err", "state pred",
                  "state meas", "err", "comm pred", "comm meas", "exact", "step ms pred",
                  "step ms meas"), rows, title=title, notes=notes,
                 align="llrrrrrrrrlrr")


#: The re-prediction's three predictors (see the module docstring), in column order.
VARIANTS = ("old", "new", "new_beside")


def _repredict_one(cfg, name: str, world: int, batch: int, cal, optimizer: str, clip: float,
                   overlap: bool) -> float:
    """Predicted step seconds of one swept strategy. **Local**."""
    base, kw = _predicted(name)
    return predict(cfg, base, _mesh_shape(name, world), batch, calibration=cal,
                   optimizer=lambda params: make_optimizer(optimizer, params, LR), clip=clip,
                   overlap=overlap, **kw).time_s


def repredict(sweep: dict, calibration, compute_scale: float | None = None,
              clip: float = 1.0) -> dict:
    """The strategies of a stored training sweep of the GPT family priced again by the old
    predictor, the new one, and the new one with FSDP's prefetch beside the compute, beside
    their measured steps (see the module docstring). **Local**.

    Parameters
    ----------
    sweep : dict
        ``strategy_sweep.py --train --model gpt-SIZE --out`` JSON: ``model``, ``ranks``,
        ``optimizer`` and ``results`` (``name``, ``step_us`` each).
    calibration : Calibration
    compute_scale : float, optional
        The compute scale of all three (default: fitted to the measured ``local`` step, as
        the sweep fits it; the calibration's own when the sweep has no ``local``).
    clip : float
        The sweep's ``clip_grad_norm_`` (its ``--clip``).
    """
    model = str(sweep.get("model", ""))
    size = model.removeprefix("gpt-")
    if not model.startswith("gpt-") or size not in BATCH:
        raise ValueError(f"gpt_predict --repredict: the sweep's model is {model!r}; only the "
                         f"GPT family's are priced here ({', '.join('gpt-' + s for s in BATCH)})")
    results = sweep.get("results") or []
    if not results:
        raise ValueError("gpt_predict --repredict: the sweep has no results")
    cfg, batch, world = CONFIGS[size], BATCH[size], int(sweep["ranks"])
    optimizer = sweep.get("optimizer", "sgd")
    measured = {r["name"]: r["step_us"] / 1e6 for r in results}
    names = list(measured)

    def one(name: str, cal, overlap: bool = False) -> float:
        return _repredict_one(cfg, name, world, batch, cal, optimizer, clip, overlap)

    fitted = False
    if compute_scale is None:
        compute_scale = calibration.compute_scale
        if "local" in measured:  # fixed + scale x work = measured (the sweep's fit_step)
            fixed = one("local", replace(calibration, compute_scale=0.0))
            work = one("local", replace(calibration, compute_scale=1.0)) - fixed
            scale = (measured["local"] - fixed) / work if work > 0 else 0.0
            if scale > 0:
                compute_scale, fitted = scale, True
    new = replace(calibration, compute_scale=compute_scale)
    old = replace(new, copy_rate=math.inf, overlap_slowdown=1.0)
    cals = {"old": (old, False), "new": (new, False), "new_beside": (new, True)}
    rows = [{"strategy": n, "measured_ms": measured[n] * 1e3,
             **{f"{v}_ms": one(n, c, ov) * 1e3 for v, (c, ov) in cals.items()}}
            for n in names]
    dist = [r for r in rows if r["strategy"] != "local"]
    best = min(rows, key=lambda r: r["measured_ms"])
    predictors = {}
    for v in VARIANTS:
        key = f"{v}_ms"
        out = {"spearman": spearman([r[key] for r in rows], [r["measured_ms"] for r in rows])
               if len(rows) > 1 else None,
               "spearman_without_local": spearman([r[key] for r in dist],
                                                  [r["measured_ms"] for r in dist])
               if len(dist) > 1 and len(dist) < len(rows) else None}
        if dist:
            chosen = min(dist, key=lambda r: r[key])
            ratio = chosen["measured_ms"] / best["measured_ms"]
            out.update(chosen=chosen["strategy"], over_best=ratio, within_10pct=ratio <= 1.1)
        predictors[v] = out
    return {"benchmark": "gpt_predict", "mode": "repredict", "model": model, "ranks": world,
            "optimizer": optimizer, "clip": clip, "compute_scale": compute_scale,
            "compute_scale_fitted": fitted, "copy_rate": calibration.copy_rate,
            "overlap_slowdown": calibration.overlap_slowdown, "best": best["strategy"],
            "rows": rows, "predictors": predictors}


def repredict_report(doc: dict) -> str:
    """The re-prediction as a markdown table, each predictor's Spearman and choice below.
    **Local**."""
    fit = " (fitted to local)" if doc["compute_scale_fitted"] else ""
    notes = []
    for v in VARIANTS:
        p = doc["predictors"][v]
        rho = "-" if p["spearman"] is None else f"{p['spearman']:.2f}"
        rest = ("" if p["spearman_without_local"] is None
                else f" ({p['spearman_without_local']:.2f} without local)")
        choice = ("" if "chosen" not in p else
                  f"; choice {p['chosen']}, {p['over_best']:.3f}x the best measured "
                  f"({doc['best']}): " + ("within 10%" if p["within_10pct"] else "NOT within 10%"))
        notes.append(f"{v}: Spearman {rho}{rest}{choice}")
    rows = [(r["strategy"], f"{r['measured_ms']:.0f}", f"{r['old_ms']:.0f}",
             f"{r['new_ms']:.0f}", f"{r['new_beside_ms']:.0f}") for r in doc["rows"]]
    title = (f"{doc['model']}, {doc['ranks']} ranks: step ms, measured and re-predicted "
             f"(copy_rate {doc['copy_rate']:.3g} B/s, overlap_slowdown "
             f"{doc['overlap_slowdown']:.3g}, compute scale {doc['compute_scale']:.3g}{fit})")
    return table(("strategy", "measured ms", "old pred ms", "new pred ms", "new, beside ms"),
                 rows, title=title, notes=notes, markdown=True, align="lrrrr")


def main(argv: list[str] | None = None) -> None:
    """Predict and measure every strategy; print the JSON and the table. **Collective**."""
    args = bench_args(
        __doc__.splitlines()[0], argv,
        models={"default": "tiny,small", "help": "comma-separated names of CONFIGS"},
        batch={"type": int, "default": 8, "help": "global batch in sequences"},
        strategies={"default": ",".join(STRATEGIES), "help": "comma-separated strategies"},
        dtype={"default": "float32", "choices": ("float32", "bfloat16"),
               "help": "compute dtype (FSDP: float32 master weights and reductions)"},
        calibration={"help": "a calibration JSON file (default: built-in constants)"},
        repredict={"metavar": "SWEEP", "help": "price a stored strategy_sweep --train JSON "
                   "again (old / new / new beside predictors; needs --calibration)"},
        compute_scale={"type": float, "help": "with --repredict: the compute scale "
                       "(default: fitted to the sweep's measured local step)"},
        clip={"type": float, "default": 1.0, "help": "with --repredict: the sweep's --clip"},
    )
    if args.repredict:
        if not args.calibration:
            raise SystemExit("gpt_predict: --repredict needs --calibration CAL.json (the "
                             "calibration the sweep was priced with)")
        if MPI.COMM_WORLD.rank:
            return
        with open(args.repredict, encoding="utf-8") as handle:
            sweep = json.load(handle)
        progress = Progress("gpt_predict", 1, enabled=not args.quiet)
        doc = repredict(sweep, dt.autoshard.load_calibration(args.calibration),
                        args.compute_scale, args.clip)
        doc.update(sweep=args.repredict, calibration=args.calibration)
        progress(f"{len(doc['rows'])} strategies of {doc['model']} priced three ways")
        emit(doc, args.out, repredict_report(doc))
        return
    world = MPI.COMM_WORLD
    dtype = dt.bfloat16 if args.dtype == "bfloat16" else None
    cal = dt.autoshard.load_calibration(args.calibration) if args.calibration else None
    cases = [(model, name) for model in args.models.split(",")
             for name in args.strategies.split(",") if supported(name, world.size)]
    progress = Progress("gpt_predict", len(cases), enabled=world.rank == 0 and not args.quiet)
    rows = []
    for model, name in cases:
        rows.append(compare(model, name, args.batch, dtype, cal))
        r = rows[-1]
        progress(f"{model} {name}: " + ("n/a" if "error" in r else
                                        f"peak error {100 * r['peak_error']:+.1f}%"))
    if world.rank:
        return
    doc = {"benchmark": "gpt_predict", "ranks": world.size, "batch": args.batch,
           "dtype": args.dtype, "environment": environment(), "results": rows}
    emit(doc, args.out, report(doc))


if __name__ == "__main__":
    main()
