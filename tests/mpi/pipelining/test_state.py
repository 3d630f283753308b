"""Checkpoints of a pipelined GPT: ``dt.pipelining.full_state_dict`` + ``dt.save`` after
training steps loads into the local model and into an FSDP model over all ranks (another
strategy) with the weights of the local model trained alike; a checkpoint of the local
model loads into the pipeline's stages by their full names. The oracle: the local model
trained with the same SGD steps on the same batches."""

from __future__ import annotations

import os

import numpy as np
import pytest
from helpers.mpi import sgd_step
from mpi4py import MPI

import dtensor as dt
from dtensor import pipelining as pp
from launch.examples.gpt import GPT, GPTConfig, batch

COMM = MPI.COMM_WORLD
WORLD = COMM.size
F = dt.nn.functional
CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=4, d_model=32)
LR = 0.1
pytestmark = pytest.mark.mpi(min_size=2)


def loss_fn(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))



def _fresh(seed):
    dt.manual_seed(seed)
    return GPT(CFG)


def _stages(model, mesh):
    n = 2 * WORLD if WORLD <= 2 else WORLD
    r, p = mesh.get_coordinate()[0], mesh.size(0)
    mods = pp.pipeline_split(model, n, stages=range(r, n, p))
    return mods, [pp.PipelineStage(mods[s], s, n, mesh) for s in sorted(mods)]


def _full(t):
    return (t.full_tensor() if isinstance(t, dt.DTensor) else t).numpy()


def test_pipelined_checkpoint_loads_into_other_strategies(folder):
    mesh = dt.init_device_mesh((WORLD,), mesh_dim_names=("pp",))
    ref = _fresh(1)
    mods, stages = _stages(ref, mesh)
    sched = pp.ScheduleInterleaved1F1B(stages, 2, loss_fn)
    n = sched.num_stages
    for step in range(2):
        x, y = batch(CFG, 8, step)
        sched.step(*((x,) if 0 in mods else ()), target=y if n - 1 in mods else None)
        for mod in mods.values():
            sgd_step(mod.parameters(), LR)
        ref(dt.tensor(x), dt.tensor(y)).backward()
        sgd_step(ref.parameters(), LR)
    full = pp.full_state_dict(stages)
    assert set(full) == set(ref.state_dict())
    path = os.path.join(folder, "pipelined")
    dt.save(full, path)

    local = _fresh(2)
    dt.load(local.state_dict(), path)
    for name, p in ref.named_parameters():
        np.testing.assert_allclose(local.get_parameter(name).numpy(), p.numpy(),
                                   rtol=1e-5, atol=1e-7, err_msg=name)
    assert local.head.weight is local.tok_emb.weight

    sharded = _fresh(3)
    world = dt.init_device_mesh((WORLD,))
    for block in sharded.blocks:
        dt.fully_shard(block, mesh=world)
    dt.fully_shard(sharded, mesh=world)
    dt.load(sharded.state_dict(), path)
    for name, p in ref.named_parameters():
        np.testing.assert_allclose(_full(sharded.get_parameter(name)), p.numpy(),
                                   rtol=1e-5, atol=1e-7, err_msg=name)


def test_local_checkpoint_loads_into_the_stages(folder):
    mesh = dt.init_device_mesh((WORLD,), mesh_dim_names=("pp",))
    ref = _fresh(4)
    path = os.path.join(folder, "local")
    dt.save(ref.state_dict(), path)
    mods, _ = _stages(_fresh(5), mesh)
    for mod in mods.values():
        dt.load(mod.state_dict(), path)
        for name, p in mod.named_parameters():
            np.testing.assert_array_equal(p.numpy(), ref.get_parameter(name).numpy(), name)
