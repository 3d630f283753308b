"""The cost of comparing index arguments across ranks (``x[idx]`` with an index array).

Run as ``timeout 600 python -m launch -n 2 launch/bench/index_check.py`` (a 1-D mesh of all
ranks). ``x[idx]``, ``x[idx] = value`` and ``index_put`` with an index array (a list, an
ndarray, a local tensor, a mask) on a sharded or partial DTensor all-gather a digest of the
index before they run (:mod:`dtensor.dispatch.index_args`), so that ranks that pass
different indices raise instead of computing rows that are no rank's answer. For 8x8
float32 operands it reports, in microseconds per call (median over batched samples on
each rank, then the worst rank; and the fastest sample, the uncontended figure on a
shared machine):

- ``getitem_list_S0`` / ``_S1`` / ``_R``: ``x[[0, 5]]`` on a ``Shard(0)``, ``Shard(1)``
  and replicated ``x`` (the last is purely local: not checked);
- ``setitem_mask_S0``: ``x[mask] = 0.0`` with an 8x8 bool ndarray mask on ``Shard(0)``;
- ``getitem_slice_S0``: ``x[:, 2:6]``, a basic index (not checked: the compiled front);
- ``digest_only``: the digest of ``[0, 5]`` alone, and ``exchange_only``: the all-gather of
  three int64 values alone (what the check adds to a call).

Run it again on a build without the check (the same script with another checkout on
``PYTHONPATH``) to get the before figures; ops missing there report ``null``. Output: a
table and JSON (``--out FILE`` too).
"""

from __future__ import annotations

import os
import statistics
import sys

# Run as a script, this file's folder is sys.path[0], where the sibling benchmark
# ``redistribute.py`` would shadow the ``redistribute`` package.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

from collections.abc import Callable
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
    table,
    worst_rank,
)

SHAPE = (8, 8)


def _cases(mesh: dt.DeviceMesh) -> dict[str, Callable[[], Any] | None]:
    rng = np.random.default_rng(0)
    a = rng.standard_normal(SHAPE).astype(np.float32)
    mask = rng.random(SHAPE) < 0.5
    x0 = dt.distribute_tensor(a, mesh, [dt.Shard(0)])
    x1 = dt.distribute_tensor(a, mesh, [dt.Shard(1)])
    xr = dt.distribute_tensor(a, mesh, [dt.Replicate()])
    w = dt.distribute_tensor(a, mesh, [dt.Shard(0)])
    group = mesh.get_group(0)

    def setitem() -> None:
        w[mask] = 0.0

    try:  # lazy: the same script times a checkout without the check (no index_digest)
        from placements.index_meta import index_digest
    except ImportError:  # a build without the check
        index_digest = None
    return {
        "getitem_list_S0": lambda: x0[[0, 5]],
        "getitem_list_S1": lambda: x1[[0, 5]],
        "getitem_list_R": lambda: xr[[0, 5]],
        "setitem_mask_S0": setitem,
        "getitem_slice_S0": lambda: x0[:, 2:6],
        "digest_only": None if index_digest is None else lambda: index_digest([0, 5]),
        "exchange_only": lambda: group.allgather_ints([1, 2, 3], what="bench"),
    }


def run(args: Any) -> dict[str, Any]:
    """Time every case. **Collective** over ``COMM_WORLD``."""
    comm = MPI.COMM_WORLD
    mesh = dt.init_device_mesh((comm.size,))
    figures: dict[str, float | None] = {}
    fastest: dict[str, float | None] = {}
    cases = _cases(mesh)
    progress = Progress("index_check", len(cases),
                        enabled=comm.rank == 0 and not getattr(args, "quiet", False))
    for name, fn in cases.items():
        if fn is None:
            figures[name] = fastest[name] = None
            progress(f"{name}: not at this rank count")
            continue
        for _ in range(20):
            fn()
        comm.Barrier()
        number, _ = agreed_number(fn, comm, 0.002)  # the same calls on every rank
        samples = per_call_us(fn, repeat=args.repeat, number=number, warmup=0)
        figures[name] = round(worst_rank(statistics.median(samples), comm), 3)
        fastest[name] = round(worst_rank(min(samples), comm), 3)
        progress(f"{name}: {figures[name]} us")
    return {"benchmark": "index_check", "ranks": comm.size, "shape": list(SHAPE),
            "dtensor": os.path.dirname(os.path.dirname(dt.__file__)), "us": figures,
            "min_us": fastest, "environment": environment()}


def report(doc: dict[str, Any]) -> str:
    """The figures as a markdown table (the shared :func:`table`). **Local**."""
    rows = [(name, us, doc["min_us"][name]) for name, us in doc["us"].items()]
    return table(("case", "µs per call (median)", "fastest sample"), rows, markdown=True,
                 title=f"index check, {doc['ranks']} ranks, 8x8 float32 ({doc['dtensor']})\n")


def main(argv: list[str] | None = None) -> None:
    args = bench_args(__doc__.splitlines()[0], argv)
    doc = run(args)
    if MPI.COMM_WORLD.rank == 0:
        emit(doc, args.out, report(doc))


if __name__ == "__main__":
    main()
