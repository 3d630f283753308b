"""Train a tensor-parallel MLP: ``python -m launch -n 4 launch/examples/train_mlp.py``.

A two-layer MLP (``relu(x @ w1 + b1) @ w2 + b2``, mean squared error against a fixed
random map) trained for ``--steps`` steps (50) with an optimizer of ``dt.optim``
(``--optimizer``, Adam by default) under ``--strategy``: ``dp`` (batch sharded, weights
replicated: the weight gradients are all-reduced in backward), ``tp`` (Megatron: ``w1``
column-, ``w2`` row-sharded; one all-reduce in forward, none in backward), ``2d`` (DP x
TP on a 2x2 mesh at 4 ranks) or ``local`` (plain tensors in one process). Every rank also
trains the local model from the same seed; the script prints both losses and their largest
difference and exits 1 when a step's loss differs by more than ``--rtol`` (float32).
"""

from __future__ import annotations

import sys

from launch.examples._training import main, mlp_model, parser


def run(argv: list[str] | None = None) -> int:
    """Parse the command line and train. **Collective**."""
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    args = p.parse_args(argv)
    return main(mlp_model(args.batch, args.dim, args.hidden), args)


if __name__ == "__main__":
    sys.exit(run())
