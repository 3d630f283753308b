"""Sweep sharding strategies of a model: ``python -m launch -n 4 launch/experiments/strategy_sweep.py``.

Runs the MLP block (``--model mlp``) or the self-attention block (``--model attention``)
under the standard layouts (replicated, data-parallel, tensor-parallel, and on 4 ranks the
2-D dp x tp layout on a 2x2 mesh), or under every legal combination (``--all``, capped by
``--limit``), and prints per strategy the slowest rank's median forward time, the cost
model's prediction of its collectives, collectives by kind, bytes, peak memory and the error
against numpy. ``--out FILE`` writes the JSON, ``--png FILE`` a chart (needs matplotlib).
Sizes: ``--size tiny|small|medium``.

``--train`` measures training steps instead (forward + backward + ``clip_grad_norm_`` and
an optimizer step) of the MLP (``--model mlp``) or the transformer block (``--model
transformer``) of the training examples, under ``local``, ``dp``, ``tp`` and, on an even
number of ranks from 4, ``2d``: per strategy the step time and the time of each phase,
collectives and bytes per phase, the cost model's prediction of the forward's and the
backward's collectives, peak memory and the first loss against the local run.

``--train --auto`` sets predictions against measurements: :func:`dtensor.auto_shard`
searches the model's placements on a 1-D mesh of all ranks (``--mesh 2,2`` for another
shape), then the chosen plan, the named layouts and assignments spread over the search's
table (``--count`` in all) are each predicted and measured; it prints the table, the
Spearman rank correlation, the chosen plan against the best measured one and a plan
searched under a memory budget with its measured peak. ``--png`` draws predicted against
measured; ``--calibration FILE`` reads the kernel and collective constants
(``launch/bench/calibrate.py``; default: the stored calibration of this many ranks, if
any) and installs its cost model for the dispatcher. With ``--fit`` the search first fits
the compute scale and the fixed costs per op and per collective to the step measured in up
to four layouts; those layouts are measured again in the sweep, and the Spearman
correlation is also printed without them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mpi4py import MPI

import dtensor as dt
from launch.examples._training import OPTIMIZERS, mlp_model, transformer_model
from launch.experiments._sweep import (
    all_strategies,
    attention_block,
    format_auto_table,
    format_table,
    format_train_table,
    mlp_block,
    run_auto_sweep,
    run_sweep,
    run_train_sweep,
    save_png,
    save_prediction_png,
    standard_strategies,
)

SIZES = {"tiny": (8, 16, 32), "small": (64, 128, 512), "medium": (256, 512, 2048)}
# --train --model transformer: batch, seq, dim, heads, vocab
TRANSFORMER_SIZES = {"tiny": (2, 4, 16, 2, 32), "small": (4, 16, 64, 4, 256),
                     "medium": (8, 64, 128, 8, 1024)}


def auto(args: argparse.Namespace, model) -> int:
    """The ``--train --auto`` sweep; report on rank 0. **Collective**."""
    comm = MPI.COMM_WORLD
    cal = dt.autoshard.load_calibration(args.calibration, ranks=comm.size)
    if cal is not None:
        cal.install()
    shape = tuple(int(s) for s in args.mesh.split(",")) if args.mesh else (comm.size,)
    mesh = dt.init_device_mesh(shape)
    doc = run_auto_sweep(model, mesh, optimizer=args.optimizer, clip=args.clip,
                         repeat=args.repeat, count=args.count, calibration=cal,
                         solver=args.solver, fit_step=args.fit)
    if comm.rank == 0:
        sizes = ", ".join(f"{n} {s}" for n, s in model.shapes.items())
        print(f"predicted against measured: {model.name} training step on mesh {shape}, "
              f"{args.optimizer}, clip_grad_norm_ {args.clip} ({sizes}); calibration: "
              f"{'stored' if cal is not None else 'built-in constants'}")
        print(format_auto_table(doc))
        if args.out:
            Path(args.out).write_text(json.dumps({"mode": "auto", **doc}, indent=2))
        if args.png and not save_prediction_png([doc], args.png):
            print("--png: matplotlib is not installed; no chart written")
    return 0


def train(args: argparse.Namespace) -> int:
    """The ``--train`` sweep; report on rank 0. **Collective**."""
    comm = MPI.COMM_WORLD
    if args.model == "transformer":
        model = transformer_model(*TRANSFORMER_SIZES[args.size])
    else:
        model = mlp_model(*SIZES[args.size])
    if args.auto:
        return auto(args, model)
    strategies = ["local", "dp", "tp"]
    if comm.size >= 4 and comm.size % 2 == 0:
        strategies.append("2d")
    results = run_train_sweep(model, strategies, optimizer=args.optimizer, clip=args.clip,
                              repeat=args.repeat)
    if comm.rank == 0:
        sizes = ", ".join(f"{n} {s}" for n, s in model.shapes.items())
        print(f"training step of {model.name} on {comm.size} ranks, {args.optimizer}, "
              f"clip_grad_norm_ {args.clip} ({sizes})")
        print(format_train_table(results))
        if args.out:
            doc = {"mode": "train", "model": model.name, "ranks": comm.size,
                   "optimizer": args.optimizer, "shapes": model.shapes, "results": results}
            Path(args.out).write_text(json.dumps(doc, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the sweep and report on rank 0. **Collective**."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("mlp", "attention", "transformer"), default="mlp",
                   help="attention: forward only; transformer: --train only")
    p.add_argument("--size", choices=tuple(SIZES), default="small")
    p.add_argument("--all", action="store_true", help="every legal R/S(d) combination")
    p.add_argument("--limit", type=int, default=64, help="most combinations with --all")
    p.add_argument("--repeat", type=int, default=5, help="timing samples per strategy")
    p.add_argument("--out", help="write the results as JSON to this file")
    p.add_argument("--png", help="draw a chart into this PNG file (needs matplotlib)")
    p.add_argument("--train", action="store_true",
                   help="measure training steps (forward + backward + optimizer)")
    p.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="sgd",
                   help="with --train")
    p.add_argument("--clip", type=float, default=1.0, help="with --train: clip_grad_norm_")
    p.add_argument("--auto", action="store_true",
                   help="with --train: auto_shard, predicted against measured")
    p.add_argument("--count", type=int, default=14, help="with --auto: strategies measured")
    p.add_argument("--mesh", help="with --auto: mesh shape, e.g. 2,2 (default: 1-D)")
    p.add_argument("--calibration", help="with --auto: calibration JSON to use")
    p.add_argument("--fit", action="store_true",
                   help="with --auto: auto_shard(fit_step=True), the calibration fitted to "
                        "the step")
    p.add_argument("--solver", choices=("auto", "milp", "bnb"), default="auto",
                   help="with --auto: auto_shard's solver")
    args = p.parse_args(argv)
    if args.train and args.model == "attention":
        p.error("--model attention is forward only (no --train)")
    if not args.train and args.model == "transformer":
        p.error("--model transformer needs --train")
    if args.train:
        return train(args)
    comm = MPI.COMM_WORLD
    shape = (2, 2) if comm.size == 4 else (comm.size,)
    mesh = dt.init_device_mesh(shape)
    batch, dim, hidden = SIZES[args.size]
    model = mlp_block(batch, dim, hidden) if args.model == "mlp" else attention_block(batch, dim)
    strategies = (
        all_strategies(model, mesh.ndim, args.limit)
        if args.all
        else standard_strategies(model, mesh.ndim)
    )
    results = run_sweep(model, strategies, mesh, repeat=args.repeat)
    if comm.rank == 0:
        sizes = ", ".join(f"{n} {s}" for n, s in model.shapes.items())
        print(f"{model.name} on mesh {mesh.shape} ({sizes})")
        print(format_table(results))
        if args.out:
            doc = {
                "model": model.name,
                "mesh": list(mesh.shape),
                "shapes": model.shapes,
                "results": results,
            }
            Path(args.out).write_text(json.dumps(doc, indent=2))
        if args.png and not save_png(results, args.png):
            print("--png: matplotlib is not installed; no chart written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
