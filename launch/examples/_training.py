"""Training models and loop shared by the training examples and the strategy sweep.

A :class:`TrainModel` names its parameters (global shapes and initial values from a seed),
its layouts per strategy, how a step's batch is drawn and its loss, written with ``dt`` ops
so that one function runs on local tensors and on DTensors. Strategies:

- ``local``: plain :class:`dtensor.Tensor` objects in one process (the reference);
- ``dp``: data parallel on a 1-D mesh of all ranks: the batch sharded, parameters
  replicated (the gradients of the replicated weights are all-reduced in backward);
- ``tp``: tensor parallel on a 1-D mesh (Megatron): the first matmul of a pair
  column-sharded, the second row-sharded, the batch replicated; the row-parallel output's
  partial sum is all-reduced (:func:`reduced`);
- ``2d``: DP x TP on a ``(n/2, 2)`` mesh (``(2, 2)`` on 4 ranks; ``(n, 1)`` for odd n).

:func:`train` runs N steps (zero_grad, forward, backward, optimizer step) and returns the
loss of every step; :func:`main` trains the reference on every rank and then the
distributed model from the same seed, compares the losses step by step and exits non-zero
when they differ by more than the float32 tolerance.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from mpi4py import MPI

import dtensor as dt

__all__ = [
    "STRATEGIES",
    "TrainModel",
    "main",
    "make_optimizer",
    "mesh_for",
    "mlp_model",
    "place",
    "reduced",
    "train",
    "transformer_model",
]

R, S = dt.Replicate(), dt.Shard
STRATEGIES = ("local", "dp", "tp", "2d")
OPTIMIZERS = {"sgd": ("SGD", {"momentum": 0.9}), "adam": ("Adam", {}),
              "adamw": ("AdamW", {"weight_decay": 0.01})}


@dataclass(frozen=True)
class TrainModel:
    """A model to train.

    Attributes
    ----------
    name : str
    shapes : mapping of str to tuple
        The parameters' global shapes.
    tp : mapping of str to Placement, or None
        Per parameter, its placement over the tensor-parallel mesh dim (``tp`` and ``2d``;
        the data-parallel dim replicates parameters). None: the model has no tensor-parallel
        layout (only ``local`` and ``dp`` apply).
    batch : callable
        ``batch(step) -> dict of numpy arrays`` (the same on every rank).
    loss : callable
        ``loss(params, batch) -> 0-d tensor``, from ``dt`` ops.
    seed : int
    values : mapping of str to numpy array, optional
        The initial parameters as given (a user's model); default: drawn from ``seed``.
    """

    name: str
    shapes: Mapping[str, tuple[int, ...]]
    tp: Mapping[str, dt.Placement] | None
    batch: Callable[[int], dict[str, np.ndarray]]
    loss: Callable[[Mapping[str, Any], Mapping[str, Any]], Any]
    seed: int = 0
    values: Mapping[str, np.ndarray] | None = None

    def init(self) -> dict[str, np.ndarray]:
        """The initial parameters, the same on every rank: copies of ``values`` when given,
        else float32 drawn from ``seed`` and scaled by fan-in (norm gains 1, biases 0)."""
        if self.values is not None:
            return {n: np.array(a, copy=True) for n, a in self.values.items()}
        rng = np.random.default_rng(self.seed)
        out = {}
        for name, shape in self.shapes.items():
            if name.endswith(".g"):  # a norm's gain
                out[name] = np.ones(shape, np.float32)
            elif name.endswith(".b"):
                out[name] = np.zeros(shape, np.float32)
            else:
                fan_in = shape[-2] if len(shape) > 1 else shape[0]
                out[name] = (rng.standard_normal(shape) / math.sqrt(fan_in)).astype(np.float32)
        return out


# -- the models ----------------------------------------------------------------------------------
def reduced(t: Any) -> Any:
    """A DTensor with a Partial placement reduced to Replicate there (Megatron's all-reduce
    after a row-parallel matmul; its backward moves nothing: the gradient of a Partial
    input is Replicate); anything else as it is. **Collective** for a Partial DTensor."""
    if not isinstance(t, dt.DTensor) or not any(p.is_partial() for p in t.placements):
        return t
    return t.redistribute(t.device_mesh, [R if p.is_partial() else p for p in t.placements])


def mlp_model(batch: int = 16, dim: int = 32, hidden: int = 64, seed: int = 0) -> TrainModel:
    """A two-layer MLP regressing a fixed random target: ``mean((relu(x @ w1 + b1) @ w2 + b2
    - y)^2)``; TP shards ``w1``/``b1`` by columns, ``w2`` by rows. **Local**."""
    shapes = {"w1": (dim, hidden), "b1": (hidden,), "w2": (hidden, dim), "b2": (dim,)}
    target = np.random.default_rng(seed + 1).standard_normal((dim, dim)).astype(np.float32)

    def make_batch(step: int) -> dict[str, np.ndarray]:
        x = np.random.default_rng([seed, step]).standard_normal((batch, dim)).astype(np.float32)
        return {"x": x, "y": np.tanh(x @ target)}

    def loss(p: Mapping[str, Any], b: Mapping[str, Any]) -> Any:
        h = (b["x"] @ p["w1"] + p["b1"]).relu()
        return ((reduced(h @ p["w2"]) + p["b2"]) - b["y"]).square().mean()

    tp = {"w1": S(1), "b1": S(0), "w2": S(0), "b2": R}
    return TrainModel("mlp", shapes, tp, make_batch, loss, seed)


def transformer_model(batch: int = 4, seq: int = 8, dim: int = 32, heads: int = 4,
                      vocab: int = 64, seed: int = 0) -> TrainModel:
    """One pre-norm transformer block on a next-token task: token and position embeddings,
    multi-head causal self-attention, a GELU MLP, layer norms and a cross-entropy loss over
    the vocabulary. Heads are a leading dim of the attention weights (``wq (heads, dim,
    dim/heads)``, ``wo (heads, dim/heads, dim)``), so TP shards heads (``Shard(0)``) and
    the MLP as column/row pairs. **Local**."""
    dh, ff = dim // heads, 4 * dim
    shapes = {
        "wte": (vocab, dim), "wpe": (seq, dim), "ln1.g": (dim,), "ln1.b": (dim,),
        "wq": (heads, dim, dh), "wk": (heads, dim, dh), "wv": (heads, dim, dh),
        "wo": (heads, dh, dim), "ln2.g": (dim,), "ln2.b": (dim,),
        "w1": (dim, ff), "w2": (ff, dim), "lnf.g": (dim,), "lnf.b": (dim,), "head": (dim, vocab),
    }
    mask = np.triu(np.full((seq, seq), -1e9, np.float32), 1)

    def make_batch(step: int) -> dict[str, np.ndarray]:
        tokens = np.random.default_rng([seed, step]).integers(0, vocab, (batch, seq))
        targets = (3 * tokens + 1) % vocab
        return {"tokens": tokens, "targets": targets.reshape(-1), "mask": mask}

    def loss(p: Mapping[str, Any], b: Mapping[str, Any]) -> Any:
        x = dt.embedding(b["tokens"], p["wte"]) + p["wpe"]  # (batch, seq, dim)
        h = dt.layer_norm(x, (dim,), p["ln1.g"], p["ln1.b"]).unsqueeze(1)  # (batch, 1, seq, dim)
        q, k, v = h @ p["wq"], h @ p["wk"], h @ p["wv"]  # (batch, heads, seq, dh)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(dh)) + b["mask"]
        att = dt.softmax(scores, dim=-1) @ v
        x = x + reduced((att @ p["wo"]).sum(dim=1))  # the heads' projections summed
        h = dt.layer_norm(x, (dim,), p["ln2.g"], p["ln2.b"])
        x = x + reduced(dt.gelu(h @ p["w1"]) @ p["w2"])
        logits = dt.layer_norm(x, (dim,), p["lnf.g"], p["lnf.b"]) @ p["head"]
        return dt.cross_entropy(logits.reshape(-1, vocab), b["targets"])

    tp = {n: R for n in shapes}
    tp.update({"wq": S(0), "wk": S(0), "wv": S(0), "wo": S(0), "w1": S(1), "w2": S(0)})
    return TrainModel("transformer", shapes, tp, make_batch, loss, seed)


# -- placing and training ------------------------------------------------------------------------
def mesh_for(strategy: str, size: int | None = None) -> dt.DeviceMesh | None:
    """The mesh of a strategy (None for ``local``). **Collective** (creates a mesh)."""
    n = MPI.COMM_WORLD.size if size is None else size
    if strategy == "local":
        return None
    if strategy == "2d":
        shape = (n // 2, 2) if n % 2 == 0 else (n, 1)
        return dt.init_device_mesh(shape, mesh_dim_names=("dp", "tp"))
    return dt.init_device_mesh((n,), mesh_dim_names=(strategy,))


def layout(model: TrainModel, strategy: str, name: str) -> list[dt.Placement]:
    """The placements of parameter ``name`` (or of the batch, ``"batch"``) under
    ``strategy``. **Local**."""
    batch = name == "batch"
    if strategy == "dp":
        return [S(0) if batch else R]
    if model.tp is None and not batch:
        raise ValueError(f"{model.name}: strategy {strategy!r} needs the model's "
                         "tensor-parallel placements (it has none: local and dp only)")
    if strategy == "tp":
        return [R if batch else model.tp[name]]
    return [S(0), R] if batch else [R, model.tp[name]]


def place(model: TrainModel, strategy: str, mesh: dt.DeviceMesh | None,
          arrays: Mapping[str, np.ndarray], batch: bool = False) -> dict[str, Any]:
    """``arrays`` as tensors of ``strategy``: parameters (leaves that require grad) or,
    with ``batch``, the batch's arrays (first dim sharded over the data-parallel dim; a
    ``mask`` is replicated). **Collective** unless ``local``."""
    out = {}
    for name, a in arrays.items():
        if mesh is None:
            t = dt.from_numpy(a.copy())
        else:
            if not batch:
                pl = layout(model, strategy, name)
            else:
                pl = [R] * mesh.ndim if name == "mask" else layout(model, strategy, "batch")
            t = dt.distribute_tensor(a, mesh, pl, src_data_rank=None)
        out[name] = t if batch else t.requires_grad_()
    return out


def make_optimizer(name: str, params: Sequence[Any], lr: float) -> Any:
    """An optimizer of :mod:`dtensor.optim` by its short name (sgd, adam, adamw). **Local**."""
    cls, kwargs = OPTIMIZERS[name]
    return getattr(dt.optim, cls)(params, lr=lr, **kwargs)


def loss_value(loss: Any) -> float:
    """A loss as a float. **Collective** for a DTensor."""
    return float(loss.full_tensor().item()) if isinstance(loss, dt.DTensor) else loss.item()


def train(model: TrainModel, strategy: str, mesh: dt.DeviceMesh | None, steps: int,
          optimizer: str = "sgd", lr: float = 0.05, clip: float | None = None) -> list[float]:
    """Train ``model`` from its initial parameters for ``steps`` steps; the loss of every
    step (before its update). **Collective** unless ``local``."""
    params = place(model, strategy, mesh, model.init())
    opt = make_optimizer(optimizer, list(params.values()), lr)
    losses = []
    for step in range(steps):
        batch = place(model, strategy, mesh, model.batch(step), batch=True)
        opt.zero_grad()
        loss = model.loss(params, batch)
        loss.backward()
        if clip is not None:
            dt.nn.utils.clip_grad_norm_(list(params.values()), clip)
        opt.step()
        losses.append(loss_value(loss))
    return losses


def _strategies(text: str) -> tuple[str, ...]:
    names = tuple(text.split(","))
    bad = [n for n in names if n not in STRATEGIES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown strategy {bad[0]!r}; choose from {STRATEGIES}")
    return names


def parser(description: str) -> argparse.ArgumentParser:
    """The command line of a training example. **Local**."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--strategy", type=_strategies, default=("tp",),
                   help=f"one or more (comma-separated) of {', '.join(STRATEGIES)}")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="adam")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--clip", type=float, default=None, help="clip_grad_norm_ max norm")
    p.add_argument("--rtol", type=float, default=1e-4, help="tolerance of the loss check")
    return p


def main(model: TrainModel, args: argparse.Namespace) -> int:
    """Train the reference (local tensors, every rank) and then each strategy of
    ``args.strategy`` from the same seed; print the losses and their largest difference on
    rank 0. **Collective**.

    Returns
    -------
    int
        0 when every step's loss of every strategy agrees with the reference within
        ``args.rtol`` (relative; absolute below 1), 1 otherwise (on every rank).
    """
    rank = MPI.COMM_WORLD.rank
    run = {"steps": args.steps, "optimizer": args.optimizer, "lr": args.lr, "clip": args.clip}
    reference = train(model, "local", None, **run)
    failed = False
    for strategy in args.strategy:
        mesh = mesh_for(strategy)
        got = train(model, strategy, mesh, **run) if mesh is not None else reference
        diff = max((abs(a - b) / max(1.0, abs(b)) for a, b in zip(got, reference)),
                   default=0.0)
        ok = diff <= args.rtol
        failed |= not ok
        if rank == 0:
            where = "local" if mesh is None else f"mesh {mesh.shape} {mesh.mesh_dim_names}"
            print(f"{model.name}, strategy {strategy} on {where}, {args.optimizer}, "
                  f"{args.steps} steps")
            for step in sorted({0, len(got) // 2, len(got) - 1} & set(range(len(got)))):
                print(f"step {step:3d}: loss {got[step]:.6f} (local {reference[step]:.6f})")
            print(f"{strategy}: max relative loss difference against the local run: "
                  f"{diff:.2e}: " + ("losses agree" if ok else
                                     f"MISMATCH (above the tolerance {args.rtol:.0e})"))
    return 1 if failed else 0
