"""Peak allocated memory of forward + backward of an MLP, with and without activation
checkpointing (``dt.utils.checkpoint`` around each layer).

Run as ``python -m launch.bench.activation_checkpoint [--layers N] [--batch B] [--width D]
[--hidden H] [--out FILE]`` (one process, local float32 tensors). Each layer is
``dropout(relu(x @ w1)) @ w2 + x`` (dropout 0.1). For each variant it resets the peak
(``dt.reset_peak_memory_stats()``), runs one seeded forward and backward and reports
``dt.memory_stats()['peak_allocated_bytes']`` less what was allocated before (parameters and
input), and whether the checkpointed gradients are bitwise those of the plain run.

Output: JSON on stdout (``--out FILE`` too), then a table.
"""

from __future__ import annotations

import os
import sys

# Run as a script, this file's folder is sys.path[0], where the sibling benchmark
# ``redistribute.py`` would shadow the ``redistribute`` package.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import numpy as np

import dtensor as dt
from launch.bench._common import Progress, bench_args, emit, environment, table


def layer(x, w1, w2):
    return dt.dropout((x @ w1).relu(), 0.1, True) @ w2 + x


def step(params, x, checkpointed: bool) -> tuple[int, list]:
    """Peak bytes over one forward and backward (above the bytes held before); the
    gradients."""
    for w in params:
        w.grad = None
    dt.manual_seed(0)
    dt.reset_peak_memory_stats()
    base = dt.memory_stats()["allocated_bytes"]
    h = x
    for w1, w2 in zip(params[::2], params[1::2]):
        h = dt.utils.checkpoint(layer, h, w1, w2) if checkpointed else layer(h, w1, w2)
    h.square().mean().backward()
    del h
    peak = dt.memory_stats()["peak_allocated_bytes"] - base
    return peak, [w.grad.numpy().copy() for w in params]


def main(argv: list[str] | None = None) -> dict:
    """Measure both variants; print the JSON and a table. **Local**."""
    args = bench_args(
        __doc__.splitlines()[0], argv,
        layers={"type": int, "default": 8, "help": "layers of the MLP"},
        batch={"type": int, "default": 1024, "help": "rows of the input"},
        width={"type": int, "default": 128, "help": "width of the residual stream"},
        hidden={"type": int, "default": 512, "help": "width of each layer's hidden part"},
    )
    rng = np.random.default_rng(0)
    params = []
    for _ in range(args.layers):
        for shape in ((args.width, args.hidden), (args.hidden, args.width)):
            w = (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)
            params.append(dt.tensor(w, requires_grad=True))
    x = dt.tensor(rng.standard_normal((args.batch, args.width)).astype(np.float32))
    progress = Progress("activation_checkpoint", 2, enabled=not args.quiet)
    plain, want = step(params, x, False)
    progress("plain")
    checked, got = step(params, x, True)
    progress("checkpointed")
    result = {
        "benchmark": "activation_checkpoint",
        "layers": args.layers, "batch": args.batch, "width": args.width,
        "hidden": args.hidden,
        "peak_bytes_plain": plain,
        "peak_bytes_checkpointed": checked,
        "ratio": round(checked / plain, 3),
        "gradients_bitwise_equal": all(np.array_equal(a, b) for a, b in zip(got, want)),
        "environment": environment(),
    }
    rows = [("plain", f"{plain / 2**20:.2f}", "1.000", "-"),
            ("checkpointed", f"{checked / 2**20:.2f}", f"{result['ratio']:.3f}",
             result["gradients_bitwise_equal"])]
    emit(result, args.out, table(("variant", "peak MiB", "/ plain", "same gradients"), rows,
                                 title=f"forward + backward of {args.layers} layers, batch "
                                       f"{args.batch}, width {args.width}, hidden {args.hidden}"))
    return result


if __name__ == "__main__":
    main()
