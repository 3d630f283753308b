"""The GPT of :mod:`launch.examples.gpt` under every parallel strategy: one function builds
the model laid out as a strategy says and tells which slice of a global batch this rank
feeds it. The strategy tests, the training example and the benchmarks share it.

Strategies (``STRATEGIES``):

* ``local``: the whole model and batch on every rank, no communication;
* ``dp``: DTensor data parallelism: parameters ``Replicate()`` DTensors, the batch a
  ``Shard(0)`` DTensor (the dispatcher all-reduces each parameter's gradient);
* ``replicate``: ``dt.replicate`` (DDP: bucketed, asynchronous gradient all-reduce);
* ``fsdp`` (ZeRO-3), ``zero2`` (``reshard_after_forward=False``), ``fsdp_int``
  (``reshard_after_forward=2``, an even number of ranks >= 4): ``dt.fully_shard`` on every
  block, then on the root;
* ``tp``, ``tp_sp``: Megatron tensor parallelism of the blocks, without and with sequence
  parallelism;
* ``fsdp_tp`` (4 ranks): TP on ``mesh["tp"]`` of a 2x2 ``(dp, tp)`` mesh, then FSDP on
  ``mesh["dp"]``;
* ``hsdp`` (4 ranks): ``fully_shard`` on a 2x2 ``(replicate, shard)`` mesh.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import dtensor as dt
from launch.examples.gpt import GPT, GPTConfig, tp_plan

STRATEGIES = ("local", "dp", "replicate", "fsdp", "zero2", "fsdp_int", "tp", "tp_sp",
              "fsdp_tp", "hsdp")


def supported(name: str, world: int) -> bool:
    """Whether strategy ``name`` runs at ``world`` ranks. **Local**."""
    if name in ("fsdp_tp", "hsdp"):
        return world == 4
    if name == "fsdp_int":
        return world >= 4 and world % 2 == 0
    return name in STRATEGIES


@dataclass
class Run:
    """A model under a strategy: ``model``; ``n_data`` data-parallel replicas and this
    rank's index ``data_rank`` among them; ``mesh`` the strategy's mesh (None for local)."""

    name: str
    model: Any
    n_data: int
    data_rank: int
    mesh: Any = None

    def inputs(self, idx: Any, targets: Any) -> tuple:
        """This rank's model inputs from a global batch (numpy int arrays, the same on every
        rank). **Local** (``dp``: builds DTensors from local shards, no communication)."""
        b = idx.shape[0]
        if b % self.n_data:
            raise ValueError(f"{self.name}: a batch of {b} does not split over {self.n_data}")
        per = b // self.n_data
        lo, hi = self.data_rank * per, (self.data_rank + 1) * per
        if self.name == "dp":
            shape = tuple(idx.shape)
            return (dt.DTensor.from_local(dt.tensor(idx[lo:hi].copy()), self.mesh,
                                          [dt.Shard(0)], shape=shape),
                    dt.DTensor.from_local(dt.tensor(targets[lo:hi].copy()), self.mesh,
                                          [dt.Shard(0)], shape=shape))
        return dt.tensor(idx[lo:hi].copy()), dt.tensor(targets[lo:hi].copy())

    def loss_value(self, loss: Any) -> float:
        """The global batch's mean loss as a float (the data-parallel ranks' losses
        averaged). **Collective** over the data-parallel ranks."""
        if isinstance(loss, dt.DTensor):
            return float(loss.full_tensor().item())
        value = float(loss.item())
        if self.n_data == 1:
            return value
        from mpi4py import MPI  # lazy: launch-side MPI for one number

        return MPI.COMM_WORLD.allreduce(value) / MPI.COMM_WORLD.size


def _fsdp(model: GPT, mesh: Any, mp: Any, **kw: Any) -> None:
    for block in model.blocks:
        dt.fully_shard(block, mesh=mesh, mp_policy=mp, **kw)
    dt.fully_shard(model, mesh=mesh, mp_policy=mp, **kw)


def _checkpointed(model: GPT) -> None:
    """Activation checkpointing: every block recomputed in backward."""
    for i, block in enumerate(model.blocks):
        model.blocks[i] = dt.nn.checkpoint_wrapper(block)


FSDP = ("fsdp", "zero2", "fsdp_int", "fsdp_tp", "hsdp")


def build(name: str, cfg: GPTConfig, seed: int = 0, mp_policy: Any = None,
          bucket_cap_mb: float = 25, ac: bool = False, dtype: Any = None) -> Run:
    """The GPT of ``cfg`` (initialized from ``seed``: the same global weights under every
    strategy) laid out as strategy ``name``; ``ac``: activation checkpointing of every
    block (after tensor parallelism, before ``fully_shard``); ``dtype``: the parameters'
    dtype (under FSDP: the gather and compute dtype of a ``MixedPrecisionPolicy`` with
    float32 master weights and reductions, unless ``mp_policy`` is given). **Collective**
    (except ``local``)."""
    from mpi4py import MPI  # lazy: launch-side MPI for the world size

    world, rank = MPI.COMM_WORLD.size, MPI.COMM_WORLD.rank
    if not supported(name, world):
        raise ValueError(f"strategy {name!r} does not run at {world} ranks")
    dt.manual_seed(seed)
    model = GPT(cfg)
    if dtype is not None and name in FSDP:
        mp_policy = mp_policy or dt.MixedPrecisionPolicy(param_dtype=dtype,
                                                         reduce_dtype="float32")
    elif dtype is not None:
        model.to(dtype)
    if name == "local":
        if ac:
            _checkpointed(model)
        return Run(name, model, 1, 0)
    if name in ("fsdp_tp", "hsdp"):
        mesh = dt.init_device_mesh((2, 2), mesh_dim_names=("dp", "tp"))
        if name == "hsdp":
            if ac:
                _checkpointed(model)
            _fsdp(model, mesh, mp_policy)
            return Run(name, model, 4, rank, mesh)
        dt.parallelize_module(model, mesh["tp"], tp_plan())
        if ac:
            _checkpointed(model)
        _fsdp(model, mesh["dp"], mp_policy)
        return Run(name, model, 2, mesh["dp"].get_local_rank(), mesh)
    mesh = dt.init_device_mesh((world,))
    if ac and name not in ("tp", "tp_sp"):
        _checkpointed(model)
    if name == "dp":
        for mod in model.modules():
            for pname, p in list(mod._parameters.items()):
                if p is not None and not isinstance(p, dt.DTensor):
                    d = dt.nn.Parameter(dt.distribute_tensor(p, mesh, [dt.Replicate()]))
                    for other in model.modules():  # the tied head too
                        for oname, q in list(other._parameters.items()):
                            if q is p:
                                other._parameters[oname] = d
        return Run(name, model, world, rank, mesh)
    if name == "replicate":
        dt.replicate(model, mesh, bucket_cap_mb=bucket_cap_mb)
        return Run(name, model, world, rank, mesh)
    if name in ("fsdp", "zero2", "fsdp_int"):
        raf = {"fsdp": True, "zero2": False, "fsdp_int": 2}[name]
        _fsdp(model, mesh, mp_policy, reshard_after_forward=raf)
        return Run(name, model, world, rank, mesh)
    dt.parallelize_module(model, mesh, tp_plan(sequence_parallel=name == "tp_sp"))
    if ac:
        _checkpointed(model)
    return Run(name, model, 1, 0, mesh)
