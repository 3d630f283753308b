"""Train a small transformer block: ``python -m launch -n 4 launch/examples/train_transformer.py``.

Token and position embeddings, a pre-norm block (layer_norm, multi-head causal
self-attention, layer_norm, GELU MLP), a final layer_norm and a vocabulary projection, with
a cross-entropy loss on a next-token task; trained for ``--steps`` steps (50) with an
optimizer of ``dt.optim`` under ``--strategy``: ``dp`` (batch sharded, parameters
replicated), ``tp`` (attention heads sharded, the MLP column/row-sharded), ``2d`` (DP x TP
on a 2x2 mesh at 4 ranks) or ``local``. Every rank also trains the local model from the
same seed; the script prints both losses and their largest difference and exits 1 when a
step's loss differs by more than ``--rtol`` (float32).
"""

from __future__ import annotations

import sys

from launch.examples._training import main, parser, transformer_model


def run(argv: list[str] | None = None) -> int:
    """Parse the command line and train. **Collective**."""
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=8)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=64)
    args = p.parse_args(argv)
    model = transformer_model(args.batch, args.seq, args.dim, args.heads, args.vocab)
    return main(model, args)


if __name__ == "__main__":
    sys.exit(run())
