"""A model of your own in the strategy sweep: ``--model launch.examples.sweep_model:build``.

:func:`build` follows the contract of ``strategy_sweep.py --model package.module:function``
(the arguments of ``dt.auto_shard(step_fn, params, inputs, mesh)``, plus the parameters'
tensor-parallel placements): a residual classifier, ``h = x + W2 gelu(W1 rms_norm(x) + b1)``
then ``cross_entropy(h @ head, labels)``; tensor parallelism splits ``w1``/``b1`` by columns
and ``w2`` by rows (Megatron), and the classifier head by classes (vocab parallel).

Run the training sweep on it::

    python -m launch -n 2 launch/experiments/strategy_sweep.py --train \\
        --model launch.examples.sweep_model:build
    python -m launch -n 2 launch/experiments/strategy_sweep.py --train --auto \\
        --model launch.examples.sweep_model:build --size tiny

or run this file, which does the first (arguments after it go to the sweep).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

import dtensor as dt

#: batch, dim, hidden, classes per ``--size``
SIZES = {"tiny": (8, 8, 16, 4), "small": (64, 64, 256, 32), "medium": (256, 256, 1024, 128)}


def build(size: str = "small", seed: int = 0) -> tuple:
    """``(step_fn, params, inputs, tp)`` of the residual classifier at ``size``. **Local**
    (every rank draws the same values from ``seed``)."""
    batch, dim, hidden, classes = SIZES[size]
    rng = np.random.default_rng(seed)

    def weight(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(rows)).astype(np.float32)

    params = {"norm.g": np.ones(dim, np.float32), "w1": weight(dim, hidden),
              "b1": np.zeros(hidden, np.float32), "w2": weight(hidden, dim),
              "head": weight(dim, classes)}
    x = rng.standard_normal((batch, dim)).astype(np.float32)
    inputs = {"x": x, "labels": rng.integers(0, classes, batch)}

    def step_fn(p: Mapping[str, Any], b: Mapping[str, Any]) -> Any:
        h = dt.rms_norm(b["x"], (dim,), p["norm.g"])
        h = b["x"] + dt.gelu(h @ p["w1"] + p["b1"]) @ p["w2"]
        return dt.cross_entropy(h @ p["head"], b["labels"])

    tp = {"w1": dt.Shard(1), "b1": dt.Shard(0), "w2": dt.Shard(0), "head": dt.Shard(1)}
    return step_fn, params, inputs, tp


def main(argv: list[str] | None = None) -> int:
    """``strategy_sweep.py --train`` on this model (tiny by default). **Collective**."""
    from launch.experiments import strategy_sweep  # lazy: the sweep imports this module

    argv = sys.argv[1:] if argv is None else argv
    size = [] if "--size" in argv else ["--size", "tiny"]
    return strategy_sweep.main(["--train", "--model", "launch.examples.sweep_model:build",
                                *size, *argv])


if __name__ == "__main__":
    sys.exit(main())
