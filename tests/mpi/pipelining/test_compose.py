"""The pipeline beside FSDP or TP on 2x2 meshes at 4 ranks: ``(pp, dp)`` with every stage
``fully_shard``-ed over ``dp`` (each dp rank feeds half the batch), ``(pp, tp)`` with the
Megatron plan of the blocks over ``tp``; every schedule (GPipe, 1F1B, interleaved 1F1B and
zero-bubble, one stage per rank) over 2 stages of the GPT tiny
config give the local model's losses (averaged over dp) and gradients (full tensors of
the sharded ones), float32 rtol 1e-5, for 3 SGD steps."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.mpi import sgd_step
from mpi4py import MPI

import dtensor as dt
from dtensor import pipelining as pp
from launch.examples.gpt import GPT, GPTConfig, batch, tp_plan

WORLD = MPI.COMM_WORLD
F = dt.nn.functional
BATCH = 8
LR = 0.1
pytestmark = pytest.mark.mpi(min_size=4)


def loss_fn(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _full(t):
    return (t.full_tensor() if isinstance(t, dt.DTensor) else t).numpy()


@pytest.mark.parametrize("schedule", [pp.Schedule1F1B, pp.ScheduleGPipe, pp.ScheduleInterleavedZeroBubble, pp.ScheduleInterleaved1F1B])
@pytest.mark.parametrize("other", ["dp", "tp"])
def test_pipeline_with_fsdp_or_tp(other, schedule):
    if WORLD.size != 4:
        pytest.skip("the 2x2 mesh needs 4 ranks")
    mesh = dt.init_device_mesh((2, 2), mesh_dim_names=("pp", "other"))
    dt.manual_seed(11)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, d_model=32))
    r = mesh.get_coordinate()[0]
    mod = pp.pipeline_split(model, 2, stages=[r])[r]
    if other == "dp":
        for block in mod.blocks:
            dt.fully_shard(block, mesh=mesh["other"])
        dt.fully_shard(mod, mesh=mesh["other"])
        n_data, data_rank = 2, mesh.get_coordinate()[1]
    else:
        dt.parallelize_module(mod, mesh["other"], tp_plan())
        n_data, data_rank = 1, 0
    sched = schedule(pp.PipelineStage(mod, r, 2, mesh["pp"]), 2, loss_fn)
    per = BATCH // n_data
    for step in range(3):
        x, y = batch(model.cfg, BATCH, step)
        xs, ys = x[data_rank * per:(data_rank + 1) * per], y[data_rank * per:(data_rank + 1) * per]
        losses = []
        sched.step(*((xs,) if r == 0 else ()), target=ys if r == 1 else None, losses=losses)
        mine = np.mean([float(v.numpy()) for v in losses])
        # the mean over the data-parallel replicas (ranks of one pp coordinate)
        got = mesh["other"].get_group(0).mpi.allreduce(mine) / 2 if n_data == 2 else mine
        ref = model(dt.tensor(x), dt.tensor(y))
        ref.backward()
        np.testing.assert_allclose(got, float(ref.numpy()), rtol=1e-5)
        for name, p in mod.named_parameters():
            np.testing.assert_allclose(_full(p.grad), model.get_parameter(name).grad.numpy(),
                                       rtol=1e-5, atol=1e-6, err_msg=f"{other} stage {r} {name}")
        sgd_step(mod.parameters(), LR)
        sgd_step(model.parameters(), LR)
