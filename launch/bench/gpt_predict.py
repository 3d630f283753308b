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

Output on rank 0: JSON, then a table (MiB; errors relative to the measurement);
progress lines on stderr (``--quiet``: none).
"""

from __future__ import annotations

import os
import sys
import time

# Run as a script, this file's folder is sys.path[0], where the sibling benchmark
# ``redistribute.py`` would shadow the ``redistribute`` package.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

from mpi4py import MPI

import dtensor as dt
from launch.bench._common import Progress, bench_args, emit, environment, table
from launch.examples.gpt_predict import CONFIGS, measure, predict
from launch.examples.gpt_strategies import STRATEGIES, supported

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
    )
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
