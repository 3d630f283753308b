"""Train a GPT of ``dt.nn`` modules: ``python -m launch -n 4 launch/examples/train_transformer.py``.

The GPT of ``launch/examples/gpt.py`` (token and position embeddings, pre-norm blocks of
causal self-attention and a GELU MLP, a tied head) trained on a next-token task for
``--steps`` steps (20) with AdamW under each of ``--strategy`` (comma-separated, default
every strategy this world size runs): ``dp`` (DTensor data parallelism), ``replicate``
(``dt.replicate``: bucketed asynchronous all-reduce), ``fsdp`` / ``zero2`` / ``fsdp_int``
(``dt.fully_shard``), ``tp`` / ``tp_sp`` (``dt.parallelize_module``), ``fsdp_tp`` and
``hsdp`` (2x2 meshes at 4 ranks). Every rank also trains the local model from the same
seed; the script prints both losses and their largest difference and exits 1 when a step's
loss differs by more than ``--rtol`` (float32). ``launch/examples/train_mlp.py`` is the
functional (dict of parameters) example.
"""

from __future__ import annotations

import argparse
import sys

from mpi4py import MPI

import dtensor as dt
from launch.examples.gpt import GPTConfig, batch
from launch.examples.gpt_strategies import STRATEGIES, build, supported


def train(name: str, cfg: GPTConfig, steps: int, batch_size: int, lr: float) -> list[float]:
    """The global mean loss of every step of ``name``. **Collective**."""
    run = build(name, cfg)
    opt = dt.optim.AdamW(run.model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        idx, tgt = batch(cfg, batch_size, step)
        loss = run.model(*run.inputs(idx, tgt))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(run.loss_value(loss))
    return losses


def run(argv: list[str] | None = None) -> int:
    """Parse the command line and train. **Collective**."""
    world = MPI.COMM_WORLD.size
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = [s for s in STRATEGIES if s != "local" and supported(s, world)]
    p.add_argument("--strategy", default=",".join(here),
                   help=f"comma-separated, of {', '.join(STRATEGIES[1:])}")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=12, help="sequences per step (global)")
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--dim", type=int, default=48)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--rtol", type=float, default=1e-4)
    args = p.parse_args(argv)
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers,
                    n_head=args.heads, d_model=args.dim, bias=False)
    strategies = [s for s in args.strategy.split(",") if s]
    for s in strategies:
        if not supported(s, world):
            p.error(f"strategy {s!r} does not run at {world} ranks")
    rank0 = MPI.COMM_WORLD.rank == 0
    if rank0:
        print(f"GPT of {cfg.n_params()} parameters at {world} ranks")
    local = train("local", cfg, args.steps, args.batch, args.lr)
    status = 0
    for s in strategies:
        got = train(s, cfg, args.steps, args.batch, args.lr)
        worst = max(abs(a - b) / max(abs(b), 1.0) for a, b in zip(got, local))
        ok = worst <= args.rtol
        status |= not ok
        if rank0:
            for i in (0, args.steps - 1):
                print(f"{s} step {i:3d}: loss {got[i]:.6f} (local {local[i]:.6f})")
            print(f"{s}: max relative loss difference against the local run: {worst:.2e}: "
                  f"{'losses agree' if ok else 'LOSSES DIFFER'}")
    return status


if __name__ == "__main__":
    sys.exit(run())
