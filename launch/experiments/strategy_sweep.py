"""Sweep sharding strategies of a model: ``python -m launch -n 4 launch/experiments/strategy_sweep.py``.

Runs the MLP block (``--model mlp``) or the self-attention block (``--model attention``)
under the standard layouts (replicated, data-parallel, tensor-parallel and the 2-D dp x tp
layout), or under every legal combination (``--all``, capped by ``--limit``), and prints
per strategy the slowest rank's median forward time, the cost model's prediction of its
collectives, collectives by kind, bytes, peak memory and the error against numpy. The mesh
is ``--mesh`` or, by default, ``(n/2, 2)`` on an even number n >= 4 of ranks and ``(n,)``
otherwise; on a 1-D mesh the 2-D layout runs on its own ``(n/2, 2)`` mesh (``(1, 2)`` at 2
ranks, ``(n, 1)`` for odd n). Sizes: ``--size tiny|small|medium``.

``--train`` measures training steps instead (forward + backward + ``clip_grad_norm_`` and
an optimizer step) of a model family: the MLP (``--model mlp``) or the transformer block
(``--model transformer``) of the training examples, or your own model (``--model
package.module:function``, see below), under ``local``, ``dp``, ``tp`` and ``2d`` (each on
its own mesh; ``2d`` on ``(n/2, 2)``, ``(1, 2)`` at 2 ranks): per strategy the step time
and the time of each phase, collectives and bytes per phase, the family's prediction (the
cost model's price of the forward's and the backward's collectives), peak memory and the
first loss against the local run.

``--train --model gpt-tiny`` (or ``gpt-small``) sweeps the GPT of
``launch/examples/gpt.py`` under its strategies (local, dp, fsdp, tp, tp_sp; fsdp_tp and
hsdp at 4 ranks; ``launch/experiments/_gpt_family.py``) and its pipelined and
context-parallel ones (``launch/experiments/_gpt_pp.py``: ``pp{P}_m{M}``, a ``dt.pipelining``
1F1B pipeline of ``P`` stages and ``M`` micro-batches, ``pp{P}_fsdp{D}_m{M}`` beside FSDP,
``cp{C}``, ``dt.context_parallel``; ``--pp-degrees``, ``--microbatches``, ``--cp-degrees``,
default 2,4 each, where they fit the job's ranks) against the GPT predictor
(``launch/examples/gpt_predict.py``): per strategy the predicted and measured step and peak
memory, the Spearman rank correlation of the steps, and, since the GPT has no functional
form for ``auto_shard``, the predictor's choice (the smallest predicted step whose
predicted peak fits ``--memory-budget``) against the best measured step. Its predictor
prices with this machine's calibration (found or measured as for ``--auto``), its compute
scale fitted to the measured local step unless ``--no-fit``; ``--png`` draws predicted
against measured.

``--train --auto`` sets predictions against measurements: :func:`dtensor.auto_shard`
searches the model's placements on a 1-D mesh of all ranks (``--mesh 2,2`` for another
shape), then the chosen plan, the named layouts (replicated, dp, tp; 2d on a 2-D mesh) and
assignments spread over the search's table (``--count`` in all) are each predicted and
measured; it prints the table, the Spearman rank correlation, the chosen plan against the
best measured one and a plan searched under a memory budget with its measured peak.
Predictions need a calibration of this machine: ``--calibration FILE`` (default: the stored
calibration of this many ranks, :func:`dtensor.autoshard.default_path`). When there is
none, the sweep measures one first (about a second or two; stored there for the next runs)
and says so; ``--no-calibrate`` uses the built-in constants instead, with a warning (they
can rank strategies badly), ``--recalibrate`` measures again. The calibration's cost model
is the dispatcher's during the sweep. With ``--fit`` the search first fits the compute scale
and the fixed costs per op and per collective to the step measured in up to four layouts;
those layouts are measured again in the sweep, and the Spearman correlation is also printed
without them.

Every mode prints a table on rank 0 and, with ``--out FILE``, writes the JSON; ``--png FILE``
draws the mode's chart (forward: time and predicted communication per strategy; ``--train``:
the step stacked by phase beside the prediction; ``--auto``: predicted against measured),
or says that matplotlib is missing. Progress lines go to standard error (``--quiet``
silences them).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from mpi4py import MPI

import dtensor as dt
from launch.bench._common import Progress, parser
from launch.examples._training import OPTIMIZERS
from launch.experiments import _gpt_family  # noqa: F401 (registers gpt-tiny, gpt-small)
from launch.experiments._families import (
    MLP_SIZES,
    SIZES,
    USER_MODEL_CONTRACT,
    Family,
    ModelSpecError,
    family_names,
    resolve,
)
from launch.experiments._sweep import (
    all_strategies,
    attention_block,
    format_auto_table,
    format_table,
    format_train_table,
    mlp_block,
    predicted_choice,
    run_auto_sweep,
    run_sweep,
    run_train_sweep,
    save_png,
    save_prediction_png,
    save_train_png,
    save_train_prediction_png,
    standard_strategies,
    train_spearman,
)
from placements.errors import ConfigError
from redistribute.cost import default_cost_model, set_default_cost_model

#: Forward-sweep models (``--model``, without ``--train``).
FORWARD_MODELS = ("mlp", "attention")
#: The on-the-fly calibration of ``--train --auto``: N of the measured N x N tensors, and
#: samples per point (what BENCHMARKS.md's calibrations used; 1-2 s on 2-4 ranks).
CALIBRATION_SIZES = (16, 64, 160, 384)
CALIBRATION_REPEAT = 15


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(v) for v in text.split(","))
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: positive integers, comma-separated "
                                         "(e.g. 2,2)")
    return shape


def default_mesh(world: int) -> tuple[int, ...]:
    """The forward sweep's mesh: ``(n/2, 2)`` on an even n >= 4, else ``(n,)``. **Local**."""
    return (world // 2, 2) if world >= 4 and world % 2 == 0 else (world,)


def two_d_mesh(world: int) -> tuple[int, int]:
    """The mesh of the 2-D layouts: ``(n/2, 2)`` on an even n, ``(n, 1)`` on an odd one (as
    the training examples' ``2d``). **Local**."""
    return (world // 2, 2) if world % 2 == 0 else (world, 1)


def _progress(args) -> Progress:
    return Progress("strategy_sweep", enabled=MPI.COMM_WORLD.rank == 0 and not args.quiet)


def _sizes_line(shapes) -> str:
    return ", ".join(f"{n} {s}" for n, s in shapes.items())


def forward(args) -> int:
    """The forward sweep; report on rank 0. **Collective**."""
    comm = MPI.COMM_WORLD
    progress = _progress(args)
    mesh = dt.init_device_mesh(args.mesh or default_mesh(comm.size))
    batch, dim, hidden = MLP_SIZES[args.size]
    model = mlp_block(batch, dim, hidden) if args.model == "mlp" else attention_block(batch, dim)
    strategies = (
        all_strategies(model, mesh.ndim, args.limit)
        if args.all
        else standard_strategies(model, mesh.ndim)
    )
    extra = {}
    if not args.all and mesh.ndim == 1:  # the 2-D layout on its own mesh
        extra = {k: v for k, v in standard_strategies(model, 2).items() if k not in strategies}
    progress.total = len(strategies) + len(extra)
    results = run_sweep(model, strategies, mesh, repeat=args.repeat, progress=progress)
    if extra:
        mesh2 = dt.init_device_mesh(two_d_mesh(comm.size))
        results += run_sweep(model, extra, mesh2, repeat=args.repeat, progress=progress)
    if comm.rank == 0:
        print(f"{model.name} on mesh {mesh.shape} ({_sizes_line(model.shapes)})")
        print(format_table(results))
        if args.out:
            doc = {
                "model": model.name,
                "mesh": list(mesh.shape),
                "shapes": model.shapes,
                "results": results,
            }
            Path(args.out).write_text(json.dumps(doc, indent=2))
        if args.png:
            save_png(results, args.png)
    return 0


def memory_budget(args) -> int:
    """The memory budget per rank of the predictor's choice: ``--memory-budget`` MiB, else
    this node's physical memory shared by its ranks. **Collective**."""
    if args.memory_budget is not None:
        return int(args.memory_budget * 2**20)
    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    ranks = node.size
    node.Free()
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // ranks


def _oversubscribed(comm) -> str:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    ranks = node.size
    node.Free()
    if cores and ranks > cores:
        return f" (OVERSUBSCRIBED: {ranks} ranks share {cores} cores)"
    return ""


def train(args, family: Family) -> int:
    """The ``--train`` sweep; report on rank 0. **Collective**. A family with
    ``use_calibration`` gets this machine's calibration (as ``--auto`` finds or measures
    it); when every strategy has a predicted step, the predictor's choice is reported."""
    comm = MPI.COMM_WORLD
    progress = _progress(args)
    cal_info = None
    use_calibration = getattr(family, "use_calibration", None)
    if callable(use_calibration):
        try:
            cal, cal_info = calibration_for(
                args, dt.init_device_mesh((comm.size,)), progress,
                getattr(family, "calibration_sizes", CALIBRATION_SIZES),
                getattr(family, "calibration_repeat", CALIBRATION_REPEAT),
                getattr(family, "calibration_comm_sizes", None))
        except ConfigError as e:
            if comm.rank == 0:
                print(f"strategy_sweep: {e}", file=sys.stderr)
            return 2
        use_calibration(cal, fit=not args.no_fit)
    set_dimensions = getattr(family, "set_dimensions", None)
    if callable(set_dimensions):
        set_dimensions(args.pp_degrees, args.microbatches, args.cp_degrees)
    strategies = family.strategies(comm.size)
    progress.total = len(strategies)
    results = run_train_sweep(family, strategies, optimizer=args.optimizer, clip=args.clip,
                              repeat=args.repeat, progress=progress,
                              interleave=args.interleave or getattr(family, "interleave", False))
    choice = predicted_choice(results, memory_budget(args))
    crowded = _oversubscribed(comm)
    fitted = list(getattr(family, "fitted", []))
    if comm.rank == 0:
        print(f"training step of {family.name} on {comm.size} ranks{crowded}, "
              f"{args.optimizer}, clip_grad_norm_ {args.clip} ({_sizes_line(family.shapes)})")
        line = cal_info.pop("line") if cal_info else None
        if line:
            print(line)
        print(format_train_table(results, choice, fitted))
        note = family.note()
        if note:
            print(note)
        if args.out:
            doc = {"mode": "train", "model": family.name, "ranks": comm.size,
                   "oversubscribed": bool(crowded), "optimizer": args.optimizer,
                   "shapes": family.shapes, "results": results,
                   "spearman": train_spearman(results), "fitted": fitted,
                   "spearman_unfitted": train_spearman(results, fitted) if fitted else None,
                   "choice": choice, "calibration": cal_info}
            Path(args.out).write_text(json.dumps(doc, indent=2))
        if args.png:
            title = f"{family.name}: training step on {comm.size} ranks{crowded}"
            if any(r.get("predicted_step_us") is not None for r in results):
                save_train_prediction_png(results, args.png, title, choice, fitted)
            else:
                save_train_png(results, args.png, title)
    return 0


def calibration_for(args, mesh: dt.DeviceMesh, progress: Progress,
                    sizes: tuple[int, ...] = CALIBRATION_SIZES,
                    repeat: int = CALIBRATION_REPEAT,
                    comm_sizes: tuple[int, ...] | None = None,
                    ) -> tuple[dt.autoshard.Calibration | None, dict]:
    """The calibration of the ``--auto`` sweep and what the report says of it: the stored
    one (``--calibration`` or the default path of this many ranks), else (or with
    ``--recalibrate``) one measured now (N x N tensors of ``sizes``, and of ``comm_sizes`` for
    the collectives when given; ``repeat`` samples per point) and stored there, else (``--no-calibrate``) None with a warning. Rank 0 reads the
    file and every rank gets its answer. **Collective**.

    Raises
    ------
    ConfigError
        A file that is there but not a calibration (on every rank).
    """
    comm = MPI.COMM_WORLD
    path = Path(args.calibration) if args.calibration else dt.autoshard.default_path(comm.size)
    found: tuple[str, object] = ("none", None)
    if comm.rank == 0 and path.exists() and not args.recalibrate:
        try:
            found = ("stored", dt.autoshard.load_calibration(path).to_dict())
        except ConfigError as e:
            found = ("error", str(e))
    kind, data = comm.bcast(found)
    if kind == "error":
        raise ConfigError(data)
    command = (f"python -m launch -n {comm.size} launch/bench/calibrate.py"
               + (f" --mesh {','.join(map(str, mesh.shape))}" if mesh.ndim > 1 else "")
               + (f" --calibration {path}" if args.calibration else ""))
    if kind == "stored":
        cal = dt.autoshard.Calibration.from_dict(data)
        info = {"source": "stored", "path": str(path), "mesh_shape": list(cal.mesh_shape)}
        line = f"calibration: stored at {path}"
        if tuple(cal.mesh_shape) != tuple(mesh.shape):
            line += (f" (measured on mesh {tuple(cal.mesh_shape)}, this sweep runs on "
                     f"{tuple(mesh.shape)}: --recalibrate or `{command}` measures this one)")
        return cal, {**info, "line": line}
    if args.no_calibrate:
        line = (f"WARNING: no calibration of this machine for {comm.size} ranks (none at "
                f"{path}); predictions use built-in constants, which can rank strategies "
                f"badly and choose a slow plan. Make one with: {command} (or leave out "
                "--no-calibrate and the sweep measures one first)")
        return None, {"source": "built-in", "path": str(path), "line": line}
    why = "--recalibrate" if args.recalibrate else f"no calibration stored at {path}"
    progress(f"{why}: calibrating this machine on mesh {tuple(mesh.shape)} "
             "(--no-calibrate skips this)", step=False)
    start = time.perf_counter()
    cal = dt.autoshard.calibrate(mesh, path, sizes=sizes, repeat=repeat, comm_sizes=comm_sizes)
    seconds = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
    line = (f"calibration: {why}; measured now in {seconds:.1f} s on mesh {tuple(mesh.shape)} "
            f"and stored at {path}" + (f" (`{command}` measures one with more samples)"
                                       if sizes == CALIBRATION_SIZES else ""))
    return cal, {"source": "measured", "path": str(path), "seconds": round(seconds, 2),
                 "sizes": list(sizes), "comm_sizes": list(comm_sizes or sizes), "repeat": repeat,
                 "line": line}


def auto(args, family: Family) -> int:
    """The ``--train --auto`` sweep; report on rank 0. **Collective**. The calibration's
    cost model is the dispatcher's during the sweep; the previous one is restored after."""
    comm = MPI.COMM_WORLD
    progress = _progress(args)
    shape = args.mesh or (comm.size,)
    mesh = dt.init_device_mesh(shape)
    try:
        cal, cal_info = calibration_for(args, mesh, progress)
    except ConfigError as e:
        if comm.rank == 0:
            print(f"strategy_sweep: {e}", file=sys.stderr)
        return 2
    previous = default_cost_model()
    if cal is not None:
        cal.install()
        dt.clear_caches()
    try:
        doc = run_auto_sweep(family, mesh, optimizer=args.optimizer, clip=args.clip,
                             repeat=args.repeat, count=args.count, calibration=cal,
                             solver=args.solver, fit_step=args.fit, progress=progress)
    finally:
        set_default_cost_model(previous)
        dt.clear_caches()
    if comm.rank == 0:
        line = cal_info.pop("line")
        print(f"predicted against measured: {family.name} training step on mesh {shape}, "
              f"{args.optimizer}, clip_grad_norm_ {args.clip} ({_sizes_line(family.shapes)})")
        print(line)
        print(format_auto_table(doc))
        if cal_info["source"] == "built-in":
            print(line)  # again, under the table it concerns
        if args.out:
            doc = {"mode": "auto", **doc, "calibration": cal_info}
            Path(args.out).write_text(json.dumps(doc, indent=2))
        if args.png:
            save_prediction_png([doc], args.png)
    return 0


def _epilog() -> str:
    families = "\n".join(f"  {n:<12} {d}" for n, d in family_names().items())
    return (f"models of the forward sweep: {', '.join(FORWARD_MODELS)}\n"
            f"model families of --train:\n{families}\n\n{USER_MODEL_CONTRACT}")


def _ints(text: str) -> tuple[int, ...]:
    """``"2,4"`` as ``(2, 4)``; ``""`` as ``()``."""
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of ints")


def main(argv: list[str] | None = None) -> int:
    """Run the sweep and report on rank 0. **Collective**."""
    p = parser(__doc__.splitlines()[0])
    p.epilog = _epilog()
    p.add_argument("--model", default="mlp",
                   help="forward: mlp or attention; --train: a model family (mlp, "
                        "transformer) or package.module:function (see below)")
    p.add_argument("--size", choices=SIZES, default="small", help="model size")
    p.add_argument("--mesh", type=_shape, default=None,
                   help="mesh shape, e.g. 2,2 (forward sweep: default (n/2, 2) on an even "
                        "n >= 4 ranks, else (n,); --auto: default (n,))")
    p.add_argument("--all", action="store_true", help="every legal R/S(d) combination")
    p.add_argument("--limit", type=int, default=64, help="most combinations with --all")
    p.add_argument("--repeat", type=int, default=5, help="timing samples per strategy")
    p.add_argument("--out", help="write the results as JSON to this file")
    p.add_argument("--png", help="draw the mode's chart into this PNG file (needs matplotlib)")
    p.add_argument("--quiet", action="store_true", help="no progress lines (on stderr)")
    p.add_argument("--train", action="store_true",
                   help="measure training steps (forward + backward + optimizer)")
    p.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="sgd",
                   help="with --train: the optimizer")
    p.add_argument("--clip", type=float, default=1.0, help="with --train: clip_grad_norm_")
    p.add_argument("--auto", action="store_true",
                   help="with --train: auto_shard, predicted against measured")
    p.add_argument("--count", type=int, default=14, help="with --auto: strategies measured")
    p.add_argument("--calibration",
                   help="with --auto (and --train of a family that prices steps from one, "
                        "gpt-*): the calibration JSON to read (measured and written there "
                        "when absent; default: the stored one of this many ranks)")
    p.add_argument("--no-calibrate", action="store_true",
                   help="with --auto (and gpt-*): when no calibration is stored, use the "
                        "built-in constants instead of measuring one (warns)")
    p.add_argument("--recalibrate", action="store_true",
                   help="with --auto (and gpt-*): measure the calibration again and store it")
    p.add_argument("--memory-budget", type=float, default=None, metavar="MiB",
                   help="with --train of a family that predicts steps: the predictor chooses "
                        "among the strategies whose predicted peak is within this many MiB "
                        "per rank (default: the node's memory over its ranks)")
    p.add_argument("--fit", action="store_true",
                   help="with --auto: auto_shard(fit_step=True), the calibration fitted to "
                        "the step")
    p.add_argument("--interleave", action="store_true",
                   help="with --train: build every strategy first, then time their steps in "
                        "turns (a changing load slows them alike; default for gpt-*)")
    p.add_argument("--no-fit", action="store_true",
                   help="with --train of gpt-*: price every step with the calibration as it "
                        "is (by default its compute scale is fitted to the measured local "
                        "step)")
    p.add_argument("--solver", choices=("auto", "milp", "bnb"), default="auto",
                   help="with --auto: auto_shard's solver")
    p.add_argument("--pp-degrees", type=_ints, default=(2, 4), metavar="P,...",
                   help="with --train of gpt-*: pipeline degrees (pp{P}_m{M} where P is the "
                        "job's ranks, pp{P}_fsdp{D}_m{M} where P x D is; empty: none)")
    p.add_argument("--microbatches", type=_ints, default=(2, 4), metavar="M,...",
                   help="with --train of gpt-*: micro-batch counts of each pipeline (1F1B)")
    p.add_argument("--cp-degrees", type=_ints, default=(2, 4), metavar="C,...",
                   help="with --train of gpt-*: context-parallel degrees (cp{C}, ring "
                        "attention over all C ranks of the job)")
    args = p.parse_args(argv)
    world = MPI.COMM_WORLD.size
    if args.mesh is not None and (args.train and not args.auto):
        p.error("--mesh applies to the forward sweep and --auto (--train runs each "
                "strategy on its own mesh)")
    if args.mesh is not None and math.prod(args.mesh) != world:
        p.error(f"--mesh {','.join(map(str, args.mesh))} has {math.prod(args.mesh)} ranks; "
                f"this job has {world}")
    if args.auto and not args.train:
        p.error("--auto needs --train")
    if not args.train:
        if args.model not in FORWARD_MODELS:
            p.error(f"--model {args.model}: the forward sweep runs {' or '.join(FORWARD_MODELS)}"
                    "; other models need --train")
        return forward(args)
    if args.model == "attention":
        p.error("--model attention is forward only (no --train)")
    try:
        family = resolve(args.model, args.size)
    except ModelSpecError as e:
        p.error(str(e))
    return auto(args, family) if args.auto else train(args, family)


if __name__ == "__main__":
    sys.exit(main())
