"""Pipeline schedules of ``dt.pipelining`` on the GPT: measured bubble against the theory,
the zero-bubble schedule's gain and what its split backward costs, peak activation memory
per stage (1F1B against GPipe).

Run as ``python -m launch -n P -m launch.bench.pipeline [--micro 1,2,4,8] [--schedules
gpipe,1f1b,zero_bubble] [--layers-per-stage 2] [--d-model 128] [--seq 64] [--batch 16]
[--repeat 5] [--memory-only] [--timeline] [--png FILE] [--out FILE]``. The pp mesh is the whole world (P stages, one
per rank; ``interleaved`` puts two per rank). The GPT (vocab 64, 4 heads) has
``layers-per-stage x stages`` blocks split into equal-cost stages.

Per schedule and micro-batch count ``m``, each rank times ``--repeat`` steps (after one
warm-up step; a barrier before each): the step's wall time and the time its actions ran
(``schedule.timeline``). Measured bubble: ``1 - busy / step`` per rank, the median over
steps, averaged over the ranks; the theory ``(p - 1) / (m + p - 1)`` for GPipe and 1F1B,
the unit-cost simulation's for the others (``sim``). Peak activations: the peak allocated
bytes of a step above those allocated before it (``dt.memory_stats``; the gradients are
reset to None first, so they count in every schedule alike), per rank (= stage).
``--memory-only``: one step per case, no timing (for oversubscribed runs).
``--timeline``: after the table, each case's measured timeline of its last step
(``dt.debug.visualize_schedule``: one row per stage, the actions by kind and micro-batch,
the measured bubble against the theory). ``--png FILE``: the same drawn with matplotlib,
one file per case (``FILE`` itself for a single case, else ``FILE``'s stem plus
``-<schedule>-m<m>``).

Output: JSON on stdout (``--out FILE`` too), then a table.
"""

from __future__ import annotations

import io
import os
import statistics
import sys
import time
from pathlib import Path

# Run as a script, this file's folder is sys.path[0], where the sibling benchmark
# ``redistribute.py`` would shadow the ``redistribute`` package.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

from mpi4py import MPI

import dtensor as dt
from dtensor import pipelining as pp
from launch.bench._common import Progress, bench_args, emit, environment, table
from launch.examples.gpt import GPT, GPTConfig, batch

F = dt.nn.functional
CLASSES = {
    "gpipe": (pp.ScheduleGPipe, 1),
    "1f1b": (pp.Schedule1F1B, 1),
    "interleaved": (pp.ScheduleInterleaved1F1B, 2),
    "zero_bubble": (pp.ScheduleInterleavedZeroBubble, 1),
}
KIND = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved": "interleaved_1f1b",
        "zero_bubble": "zero_bubble"}


def loss_fn(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def build(name: str, m: int, args, mesh):
    """This rank's stages and schedule; the GPT config."""
    cls, per_rank = CLASSES[name]
    p, r = mesh.size(0), mesh.get_coordinate()[0]
    n = p * per_rank
    cfg = GPTConfig(vocab_size=64, block_size=args.seq, n_layer=args.layers_per_stage * n,
                    n_head=4, d_model=args.d_model)
    dt.manual_seed(0)
    mods = pp.pipeline_split(GPT(cfg), n, stages=range(r, n, p))
    stages = [pp.PipelineStage(mods[s], s, n, mesh) for s in sorted(mods)]
    sched = cls(stages[0], m, loss_fn) if per_rank == 1 and name != "zero_bubble" else cls(
        stages, m, loss_fn)
    return cfg, mods, sched


def one_step(sched, mods, cfg, args, seed: int) -> dict:
    """One timed step on this rank: wall, busy and per-kind seconds, peak bytes."""
    x, y = batch(cfg, args.batch, seed)
    for mod in mods.values():
        for q in mod.parameters():
            q.grad = None
    n = sched.num_stages
    MPI.COMM_WORLD.Barrier()
    dt.reset_peak_memory_stats()
    base = dt.memory_stats()["allocated_bytes"]
    t0 = time.perf_counter()
    sched.step(*((x,) if 0 in mods else ()), target=y if n - 1 in mods else None)
    wall = time.perf_counter() - t0
    peak = dt.memory_stats()["peak_allocated_bytes"] - base
    kinds: dict[str, float] = {}
    for e in sched.timeline:
        kinds[e.kind] = kinds.get(e.kind, 0.0) + e.busy
    return {"wall": wall, "busy": sum(kinds.values()), "kinds": kinds, "peak": peak}


def png_path(png: str, name: str, m: int, single: bool) -> str:
    """Where ``--png`` draws the case ``(name, m)``."""
    if single:
        return png
    path = Path(png)
    return str(path.with_name(f"{path.stem}-{name}-m{m}{path.suffix or '.png'}"))


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def picture(sched, name: str, m: int, args, single: bool) -> str | None:
    """The text timeline of the case's last step (``--timeline``) and its PNG (``--png``).
    **Collective** over pp."""
    if not (args.timeline or args.png):
        return None
    png = png_path(args.png, name, m, single) if args.png else None
    rank0 = MPI.COMM_WORLD.rank == 0
    if png is not None and not _has_matplotlib():
        if rank0:
            print(f"--png: matplotlib is not installed (pip install 'dtensor[bench]'); no "
                  f"chart written to {png}", flush=True)
        png = None
    text = dt.debug.visualize_schedule(sched, png=png, width=args.width, rank=0,
                                       file=io.StringIO())
    if png is not None and rank0:
        print(f"--png: chart written to {png}", file=sys.stderr, flush=True)
    return text if args.timeline else None


def measure(name: str, m: int, args, mesh, single: bool = True) -> dict:
    cfg, mods, sched = build(name, m, args, mesh)
    p = mesh.size(0)
    steps = [one_step(sched, mods, cfg, args, 0)]
    if not args.memory_only:
        steps = [one_step(sched, mods, cfg, args, 1 + i) for i in range(args.repeat)]
    mine = {
        "step_s": statistics.median(s["wall"] for s in steps),
        "bubble": statistics.median(1 - s["busy"] / s["wall"] for s in steps),
        "kinds_s": {k: statistics.median(s["kinds"].get(k, 0.0) for s in steps)
                    for k in "FBIW"},
        "peak_bytes": max(s["peak"] for s in steps),
    }
    ranks = MPI.COMM_WORLD.allgather(mine)
    chart = picture(sched, name, m, args, single)
    orders, times = pp.simulate(KIND[name], sched.num_stages, p, m)
    theory = (p - 1) / (m + p - 1) if name in ("gpipe", "1f1b") else None
    return {
        "schedule": name, "m": m, "stages": sched.num_stages, "pp": p,
        "step_ms": 1e3 * max(r["step_s"] for r in ranks),
        "bubble": statistics.fmean(r["bubble"] for r in ranks),
        "bubble_theory": theory,
        "bubble_sim": pp.bubble_fraction(orders, times),
        "kinds_ms": {k: 1e3 * statistics.fmean(r["kinds_s"][k] for r in ranks) for k in "FBIW"},
        "peak_mib_per_rank": [r["peak_bytes"] / 2**20 for r in ranks],
        **({"timeline": chart} if chart is not None else {}),
    }


def main(argv: list[str] | None = None) -> dict:
    """Measure every case; print the JSON and a table on rank 0. **Collective**."""
    args = bench_args(
        __doc__.splitlines()[0], argv, repeat=5,
        micro={"default": "1,2,4,8", "help": "micro-batch counts"},
        schedules={"default": "gpipe,1f1b,zero_bubble", "help": f"of {sorted(CLASSES)}"},
        layers_per_stage={"type": int, "default": 2, "help": "GPT blocks per stage"},
        d_model={"type": int, "default": 128, "help": "GPT width"},
        seq={"type": int, "default": 64, "help": "sequence length"},
        batch={"type": int, "default": 16, "help": "sequences per step (all micro-batches)"},
        memory_only={"action": "store_true", "help": "one step per case, memory only"},
        timeline={"action": "store_true",
                  "help": "print each case's measured timeline (last step) after the table"},
        png={"help": "draw each case's timeline into this PNG (suffixed per case)"},
        width={"type": int, "default": 80, "help": "character cells of --timeline's axis"},
    )
    comm = MPI.COMM_WORLD
    mesh = dt.init_device_mesh((comm.size,), mesh_dim_names=("pp",))
    names = args.schedules.split(",")
    ms = [int(v) for v in args.micro.split(",")]
    progress = Progress("pipeline", len(names) * len(ms), enabled=comm.rank == 0 and not args.quiet)
    cases = []
    for name in names:
        for m in ms:
            cases.append(measure(name, m, args, mesh, single=len(names) * len(ms) == 1))
            progress(f"{name} m={m}")
    by = {(c["schedule"], c["m"]): c for c in cases}
    for c in cases:  # the zero-bubble gain over 1F1B, and its I + W against 1F1B's B
        ref = by.get(("1f1b", c["m"]))
        if c["schedule"] == "zero_bubble" and ref and not args.memory_only:
            c["gain_vs_1f1b"] = ref["step_ms"] / c["step_ms"]
            b = ref["kinds_ms"]["B"]
            # (the zero-bubble schedule keeps stage 0's backward whole: its B counts too)
            split = sum(c["kinds_ms"].get(k, 0.0) for k in "IWB")
            c["split_cost_vs_b"] = split / b if b else None
    result = {"benchmark": "pipeline", "ranks": comm.size, "config": vars(args),
              "environment": environment(), "cases": cases}
    rows = [(c["schedule"], c["m"], None if args.memory_only else c["step_ms"],
             None if args.memory_only else c["bubble"],
             c["bubble_theory"] if c["bubble_theory"] is not None else c["bubble_sim"],
             "theory" if c["bubble_theory"] is not None else "sim",
             c.get("gain_vs_1f1b"), c.get("split_cost_vs_b"),
             " ".join(f"{v:.2f}" for v in c["peak_mib_per_rank"]))
            for c in cases]
    report = table(
        ["schedule", "m", "step ms", "bubble", "expected", "from", "ZB gain", "I+W / B",
         "peak act MiB per stage"], rows,
        title=f"pipeline: {comm.size} pp ranks, GPT d={args.d_model} seq={args.seq} "
              f"batch={args.batch}, {args.layers_per_stage} blocks per stage",
        notes=[("bubble: 1 - busy/step per rank (median of steps, mean of ranks); expected: "
               "(p-1)/(m+p-1) (theory) or the unit-cost simulation (sim)"),
               ("ZB gain: 1F1B step / zero-bubble step; I+W / B: the zero-bubble "
               "schedule's backward time (I + W, and stage 0's whole B) over 1F1B's")])
    if comm.rank == 0:
        emit(result, args.out, report)
        for c in cases:
            if "timeline" in c:
                print(f"\n{c['schedule']} m={c['m']}:\n{c['timeline']}", flush=True)
    return result


if __name__ == "__main__":
    main()
