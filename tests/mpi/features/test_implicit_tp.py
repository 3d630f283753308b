"""A tensor-parallel GPT written without a single reduce: ``dt.distribute_module`` lays the
weights out as Megatron does (column-parallel ``Shard(0)``, row-parallel ``Shard(1)``,
everything else replicated) and the dispatcher chooses every collective. Per block it must
choose Megatron's pattern: one all-reduce of the activation in forward after each
row-parallel layer, one in backward per branch, nothing else (no gathers of activations,
no reduce-scatters, no moves of gradients), with the loss and gradients of torch's twin of the GPT, at
1-4 ranks. And ``distribute_module``'s own contract: default replication, tied parameters
kept tied, input and output functions, typed errors."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import dtensor as dt
from dtensor.errors import ArgumentError, MeshError
from launch.bench.implicit_tp import megatron_partition
from launch.examples.gpt import GPT, GPTConfig, batch

WORLD = MPI.COMM_WORLD
# 12 heads and a 192-wide MLP: whole heads on every rank at 1-4 ranks
CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=12, d_model=48)
BATCH = 4
def _models():
    dt.manual_seed(0)
    local = GPT(CFG)
    dt.manual_seed(0)
    model = GPT(CFG)
    mesh = dt.init_device_mesh((WORLD.size,))
    dt.distribute_module(model, mesh, megatron_partition)
    return local, model, mesh


@pytest.mark.torch
@pytest.mark.mpi(min_size=1)
def test_dispatcher_chooses_megatrons_collectives():
    local, model, mesh = _models()
    # the tied head is still the embedding, replicated
    assert model.head.weight is model.tok_emb.weight
    assert model.tok_emb.weight.placements == (dt.Replicate(),)
    assert model.blocks[0].attn.wq.weight.placements == (dt.Shard(0),)
    assert model.blocks[0].mlp.proj.weight.placements == (dt.Shard(1),)
    idx, tgt = batch(CFG, BATCH, 0)
    rep = [dt.Replicate()]
    i_d = dt.distribute_tensor(dt.tensor(idx), mesh, rep)
    t_d = dt.distribute_tensor(dt.tensor(tgt), mesh, rep)
    for step in range(2):  # the second step runs from the propagation cache
        with dt.debug.CommDebugMode() as mode:
            loss = model(i_d, t_d)
            loss.backward()
        counts = mode.get_comm_counts()
        if WORLD.size > 1:
            # Megatron: 2 all-reduces of the (B, S, d) activation per block forward, 2 back
            act = BATCH * CFG.block_size * CFG.d_model * 4
            assert counts == {"all_reduce": 4 * CFG.n_layer}, (step, mode.table())
            assert mode.get_total_bytes() == 4 * CFG.n_layer * act, (step, mode.table())
            by_phase = {}
            for r in mode.records:
                by_phase[r.phase] = by_phase.get(r.phase, 0) + 1
            assert by_phase == {"forward": 2 * CFG.n_layer, "backward": 2 * CFG.n_layer}
        else:
            assert counts == {}
        if step == 0:
            grads = {n: p.grad.full_tensor().numpy() for n, p in model.named_parameters()}
        model.zero_grad()
    # the oracle: torch's twin of the GPT with the same weights
    import torch  # lazy: the oracle (the test is marked torch)

    from launch.bench._torch_gpt import TorchGPT, load_numpy  # lazy: imports torch

    torch.manual_seed(0)
    ref = TorchGPT(CFG)
    load_numpy(ref, {n: p.detach().numpy() for n, p in local.named_parameters()})
    want = ref(torch.from_numpy(idx), torch.from_numpy(tgt))
    want.backward()
    np.testing.assert_allclose(float(loss.full_tensor().item()), float(want.detach()),
                               rtol=1e-5)
    params = dict(ref.named_parameters())
    for n, _ in local.named_parameters():
        np.testing.assert_allclose(grads[n], params[n].grad.numpy(), rtol=2e-4, atol=2e-6,
                                   err_msg=n)


@pytest.mark.mpi(min_size=1)
def test_distribute_module_defaults_hooks_and_errors():
    mesh = dt.init_device_mesh((WORLD.size,))
    dt.manual_seed(1)
    lin = dt.nn.Linear(4, 3)
    want = lin.weight.detach().numpy().copy()
    seen = []

    def inp(module, args, m):
        seen.append(m)
        return tuple(dt.distribute_tensor(a, m, [dt.Replicate()]) for a in args)

    def out(module, y, m):
        return y.full_tensor()

    dt.distribute_module(lin, mesh, input_fn=inp, output_fn=out)
    assert isinstance(lin.weight, dt.DTensor) and lin.weight.placements == (dt.Replicate(),)
    assert isinstance(lin.weight, dt.nn.Parameter) and lin.weight.requires_grad
    np.testing.assert_array_equal(lin.weight.full_tensor().numpy(), want)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    y = lin(dt.tensor(x))
    assert type(y) is dt.Tensor and seen == [mesh]
    np.testing.assert_allclose(y.numpy(), x @ want.T + lin.bias.full_tensor().numpy(),
                               rtol=1e-6)
    for bad in ({"partition_fn": 3}, {"input_fn": "x"}, {"output_fn": 1.0}):
        with pytest.raises(ArgumentError, match=next(iter(bad))):
            dt.distribute_module(dt.nn.Linear(2, 2), mesh, **bad)
    with pytest.raises(MeshError, match="distribute_module"):
        dt.distribute_module(dt.nn.Linear(2, 2), "mesh")
