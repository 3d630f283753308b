"""Checkpoint throughput: ``dt.save``/``dt.load`` against ``np.save``/``np.load`` of the same
bytes.

Run as ``python -m launch -n 2 -m launch.bench.checkpoint [--mib 1024] [--tensors 4]
[--dir DIR] [--repeat N] [--out FILE]``. The state is ``--tensors`` float32 DTensors of
``--mib`` MiB in all, row-sharded over a 1-D mesh of every rank. Each sample times, after a
barrier, on every rank:

- ``dt.save(state, DIR/ckpt)`` (MPI-IO, one XXH3-64 checksum per 4 MiB chunk, fsync, atomic rename),
  and the same with ``sync=False`` (no fsync);
- ``np.save`` of this rank's shards into files of its own (the same bytes), and the same
  followed by ``os.fsync`` of each file (what dt.save's crash safety adds);
- ``dt.load(state, DIR/ckpt)`` in place (every chunk read is verified);
- ``np.load`` of those files (into new arrays), and the same bytes read into the existing
  shards (``readinto`` after the ``.npy`` header: what ``dt.load`` does, less its checks).

Before each sample every rank flushes the file system's dirty data (``os.sync``, not
timed), so that no sample pays for the write-back of an earlier one. Files are read back
from the page cache (just written). The operations take turns within each round, so that a
change of the machine's load touches them alike. Figures: per operation the median seconds
on each rank, then the worst rank; GB/s of the whole state; the ratios of dt's figures to
numpy's: per round the worst rank's seconds of each, the median over the rounds (and the
worst round). The date (UTC) and the load averages before and after the run come with them
(the disk and the cores may be shared). Everything under ``DIR`` that the run wrote is
removed at the end (``--dir`` defaults to the temporary directory; the run needs about
twice ``--mib`` free).

Output: JSON on stdout (``--out FILE`` too), then a table, from rank 0.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time
from datetime import datetime, timezone

# Run as a script, this file's folder is sys.path[0], where the sibling benchmark
# ``redistribute.py`` would shadow the ``redistribute`` package.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import tempfile

import numpy as np
from mpi4py import MPI

import dtensor as dt
from launch.bench._common import (
    Progress,
    bench_args,
    emit,
    environment,
    ratio,
    table,
    worst_rank,
)

#: (ratio name, numerator, denominator)
RATIOS = (
    ("save/np.save", "dt.save", "np.save"),
    ("save/np.save+fsync", "dt.save", "np.save+fsync"),
    ("save(sync=False)/np.save", "dt.save(sync=False)", "np.save"),
    ("load/np.load", "dt.load", "np.load"),
    ("load/np.load into", "dt.load", "np.load into"),
)


def _timed(fn, world) -> float:
    os.sync()  # every sample starts with no dirty data of an earlier one to write back
    world.Barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    """Time checkpoint save/load against numpy; rank 0 prints the JSON. **Collective**."""
    args = bench_args(
        __doc__.splitlines()[0], argv,
        mib={"type": float, "default": 1024.0, "help": "MiB of DTensor data in all"},
        tensors={"type": int, "default": 4, "help": "number of DTensors"},
        dir={"default": tempfile.gettempdir(), "help": "where the files go (removed after)"},
    )
    world = MPI.COMM_WORLD
    rank, n = world.Get_rank(), world.Get_size()
    mesh = dt.init_device_mesh((n,))
    cols = 1024
    rows = max(n, int(args.mib * 2**20 / 4 / cols / args.tensors))
    state = {
        f"t{i}": dt.distribute_tensor(
            np.random.default_rng(i).random((rows, cols), dtype=np.float32), mesh,
            [dt.Shard(0)])
        for i in range(args.tensors)
    }
    total = sum(x.to_local().numpy().nbytes for x in state.values())
    total = world.allreduce(total)
    root = world.bcast(tempfile.mkdtemp(prefix="dtensor-bench-", dir=args.dir)
                       if rank == 0 else None)
    ckpt = os.path.join(root, "ckpt")
    mine = [os.path.join(root, f"np-{rank}-{k}.npy") for k in state]

    def np_save(sync: bool) -> None:
        for name, x in zip(mine, state.values()):
            with open(name, "wb") as fh:
                np.save(fh, x.to_local().numpy())
                if sync:
                    fh.flush()
                    os.fsync(fh.fileno())

    def np_load() -> None:
        for name in mine:
            np.load(name)

    def np_load_into() -> None:
        for name, x in zip(mine, state.values()):
            with open(name, "rb") as fh:
                version = np.lib.format.read_magic(fh)
                (np.lib.format.read_array_header_1_0 if version == (1, 0)
                 else np.lib.format.read_array_header_2_0)(fh)
                fh.readinto(x.to_local().numpy().reshape(-1).view(np.uint8))

    ops = {
        "dt.save": lambda: dt.save(state, ckpt),
        "dt.save(sync=False)": lambda: dt.save(state, ckpt, sync=False),
        "np.save": lambda: np_save(False),
        "np.save+fsync": lambda: np_save(True),
        "dt.load": lambda: dt.load(state, ckpt),
        "np.load": np_load,
        "np.load into": np_load_into,
    }
    samples: dict[str, list[float]] = {k: [] for k in ops}
    started, load_before = datetime.now(timezone.utc), os.getloadavg()
    progress = Progress("checkpoint", args.repeat, enabled=rank == 0 and not args.quiet)
    try:
        for _ in range(args.repeat):
            for name, fn in ops.items():
                samples[name].append(_timed(fn, world))
            progress("round of every operation")
    finally:
        world.Barrier()
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
    figures = {}
    for name, values in samples.items():
        seconds = worst_rank(statistics.median(values), world)
        figures[name] = {"median_s": round(seconds, 4),
                         "GB_per_s": round(total / seconds / 1e9, 3)}
    # per round, the worst rank's seconds of each operation
    rounds = {k: [worst_rank(v, world) for v in values] for k, values in samples.items()}
    per_round = {name: [ratio(a, b) for a, b in zip(rounds[num], rounds[den])]
                 for name, num, den in RATIOS}
    if rank == 0:
        ratios = {name: statistics.median(r) for name, r in per_round.items()}
        rows = [(name, f["median_s"], f["GB_per_s"]) for name, f in figures.items()]
        report = table(("operation", "median s", "GB/s"), rows,
                       title=f"{total / 2**20:.0f} MiB in {args.tensors} DTensors, {n} ranks",
                       notes=["ratios (median round): " + ", ".join(
                           f"{k} {v}" for k, v in ratios.items())])
        emit({
            "ranks": n, "bytes": total, "tensors": args.tensors, "repeat": args.repeat,
            "date": started.strftime("%Y-%m-%d %H:%M UTC"),
            "load_average": {"before": [round(x, 2) for x in load_before],
                             "after": [round(x, 2) for x in os.getloadavg()]},
            "environment": environment(), "figures": figures,
            "ratios": ratios,
            "worst_round_ratios": {name: max(r) for name, r in per_round.items()},
        }, args.out, report)


if __name__ == "__main__":
    main()
