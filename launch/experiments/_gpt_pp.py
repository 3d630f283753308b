"""The GPT sweep's pipelined and context-parallel steps (issue 34): ``pp{p}_m{m}`` (the GPT
split into ``p`` stages by ``dt.pipelining.pipeline_split``'s equal-cost split, one per
rank, ``Schedule1F1B`` over ``m`` micro-batches), ``pp{p}_fsdp{d}_m{m}`` (that on a
``(pp, dp)`` mesh, every stage ``fully_shard``-ed over ``dp``, each dp rank feeding its rows
of the batch) and ``cp{c}`` (``dt.context_parallel`` over ``c`` ranks: every rank holds two
load-balanced chunks of each sequence, the attention is ring attention and the parameter
gradients are summed over the ranks, as data parallelism does).

Each is a sweep step (``forward``, ``backward``, ``optimizer``) from the same seed and batch
as :func:`launch.examples.gpt_strategies.build`'s strategies. A pipeline's ``forward`` runs
the whole schedule (its forwards and backwards interleave: the backward phase is empty),
its ``optimizer`` clips by the norm of the whole model (the stages' norms combined over
``pp``, the tied embedding counted once) and steps each stage's optimizer.
"""

from __future__ import annotations

import contextlib
import math
import re
from typing import Any

import numpy as np
from mpi4py import MPI

import dtensor as dt
from dtensor import pipelining as pp
from launch.examples._training import make_optimizer
from launch.examples.gpt import GPT, GPTConfig
from launch.examples.gpt import batch as make_batch

__all__ = ["ContextStep", "PhasedStep", "PipelineStep", "parse"]

_NAME = re.compile(r"^pp(\d+)(?:_fsdp(\d+))?_m(\d+)$|^cp(\d+)$")


def parse(name: str) -> dict[str, int] | None:
    """``{"pp", "dp", "m"}`` of ``pp{p}[_fsdp{d}]_m{m}``, ``{"cp"}`` of ``cp{c}``, None for
    any other strategy name. **Local**."""
    hit = _NAME.match(name)
    if hit is None:
        return None
    p, d, m, c = hit.groups()
    if c is not None:
        return {"cp": int(c)}
    return {"pp": int(p), "dp": int(d or 1), "m": int(m)}


def _loss_fn(logits: Any, y: Any) -> Any:
    return dt.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


class PhasedStep:
    """A sweep step in its three timed phases (``forward``, ``backward``, ``optimizer``,
    which a subclass defines); :meth:`run` is one whole step."""

    def run(self) -> None:
        """One whole step. **Collective**."""
        self.forward()
        self.backward()
        self.optimizer()


class PipelineStep(PhasedStep):
    """``pp{p}[_fsdp{d}]_m{m}`` (see the module docstring). **Collective** to build."""

    def __init__(self, cfg: GPTConfig, batch: int, p: int, d: int, m: int, optimizer: str,
                 lr: float, clip: float) -> None:
        world = MPI.COMM_WORLD
        if p * d != world.size:
            raise ValueError(f"pp{p} x dp{d} needs {p * d} ranks, this job has {world.size}")
        if d > 1:
            self.mesh = dt.init_device_mesh((p, d), mesh_dim_names=("pp", "dp"))
            r, dr = self.mesh.get_coordinate()
        else:
            self.mesh = dt.init_device_mesh((p,), mesh_dim_names=("pp",))
            r, dr = self.mesh.get_coordinate()[0], 0
        dt.manual_seed(0)
        model = GPT(cfg)  # the weights every strategy starts from
        mod = pp.pipeline_split(model, p, stages=[r])[r]
        del model
        if d > 1:
            for block in mod.blocks:
                dt.fully_shard(block, mesh=self.mesh["dp"])
            dt.fully_shard(mod, mesh=self.mesh["dp"])
        self.rank, self.p, self.d = r, p, d
        self.schedule = pp.Schedule1F1B(pp.PipelineStage(mod, r, p, self.mesh["pp"]), m,
                                        _loss_fn)
        idx, tgt = make_batch(cfg, batch, 0)
        per = batch // d
        self.x = dt.tensor(idx[dr * per:(dr + 1) * per].copy())
        self.y = dt.tensor(tgt[dr * per:(dr + 1) * per].copy())
        self.params = list(mod.parameters())
        dup = {names[s] for names in pp.ties_of(mod).values() for s in names
               if s != min(names)}  # a tied parameter's later copies: counted once
        self.norm_params = [q for n, q in mod.named_parameters() if n not in dup]
        self.optimizer_name = optimizer
        self.opt = make_optimizer(optimizer, self.params, lr)
        self.clip = clip
        self.pp_comm = self.mesh["pp"].get_group(0).mpi
        self.losses: list = []
        self.loss: Any = None

    def forward(self) -> None:
        self.opt.zero_grad()
        self.losses = []
        first, last = self.rank == 0, self.rank == self.p - 1
        self.schedule.step(*((self.x,) if first else ()), target=self.y if last else None,
                           losses=self.losses)
        self.loss = self.losses[0] if self.losses else None

    def backward(self) -> None:
        """Nothing: the schedule's backwards ran in :meth:`forward`."""

    def optimizer(self) -> None:
        # the stage's norm (no scaling at an infinite limit), combined over the stages
        own = float(dt.nn.utils.clip_grad_norm_(self.norm_params, math.inf).numpy())
        total = math.sqrt(self.pp_comm.allreduce(own * own))
        coef = self.clip / (total + 1e-6)
        if coef < 1.0:
            with dt.no_grad():
                for q in self.params:
                    if q.grad is not None:
                        g = q.grad
                        (g.to_local() if isinstance(g, dt.DTensor) else g).mul_(coef)
        self.opt.step()

    def loss_value(self) -> float:
        """The global batch's mean loss (every rank holds its replica's micro-batch losses;
        the replicas averaged). **Collective**."""
        mine = float(np.mean([float(v.numpy()) for v in self.losses]))
        return MPI.COMM_WORLD.allreduce(mine) / MPI.COMM_WORLD.size


class ContextStep(PhasedStep):
    """``cp{c}`` (see the module docstring). **Collective** to build."""

    def __init__(self, cfg: GPTConfig, batch: int, c: int, optimizer: str, lr: float,
                 clip: float) -> None:
        world = MPI.COMM_WORLD
        if c != world.size:
            raise ValueError(f"cp{c} runs on all ranks: needs {c}, this job has {world.size}")
        self.mesh = dt.init_device_mesh((c,), mesh_dim_names=("cp",))
        dt.manual_seed(0)
        self.model = GPT(cfg)
        idx, tgt = make_batch(cfg, batch, 0)
        self.i, self.t, self.pos = dt.tensor(idx), dt.tensor(tgt), dt.arange(cfg.block_size)
        n, r = c, self.mesh.get_local_rank(0)
        held = -(-cfg.block_size // n) if r < cfg.block_size % n or not cfg.block_size % n \
            else cfg.block_size // n  # torch.chunk's split of the sequence over the ranks
        self.share = held / cfg.block_size  # this rank's part of the mean loss
        self.ctx = contextlib.ExitStack()
        self.params = list(self.model.parameters())
        self.optimizer_name = optimizer
        self.opt = make_optimizer(optimizer, self.params, lr)
        self.clip = clip
        self.loss: Any = None

    def forward(self) -> None:
        """The forward inside ``dt.context_parallel`` (the buffers hold this rank's chunks
        until the end of :meth:`backward`)."""
        self.opt.zero_grad()
        self.ctx.enter_context(dt.context_parallel(
            self.mesh, buffers=[self.i, self.t, self.pos], buffer_seq_dims=[1, 1, 0]))
        self.loss = self.model(self.i, self.t, positions=self.pos)

    def backward(self) -> None:
        try:
            (self.loss * self.share).backward()
        finally:
            self.ctx.close()

    def optimizer(self) -> None:
        comm = MPI.COMM_WORLD
        for q in self.params:  # each rank's gradient is its tokens' part: summed
            if q.grad is not None:
                g = q.grad.numpy()
                summed = np.empty_like(g, order="C")
                comm.Allreduce(np.ascontiguousarray(g), summed)
                g[...] = summed
        dt.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.opt.step()

    def loss_value(self) -> float:
        """The global batch's mean loss (the ranks' parts summed). **Collective**."""
        return MPI.COMM_WORLD.allreduce(float(self.loss.item()) * self.share)
