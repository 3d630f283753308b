"""Local kernel speed: dtensor's local kernels vs numpy vs PyTorch (one CPU thread).

Run as ``python -m launch.bench.kernels [--repeat N] [--sizes 8 64 ...] [--ops softmax ...]
[--out FILE]`` (one process, no MPI). For each op and each float32 shape ``N x N`` and
``N/2 x N`` (the local shard of a 2-rank ``Shard(0)``) it times, in microseconds per call:

- ``ours``: the local kernel entry point (``dtensor.local.kernels`` and the op table's
  local functions) on a ``dt.Tensor``: the compiled kernels when the extension is enabled,
  the numpy twins with ``DTENSOR_FASTPATH=0``;
- ``numpy``: the computation written in numpy on the same array;
- ``torch``: PyTorch's kernel on a tensor sharing that memory, with
  ``torch.set_num_threads(1)`` (skipped when torch is not importable).

Each figure is the median (``--stat min``: the fastest) of ``--repeat`` batched samples; the
three calls are interleaved sample by sample so that they share the machine's load. The target is
``ours <= 1.1 * min(numpy, torch) + 1 us``; the table marks a miss with ``!``. Outputs of
at least ``DTENSOR_POOL_MIN_BYTES`` (4 KiB) come from dtensor's caching allocator, whose
cost is part of ``ours`` (the footer gives it); run with a larger
``DTENSOR_POOL_MIN_BYTES`` to time the kernels on numpy's allocations. Output: a markdown
table on stdout, and the JSON figures with ``--out FILE`` (a progress line per op on
stderr; ``--quiet`` silences them).
"""

from __future__ import annotations

import os
import sys

# Run as a script, this file's folder is sys.path[0], where the sibling benchmark
# ``redistribute.py`` would shadow the ``redistribute`` package.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import json
import statistics
from collections.abc import Callable

import numpy as np

import dtensor as dt
import fastpath
from dtensor.local import kernels as K
from dtensor.local.kernels import pointwise as P
from dtensor.local.kernels.base import out_buffer
from dtensor.ops import OPS
from launch.bench._common import Progress, bench_args, environment, per_call_us, table

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # the numpy and dtensor columns still run
    torch = None

SIZES = [8, 16, 32, 64, 128, 256, 512, 1024]
SLACK_US = 1.0
FACTOR = 1.1


def _np_softmax(a):
    e = np.exp(a - a.max(-1, keepdims=True))
    e /= e.sum(-1, keepdims=True)
    return e


def _np_log_softmax(a):
    z = a - a.max(-1, keepdims=True)
    z -= np.log(np.exp(z).sum(-1, keepdims=True))
    return z


def _np_layer_norm(a, w, b):
    c = a - a.mean(-1, keepdims=True)
    var = np.mean(c * c, -1, keepdims=True)
    var += np.float32(1e-5)
    c /= np.sqrt(var)
    if w is not None:
        c *= w
        c += b
    return c


def _twin(kernel):
    """The numpy twin of a local kernel (numpy has no erf: exact gelu has none simpler)."""
    twin = getattr(kernel, "fallback", kernel)
    return lambda a: twin(a, None)


def cases(a: np.ndarray) -> dict[str, tuple[Callable, Callable, Callable | None]]:
    """Per op: the (ours, numpy, torch) calls on the float32 array ``a``."""
    n = a.shape[-1]
    x = dt.from_numpy(a)
    rng = np.random.default_rng(1)
    w = rng.standard_normal(n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    xw, xb = dt.from_numpy(w), dt.from_numpy(b)
    exp, relu = OPS["exp"].function, OPS["relu"].function
    gelu_np, gelu_tanh_np = _twin(P._gelu_erf), _twin(P._gelu_tanh)
    t = tw = tb = None
    if torch is not None:
        t, tw, tb = torch.from_numpy(a), torch.from_numpy(w), torch.from_numpy(b)
    table = {
        "softmax(-1)": (lambda: K.softmax(x, -1), lambda: _np_softmax(a),
                        lambda: torch.softmax(t, -1)),
        "log_softmax(-1)": (lambda: K.log_softmax(x, -1), lambda: _np_log_softmax(a),
                            lambda: torch.log_softmax(t, -1)),
        "layer_norm": (lambda: K.layer_norm(x, (n,)), lambda: _np_layer_norm(a, None, None),
                       lambda: F.layer_norm(t, (n,))),
        "layer_norm(w,b)": (lambda: K.layer_norm(x, (n,), xw, xb),
                            lambda: _np_layer_norm(a, w, b), lambda: F.layer_norm(t, (n,), tw, tb)),
        "gelu": (lambda: K.gelu(x), lambda: gelu_np(a), lambda: F.gelu(t)),
        "gelu(tanh)": (lambda: K.gelu(x, "tanh"), lambda: gelu_tanh_np(a),
                       lambda: F.gelu(t, approximate="tanh")),
        "exp": (lambda: exp(x), lambda: np.exp(a), lambda: torch.exp(t)),
        "relu": (lambda: relu(x), lambda: np.maximum(a, np.float32(0)), lambda: torch.relu(t)),
        "sum(-1)": (lambda: K.sum(x, -1), lambda: a.sum(-1), lambda: t.sum(-1)),
        "mean(-1)": (lambda: K.mean(x, -1), lambda: a.mean(-1), lambda: t.mean(-1)),
        "amax(-1)": (lambda: K.amax(x, -1), lambda: a.max(-1), lambda: t.amax(-1)),
        "mean()": (lambda: K.mean(x), lambda: a.mean(), lambda: t.mean()),
        # the transposed copy (a ``c.mT`` layout made C-contiguous), output included
        "t().contiguous()": (lambda: x.t().contiguous(), lambda: np.ascontiguousarray(a.T),
                             lambda: t.t().contiguous()),
    }
    if torch is None:
        table = {k: (o, p, None) for k, (o, p, _) in table.items()}
    return table


def _time(fn: Callable, repeat: int) -> float:
    return per_call_us(fn, repeat=repeat, warmup=3, target_s=0.002)


def measure(ops: list[str] | None, sizes: list[int], repeat: int, stat=statistics.median,
            progress: Callable[[str], None] | None = None) -> list[dict]:
    """One row per (op, shape): ``stat`` of ours/numpy/torch samples in us;
    ``progress(message)`` after each shape. **Local**."""
    rows = []
    shapes = [s for n in sizes for s in ((n, n), (max(n // 2, 1), n))]
    for shape in shapes:
        a = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
        for op, calls in cases(a).items():
            if ops and op not in ops:
                continue
            samples: list[list[float]] = [[], [], []]
            for _ in range(repeat):
                for i, fn in enumerate(calls):
                    if fn is not None:
                        samples[i] += _time(fn, 1)
            med = [round(stat(s), 2) if s else None for s in samples]
            best = min(v for v in med[1:] if v is not None)
            rows.append({"op": op, "shape": list(shape), "ours_us": med[0], "numpy_us": med[1],
                         "torch_us": med[2], "best_us": best,
                         "ok": med[0] <= FACTOR * best + SLACK_US})
        if progress is not None:
            progress(f"{shape[0]}x{shape[1]}")
    return rows


def markdown(rows: list[dict]) -> str:
    """The rows as a markdown table (``!`` marks a missed target). **Local**."""
    cells = [(r["op"], f"{r['shape'][0]}x{r['shape'][1]}", f"{r['ours_us']:.1f}",
              f"{r['numpy_us']:.1f}", "-" if r["torch_us"] is None else f"{r['torch_us']:.1f}",
              f"{r['ours_us'] / r['best_us']:.2f}" + ("" if r["ok"] else " !")) for r in rows]
    return table(("op", "shape", "ours", "numpy", "torch(1 thr)", "ours/best"), cells,
                 markdown=True, align="llrrrr")


def main(argv: list[str] | None = None) -> list[dict]:
    """Time every op at every shape; print the markdown table. **Local**."""
    args = bench_args(
        __doc__.splitlines()[0], argv,
        sizes={"type": int, "nargs": "+", "default": SIZES, "help": "N of NxN and N/2xN"},
        ops={"nargs": "+", "default": None, "help": "only these ops (names as in the table)"},
        stat={"choices": ["median", "min"], "default": "median",
              "help": "figure of the samples (min: the uncontended time on a shared machine)"},
    )
    if torch is not None:
        torch.set_num_threads(1)
    stat = min if args.stat == "min" else statistics.median
    sizes = len(args.sizes) * 2
    rows = measure(args.ops, args.sizes, args.repeat, stat,
                   Progress("kernels", sizes, enabled=not args.quiet))
    sys.stdout.write(markdown(rows) + "\n")
    missed = sum(not r["ok"] for r in rows)
    like = np.empty(1, np.float32)
    alloc_us = statistics.median(
        per_call_us(lambda: out_buffer((64, 64), like.dtype, like), repeat=args.repeat))
    sys.stdout.write(f"\n{missed} of {len(rows)} figures miss ours <= {FACTOR} x best + "
                     f"{SLACK_US} us (compiled kernels: {fastpath.ENABLED}; one pooled "
                     f"output buffer (16 KiB) costs {alloc_us:.1f} us)\n")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump({"environment": environment(), "rows": rows}, handle, indent=1)
    return rows


if __name__ == "__main__":
    main()
