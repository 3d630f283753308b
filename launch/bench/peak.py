"""The float32 matmul peak of one core: the FLOP rate MFU is measured against.

Run as ``python -m launch.bench.peak [--repeat N] [--out FILE]`` (one process). BLAS runs
one thread (``OPENBLAS_NUM_THREADS=1`` and its twins are set before numpy is imported,
as ``python -m launch`` sets them for every rank). For square float32 matmuls of 256 to
2048 it times ``a @ b`` (median of ``--repeat`` calls after a warm-up) and reports
GFLOP/s = 2 n^3 / seconds; the peak is the best median. MFU of a run on ``k`` ranks (one
core each) = model FLOPs per second / (peak x k).

Output: JSON on stdout (``--out FILE`` too), then a table.
"""

from __future__ import annotations

import os
import sys

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"
# Run as a script, this file's folder is sys.path[0], where the sibling benchmark
# ``redistribute.py`` would shadow the ``redistribute`` package.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import statistics
import time
from collections.abc import Callable

import numpy as np

from launch.bench._common import Progress, bench_args, emit, environment, table

SIZES = (256, 512, 1024, 2048)


def gflops(n: int, repeat: int) -> float:
    """Median GFLOP/s of an ``n x n`` float32 matmul on one thread. **Local**."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    out = np.empty((n, n), np.float32)
    np.matmul(a, b, out=out)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        np.matmul(a, b, out=out)
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times) / 1e9


def measure(repeat: int = 7, sizes: tuple[int, ...] = SIZES,
            progress: Callable[[str], None] | None = None) -> dict:
    """``{"sizes": {n: GFLOP/s}, "peak_gflops_per_core": best}``. **Local**."""
    out = {}
    for n in sizes:
        out[n] = round(gflops(n, repeat if n < 2048 else max(3, repeat // 2)), 2)
        if progress is not None:
            progress(f"{n}: {out[n]} GFLOP/s")
    return {"sizes": out, "peak_gflops_per_core": max(out.values())}


def main(argv: list[str] | None = None) -> None:
    args = bench_args(
        __doc__.splitlines()[0], argv, repeat=7,
        sizes={"type": int, "nargs": "+", "default": list(SIZES), "help": "n of the n x n matmuls"},
    )
    progress = Progress("peak", len(args.sizes), enabled=not args.quiet)
    result = {"benchmark": "peak", "threads": 1,
              **measure(args.repeat, tuple(args.sizes), progress), "environment": environment()}
    emit(result, args.out, table(("n", "GFLOP/s"), list(result["sizes"].items()),
                                 title="float32 matmul, one thread",
                                 notes=[(f"peak per core: {result['peak_gflops_per_core']:.2f} "
                                        "GFLOP/s")]))


if __name__ == "__main__":
    main()
