"""``fully_shard``'s gathered parameters in pooled pages (``DTENSOR_FSDP_POOL``, default on):
steps with the pool equal steps without it and the local model's, the memory figures come
back to the same level after every step, and the pool holds no more pages than the groups
gathered at once."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from mpi4py import MPI

import dtensor as dt
from dtensor.local import allocator as alloc
from launch.examples.gpt import GPTConfig, batch
from launch.examples.gpt_strategies import build

WORLD = MPI.COMM_WORLD
# blocks of one size (their buffers share pool pages), rows that do not split evenly
CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=4, d_model=44, bias=False)
BATCH = 12


def _full(t):
    return (t.full_tensor() if isinstance(t, dt.DTensor) else t).numpy().copy()


def _steps(run, steps=3):
    """Per step: the loss, the full gradients, allocated and reserved bytes after it."""
    out = []
    opt = dt.optim.SGD(run.model.parameters(), lr=0.1)
    for step in range(steps):
        idx, tgt = batch(CFG, BATCH, step)
        loss = run.model(*run.inputs(idx, tgt))
        loss.backward()
        grads = {n: _full(p.grad) for n, p in run.model.named_parameters()}
        opt.step()
        opt.zero_grad()
        value = run.loss_value(loss)
        del loss
        gc.collect()
        stats = dt.memory_stats()
        out.append((value, grads, stats["allocated_bytes"], stats["reserved_bytes"]))
    return out


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", ["fsdp", "zero2"])
def test_pooled_gathers_equal_unpooled_and_local_steps(name, monkeypatch):
    local = _steps(build("local", CFG))
    monkeypatch.setenv("DTENSOR_FSDP_POOL", "0")
    plain = _steps(build(name, CFG))
    monkeypatch.setenv("DTENSOR_FSDP_POOL", "1")
    run = build(name, CFG)
    groups = [b._fsdp_state for b in run.model.blocks] + [run.model._fsdp_state]
    if alloc._PAGES.libc is not None:
        assert all(g.buffer.pooled for g in groups)
    pooled = _steps(run)
    for (lp, lg, *_), (pp, pg, *_), (qp, qg, *_) in zip(local, plain, pooled):
        assert qp == pp  # the same gathers into reused pages: the same bits
        for key in pg:
            np.testing.assert_array_equal(qg[key], pg[key], err_msg=key)
            np.testing.assert_allclose(qg[key], lg[key], rtol=2e-4, atol=2e-6, err_msg=key)
        assert abs(qp - lp) < 1e-5 * max(1.0, abs(lp))


@pytest.mark.mpi(min_size=1)
def test_pooled_memory_comes_back_to_the_same_level_every_step(monkeypatch):
    committed: dict[int, int] = {}  # page-rounded size -> pooled buffers committed now
    most: dict[int, int] = {}
    commit, release = alloc.ReleasableBuffer.commit, alloc.ReleasableBuffer.release

    def counting_commit(self):
        if self.pooled and not self.committed:
            n = committed[self._length] = committed.get(self._length, 0) + 1
            most[self._length] = max(most.get(self._length, 0), n)
        commit(self)

    def counting_release(self):
        if self.pooled and self.committed:
            committed[self._length] -= 1
        release(self)

    monkeypatch.setattr(alloc.ReleasableBuffer, "commit", counting_commit)
    monkeypatch.setattr(alloc.ReleasableBuffer, "release", counting_release)
    gc.collect()  # earlier models' buffers, and the pages they left waiting, go first
    dt.empty_cache()
    run = build("fsdp", CFG)
    steps = _steps(run, steps=4)
    allocated = [a for _, _, a, _ in steps]
    reserved = [r for _, _, _, r in steps]
    assert allocated[1:] == allocated[1:2] * 3  # the same after every step
    assert reserved[1:] == reserved[1:2] * 3  # the pool does not grow step by step
    groups = [b._fsdp_state for b in run.model.blocks]
    assert not any(g.buffer.committed for g in groups)
    if alloc._PAGES.libc is None:
        return
    length = groups[0].buffer._length
    with alloc._PAGES.lock:
        waiting = len(alloc._PAGES.free.get(length, []))
    # the blocks' pages: as many as were gathered at once (the running block, the one
    # prefetched, the one before whose gradients are still being reduced), not one per block
    assert waiting == most[length] < CFG.n_layer
    del run, groups
    gc.collect()
    with alloc._PAGES.lock:  # the last buffers of that size gone: their pages went back
        assert length not in alloc._PAGES.free
