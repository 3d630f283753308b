"""The GPT tiny config on a 3-D ``(pp, dp, tp)`` mesh: pipelined over ``pp`` (1F1B, 2
micro-batches), each stage tensor-parallel over ``tp`` (the Megatron plan,
``parallelize_module``) and ``fully_shard``-ed over ``dp`` (each dp rank feeds its part of
the batch), gives the local model's losses (averaged over dp) and gradients (full tensors
of the sharded ones), float32 rtol 1e-5, over 3 SGD steps.

The mesh shapes come from the world size, every one of them run (nothing skipped): 1 rank
(1, 1, 1); 2 ranks (2, 1, 1) and (1, 1, 2); 3 ranks (3, 1, 1) and (1, 3, 1); 4 ranks
(2, 2, 1), (2, 1, 2) and (1, 2, 2); 8 ranks (by hand, oversubscribed) (2, 2, 2). A mesh
dim of size 1 still gets its style (DTensor parameters on a one-rank mesh), so every
shape composes all three.
"""

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
BATCH = 12  # divides over dp = 1..4 ranks, then into 2 micro-batches
LR = 0.1
SHAPES = {
    1: [(1, 1, 1)],
    2: [(2, 1, 1), (1, 1, 2)],
    3: [(3, 1, 1), (1, 3, 1)],
    4: [(2, 2, 1), (2, 1, 2), (1, 2, 2)],
    8: [(2, 2, 2)],
}
pytestmark = pytest.mark.mpi(min_size=1)


def loss_fn(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _full(t):
    return (t.full_tensor() if isinstance(t, dt.DTensor) else t).numpy()


def _run(shape: tuple[int, int, int]) -> None:
    n_pp, n_dp, _ = shape
    mesh = dt.init_device_mesh(shape, mesh_dim_names=("pp", "dp", "tp"))
    dt.manual_seed(11)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=4, d_model=32))
    r, data_rank, _ = mesh.get_coordinate()
    mod = pp.pipeline_split(model, n_pp, stages=[r])[r]
    dt.parallelize_module(mod, mesh["tp"], tp_plan())
    for block in getattr(mod, "blocks", ()):
        dt.fully_shard(block, mesh=mesh["dp"])
    dt.fully_shard(mod, mesh=mesh["dp"])
    sched = pp.Schedule1F1B(pp.PipelineStage(mod, r, n_pp, mesh["pp"]), 2, loss_fn)
    per = BATCH // n_dp
    for step in range(3):
        x, y = batch(model.cfg, BATCH, step)
        xs, ys = x[data_rank * per:(data_rank + 1) * per], y[data_rank * per:(data_rank + 1) * per]
        losses: list = []
        sched.step(*((xs,) if r == 0 else ()), target=ys if r == n_pp - 1 else None,
                   losses=losses)
        mine = np.mean([float(v.numpy()) for v in losses])
        got = mesh["dp"].get_group(0).mpi.allreduce(mine) / n_dp  # the mean over dp
        ref = model(dt.tensor(x), dt.tensor(y))
        ref.backward()
        np.testing.assert_allclose(got, float(ref.numpy()), rtol=1e-5,
                                   err_msg=f"mesh {shape} step {step}")
        names = [name for name, _ in mod.named_parameters()]
        assert names, f"mesh {shape}: stage {r} holds no parameters"
        for name, p in mod.named_parameters():
            np.testing.assert_allclose(_full(p.grad), model.get_parameter(name).grad.numpy(),
                                       rtol=1e-5, atol=1e-6,
                                       err_msg=f"mesh {shape} stage {r} step {step} {name}")
        sgd_step(mod.parameters(), LR)
        sgd_step(model.parameters(), LR)


def test_gpt_on_a_pp_dp_tp_mesh_matches_the_local_model():
    shapes = SHAPES.get(WORLD.size)
    assert shapes is not None, f"no (pp, dp, tp) shapes for {WORLD.size} ranks: {SHAPES}"
    for shape in shapes:
        _run(shape)


@pytest.mark.mpi(min_size=2)
def test_fsdp_over_tp_on_one_stage_involves_only_that_stages_ranks():
    """Regression: ``fully_shard`` of a tensor-parallel module built its ``(tp, dp)`` mesh
    with an all-gather over every rank and required dp x tp to be the whole world, so on a
    ``(pp, dp, tp)`` mesh it refused (or waited for stages that shard nothing, or other
    modules)."""
    n = WORLD.size
    shape = (2, 1, 2) if n == 4 else (n, 1, 1)
    mesh = dt.init_device_mesh(shape, mesh_dim_names=("pp", "dp", "tp"))
    if mesh.get_coordinate()[0] != 0:  # the other stages shard nothing at all
        return
    dt.manual_seed(3)
    lin = dt.nn.Linear(8, 6)
    w, b = lin.weight.numpy().copy(), lin.bias.numpy().copy()
    dt.parallelize_module(lin, mesh["tp"], dt.ColwiseParallel(use_local_output=False))
    dt.fully_shard(lin, mesh=mesh["dp"])
    assert lin.weight.device_mesh.shape == (shape[2], shape[1])
    assert lin.weight.device_mesh.mesh_dim_names == ("tp", "dp")
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    out = lin(dt.tensor(x))
    assert isinstance(out, dt.DTensor)
    np.testing.assert_allclose(out.full_tensor().numpy(), x @ w.T + b, rtol=1e-5, atol=1e-6)
