"""The pipeline schedules against PyTorch: the GPT tiny config in torch (``TorchGPT`` of
``launch/bench/_torch_gpt.py``, the same initial weights) trained by ``torch.optim.SGD`` on
the same batches is the oracle of every schedule runnable at this world size (4
micro-batches, 3 steps): the mean of the pipeline's micro-batch losses is torch's loss and
each stage's gradients are torch's (the tied head's copy: torch's ``tok_emb.weight``
gradient, both uses summed), float32 rtol 1e-5."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import dtensor as dt
from dtensor import pipelining as pp
from launch.examples.gpt import GPT, GPTConfig, batch

WORLD = MPI.COMM_WORLD.Get_size()
F = dt.nn.functional
BATCH, M, STEPS, LR = 8, 4, 3, 0.1
pytestmark = [pytest.mark.torch, pytest.mark.mpi(min_size=1)]
SCHEDULES = {"gpipe": pp.ScheduleGPipe, "1f1b": pp.Schedule1F1B,
             "interleaved": pp.ScheduleInterleaved1F1B,
             "zero_bubble": pp.ScheduleInterleavedZeroBubble}
SINGLE = ("gpipe", "1f1b")
CASES = [(name, n) for name in SCHEDULES for n in sorted({2, 4, WORLD, 2 * WORLD} - {1, 8})
         if ((n == WORLD) if name in SINGLE else (n % WORLD == 0))]


def loss_fn(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _torch_run(cfg, weights):
    """torch's losses and gradients (by name) per step."""
    import torch  # lazy: the oracle (the tests using it are marked torch)

    from launch.bench._torch_gpt import TorchGPT, load_numpy  # lazy: imports torch

    torch.manual_seed(0)
    model = TorchGPT(cfg)
    load_numpy(model, weights)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = []
    for step in range(STEPS):
        x, y = batch(cfg, BATCH, step)
        loss = model(torch.from_numpy(x), torch.from_numpy(y))
        loss.backward()
        out.append((float(loss.detach()),
                    {n: p.grad.numpy().copy() for n, p in model.named_parameters()}))
        opt.step()
        opt.zero_grad()
    return out


@pytest.mark.parametrize(("name", "n_stages"), CASES)
def test_schedule_trains_like_torch(name, n_stages):
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=max(2, n_stages), n_head=4,
                    d_model=32)
    dt.manual_seed(21)
    model = GPT(cfg)
    want = _torch_run(cfg, {n: p.numpy() for n, p in model.named_parameters()})
    mesh = dt.init_device_mesh((WORLD,), mesh_dim_names=("pp",))
    r = mesh.get_coordinate()[0]
    mods = pp.pipeline_split(model, n_stages, stages=range(r, n_stages, WORLD))
    stages = [pp.PipelineStage(mods[s], s, n_stages, mesh) for s in sorted(mods)]
    sched = (SCHEDULES[name](stages[0], M, loss_fn) if name in SINGLE
             else SCHEDULES[name](stages, M, loss_fn))
    for step, (loss, grads) in enumerate(want):
        x, y = batch(cfg, BATCH, step)
        losses = []
        sched.step(*((x,) if 0 in mods else ()), target=y if n_stages - 1 in mods else None,
                   losses=losses)
        np.testing.assert_allclose(np.mean([float(v.numpy()) for v in losses]), loss, rtol=1e-5)
        with dt.no_grad():
            for s, mod in mods.items():
                for pname, p in mod.named_parameters():
                    ref = grads["tok_emb.weight" if pname == "head.weight" else pname]
                    np.testing.assert_allclose(p.grad.numpy(), ref, rtol=1e-5, atol=1e-6,
                                               err_msg=f"step {step} stage {s} {pname}")
                    p -= LR * p.grad
                    p.grad = None
