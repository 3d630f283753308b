"""The GPT of ``launch/examples/gpt.py`` under every parallel strategy (DTensor data
parallelism, ``replicate``, FSDP ZeRO-3 / ZeRO-2 / reshard to 2 ranks, TP, TP+SP,
FSDP x TP and HSDP on 2x2) at 1-4 ranks, and the local model: 20 AdamW steps give torch's
losses, first gradients and final ``state_dict`` (the same GPT in torch, same initial
weights, ``torch.optim.AdamW``); CommDebugMode counts per step are the
theory's; bfloat16 mixed precision stays within bfloat16 tolerance; gradient accumulation
without sync; ``fully_shard``'s memory states and its errors."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import dtensor as dt
from dtensor.errors import ArgumentError, DTypeError, MeshError
from launch.examples.gpt import GPT, GPTConfig, batch
from launch.examples.gpt_strategies import STRATEGIES, build, supported

WORLD = MPI.COMM_WORLD
# 12 heads and a 192-wide MLP split evenly over 1-4 tensor-parallel ranks
CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=12, d_model=48, bias=False)
BATCH = 12  # sequences per step: splits over 1, 2, 3 and 4 data-parallel ranks
STEPS = 20
LR = 1e-2
HERE = [s for s in STRATEGIES if s != "local" and supported(s, WORLD.size)]


def _full(t):
    """The global values of ``t``, a copy (clipping scales gradients in place)."""
    return (t.full_tensor() if isinstance(t, dt.DTensor) else t).numpy().copy()


def _counts(mode):
    out = {}
    for r in mode.records:
        out[r.kind] = out.get(r.kind, 0) + 1
    return out


def _train(run, steps=STEPS):
    """Losses of ``steps`` AdamW steps (gradients clipped to norm 0.5), the gradients after
    the first backward and every step's gradient norm (``"norms"``), the final state_dict
    (full arrays)."""
    opt = dt.optim.AdamW(run.model.parameters(), lr=LR)
    losses, first = [], None
    for step in range(steps):
        idx, tgt = batch(CFG, BATCH, step)
        loss = run.model(*run.inputs(idx, tgt))
        loss.backward()
        if first is None:
            first = {n: _full(p.grad) for n, p in run.model.named_parameters()}
        # the global norm, whatever the gradients' layouts; it clips the first steps
        norm = dt.nn.utils.clip_grad_norm_(run.model.parameters(), 0.5)
        first.setdefault("norms", []).append(float(norm.numpy()))
        opt.step()
        opt.zero_grad()
        losses.append(run.loss_value(loss))
    state = {k: _full(v) for k, v in run.model.state_dict().items()}
    return np.array(losses), first, state


def _torch_model():
    """The oracle's model: ``TorchGPT`` of ``launch/bench/_torch_gpt.py`` with the local
    model's initial weights, dtensor's parameter names and state keys."""
    import torch  # lazy: the oracle (the tests using it are marked torch)

    from launch.bench._torch_gpt import TorchGPT, load_numpy  # lazy: imports torch

    start = build("local", CFG).model
    torch.manual_seed(0)
    model = TorchGPT(CFG)
    load_numpy(model, {n: p.detach().numpy() for n, p in start.named_parameters()})
    return model, [n for n, _ in start.named_parameters()], list(start.state_dict())


def _torch_grads(model, names, seed):
    """torch's gradients (dtensor's names -> arrays) of the loss of ``batch`` ``seed``."""
    import torch  # lazy: the oracle (the tests using it are marked torch)

    idx, tgt = batch(CFG, BATCH, seed)
    model(torch.from_numpy(idx), torch.from_numpy(tgt)).backward()
    params = dict(model.named_parameters())
    return {n: params[n].grad.numpy().copy() for n in names}


def _torch_train(steps=STEPS):
    """The oracle: ``_train`` in torch (``torch.optim.AdamW``, torch's clipping)."""
    import torch  # lazy: the oracle (the tests using it are marked torch)

    model, names, keys = _torch_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, first = [], None
    for step in range(steps):
        idx, tgt = batch(CFG, BATCH, step)
        loss = model(torch.from_numpy(idx), torch.from_numpy(tgt))
        loss.backward()
        if first is None:
            params = dict(model.named_parameters())
            first = {n: params[n].grad.numpy().copy() for n in names}
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        first.setdefault("norms", []).append(float(norm))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    state = model.state_dict()
    return np.array(losses), first, {k: state[k].numpy().copy() for k in keys}


@pytest.fixture(scope="module")
def oracle():
    return _torch_train()


@pytest.mark.torch
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", ["local", *HERE])
def test_strategy_trains_like_torch(name, oracle):
    want_losses, want_grads, want_state = oracle
    losses, grads, state = _train(build(name, CFG))
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert grads.keys() == want_grads.keys()
    assert want_grads["norms"][0] > 0.5  # clipping happened
    # the norms of later steps carry the float noise of earlier Adam steps (see below)
    np.testing.assert_allclose(grads.pop("norms"), want_grads["norms"], rtol=1e-4)
    for k, g in grads.items():
        np.testing.assert_allclose(g, want_grads[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert state.keys() == want_state.keys()
    # Adam steps by m / sqrt(v): for an element whose gradients are float noise (about 1e-7
    # of the largest), the step is lr times the noise's sign; 20 steps of lr 1e-2 then move
    # such an element by up to a few 1e-4 however the sums are ordered
    for k, v in state.items():
        np.testing.assert_allclose(v, want_state[k], rtol=1e-4, atol=5e-4, err_msg=k)


L = CFG.n_layer
#: collectives per training step (forward + backward) by strategy: FSDP gathers every group
#: (L blocks + the root) before forward and every block again before backward (ZeRO-3; the
#: root keeps its parameters), reduce-scatters each group once; HSDP adds an all-reduce
#: over the replicate dim per group. Tensor parallelism: forward only (two all-reduces per
#: block; with sequence parallelism an all-gather before attention and MLP and before the
#: final norm, a reduce-scatter after each).
THEORY = {
    "fsdp": ("step", {"all_gather": 2 * L + 1, "reduce_scatter": L + 1}),
    "fsdp_int": ("step", {"all_gather": 2 * L + 1, "reduce_scatter": L + 1}),
    "zero2": ("step", {"all_gather": L + 1, "reduce_scatter": L + 1}),
    "hsdp": ("step", {"all_gather": 2 * L + 1, "reduce_scatter": L + 1, "all_reduce": L + 1}),
    "tp": ("forward", {"all_reduce": 2 * L}),
    "tp_sp": ("forward", {"all_gather": 2 * L + 1, "reduce_scatter": 2 * L}),
}


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", [s for s in THEORY if s in HERE])
def test_comm_counts_per_step_equal_the_theory(name):
    what, want = THEORY[name]
    if name.startswith("tp") and WORLD.size == 1:
        want = {}  # a 1-rank mesh moves nothing
    run = build(name, CFG)
    idx, tgt = batch(CFG, BATCH, 0)
    for _ in range(2):  # the second step runs with the forward order known (prefetch)
        with dt.debug.CommDebugMode() as mode:
            loss = run.model(*run.inputs(idx, tgt))
            if what == "step":
                loss.backward()
        assert _counts(mode) == want
        if what != "step":
            loss.backward()


@pytest.mark.torch
@pytest.mark.mpi(min_size=1)
def test_fsdp_bfloat16_mixed_precision_stays_within_bfloat16_tolerance(oracle):
    want_losses = oracle[0][:6]  # torch, float32
    mp = dt.MixedPrecisionPolicy(param_dtype=dt.bfloat16, reduce_dtype=np.float32)
    run = build("fsdp", CFG, mp_policy=mp)
    p = run.model.blocks[0].mlp.fc.weight
    assert p.dtype == np.float32  # float32 master weights
    losses, grads, _ = _train(run, steps=6)
    assert grads["blocks.0.mlp.fc.weight"].dtype == np.float32
    np.testing.assert_allclose(losses, want_losses, rtol=2e-2)
    # a local bfloat16 run of the same model
    dt.manual_seed(0)
    model = GPT(CFG).to(dt.bfloat16)
    opt = dt.optim.AdamW(model.parameters(), lr=LR)
    for step in range(6):
        idx, tgt = batch(CFG, BATCH, step)
        loss = model(dt.tensor(idx), dt.tensor(tgt))
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert abs(float(loss.item()) - losses[step]) <= 3e-2 * abs(losses[step])


@pytest.mark.torch
@pytest.mark.mpi(min_size=1)
def test_fsdp_gradient_accumulation_without_sync_equals_the_big_batch():
    run = build("fsdp", CFG)
    model, names, _ = _torch_model()
    want = _torch_grads(model, names, 3)  # torch, the whole batch at once
    idx, tgt = batch(CFG, BATCH, 3)
    x, y = run.inputs(idx, tgt)
    n = x.shape[0]
    half = n // 2  # micro-batches weighted by their share of this rank's batch
    parts = [(x[:half], y[:half], half / n), (x[half:], y[half:], (n - half) / n)]
    run.model.set_requires_gradient_sync(False)
    with dt.debug.CommDebugMode() as mode:
        (run.model(*parts[0][:2]) * parts[0][2]).backward()
    assert "reduce_scatter" not in _counts(mode)
    assert all(p.grad is None for p in run.model.parameters())
    run.model.set_requires_gradient_sync(True)
    (run.model(*parts[1][:2]) * parts[1][2]).backward()
    for n, p in run.model.named_parameters():
        np.testing.assert_allclose(_full(p.grad), want[n], rtol=1e-5, atol=1e-6, err_msg=n)


@pytest.mark.mpi(min_size=1)
def test_fsdp_frees_gathered_parameters_as_each_mode_says():
    import gc

    from dtensor.local.allocator import memory_stats

    for raf in (True, False):
        run = build("fsdp" if raf else "zero2", CFG)
        model = run.model
        blocks = [b._fsdp_state for b in model.blocks]
        assert all(not g.buffer.committed for g in blocks)  # sharded at rest
        idx, tgt = batch(CFG, BATCH, 0)
        loss = model(*run.inputs(idx, tgt))
        # ZeRO-3 gives a block's gathered parameters back after its forward, ZeRO-2 keeps them
        assert all(g.buffer.committed is (not raf) for g in blocks)
        assert model._fsdp_state.buffer.committed  # the root keeps its own for backward
        loss.backward()
        assert not any(g.buffer.committed for g in blocks + [model._fsdp_state])
        del loss
        gc.collect()  # the backward's garbage goes first
        before = memory_stats()["allocated_bytes"]
        model.blocks[0].unshard()
        grown = memory_stats()["allocated_bytes"] - before
        assert grown == blocks[0].buffer.nbytes > 0
        w = model.blocks[0].mlp.fc.weight
        assert isinstance(w, dt.DTensor) and w.placements[-1] == dt.Shard(0)
        model.blocks[0].reshard()
        # the buffer's bytes are given back (other garbage of earlier tests may go too)
        assert memory_stats()["allocated_bytes"] <= before


@pytest.mark.mpi(min_size=1)
def test_fsdp_errors_name_the_module_and_change_nothing():
    mesh = dt.init_device_mesh((WORLD.size,))
    dt.manual_seed(0)
    model = GPT(CFG)
    dt.fully_shard(model.blocks[0], mesh=mesh)
    with pytest.raises(ArgumentError, match="Block is already sharded"):
        dt.fully_shard(model.blocks[0], mesh=mesh)
    with pytest.raises(DTypeError, match=r"fully_shard\(Block\): MixedPrecisionPolicy.param_dtype"):
        dt.fully_shard(model.blocks[1], mesh=mesh,
                       mp_policy=dt.MixedPrecisionPolicy(param_dtype=np.int32))
    with pytest.raises(ArgumentError, match="reshard_after_forward"):
        dt.fully_shard(model.blocks[1], mesh=mesh, reshard_after_forward=WORLD.size + 1)
    with pytest.raises(MeshError, match="1-D .* or 2-D"):
        dt.fully_shard(model.blocks[1], mesh=dt.init_device_mesh((WORLD.size, 1, 1)))
    # parameters that already live on the FSDP mesh (another mesh than a tp one)
    tp = dt.parallelize_module(model.blocks[1], mesh, {"mlp.fc": dt.ColwiseParallel()})
    with pytest.raises(MeshError, match=r"mlp.fc.weight already lives on the FSDP mesh"):
        dt.fully_shard(tp, mesh=mesh)
    assert not isinstance(model.blocks[1].ln1.weight, dt.DTensor)  # nothing half-applied
    assert not hasattr(model.blocks[1], "_fsdp_state")
    half = GPT(CFG).to(np.float16)
    half.ln_f.weight = dt.nn.Parameter(dt.ones(CFG.d_model))
    with pytest.raises(DTypeError, match="different dtypes"):
        dt.fully_shard(half, mesh=mesh)
    assert not isinstance(half.tok_emb.weight, dt.DTensor)


@pytest.mark.torch
@pytest.mark.mpi(min_size=1)
def test_fsdp_of_checkpointed_blocks_gives_torchs_gradients(oracle):
    dt.manual_seed(0)
    model = GPT(CFG)
    mesh = dt.init_device_mesh((WORLD.size,))
    for i, block in enumerate(model.blocks):
        model.blocks[i] = dt.fully_shard(dt.nn.checkpoint_wrapper(block), mesh=mesh)
    dt.fully_shard(model, mesh=mesh)
    idx, tgt = batch(CFG, BATCH, 0)
    per = BATCH // WORLD.size
    lo = WORLD.rank * per
    with dt.debug.CommDebugMode() as mode:
        loss = model(dt.tensor(idx[lo:lo + per]), dt.tensor(tgt[lo:lo + per]))
        loss.backward()  # each block's forward runs again in backward, on its gathered weights
    assert _counts(mode) == THEORY["fsdp"][1]
    want = oracle[1]
    for name, p in model.named_parameters():
        key = name.replace("_checkpoint_wrapped_module.", "")
        np.testing.assert_allclose(_full(p.grad), want[key], rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.mpi(min_size=2)
def test_fsdp_shards_hold_no_reference_to_the_full_parameters():
    import gc

    dt.manual_seed(0)
    model = GPT(CFG)
    block = model.blocks[0]
    total = sum(p.numel() * 4 for p in block.parameters())
    gc.collect()
    before = dt.memory_stats()["allocated_bytes"]
    dt.fully_shard(block)
    gc.collect()
    freed = before - dt.memory_stats()["allocated_bytes"]
    # the full parameters go; each rank keeps about 1/n of them (small ones are not pooled)
    assert freed > 0.5 * total * (1 - 1 / WORLD.size), (freed, total)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", ["replicate", "fsdp"])
def test_a_dropped_model_gives_its_memory_back(name):
    import gc

    gc.collect()
    before = dt.memory_stats()["allocated_bytes"]
    run = build(name, CFG)
    opt = dt.optim.AdamW(run.model.parameters(), lr=LR)
    idx, tgt = batch(CFG, BATCH, 0)
    run.model(*run.inputs(idx, tgt)).backward()
    opt.step()
    assert dt.memory_stats()["allocated_bytes"] > before
    del run, opt
    gc.collect()
    # everything the model held is given back (other garbage may go too, never less)
    assert dt.memory_stats()["allocated_bytes"] <= before


@pytest.mark.mpi(min_size=1)
def test_mixed_precision_output_dtype_and_input_cast():
    idx, _ = batch(CFG, BATCH, 0)
    per = BATCH // WORLD.size
    x = dt.tensor(idx[:per])
    mesh = dt.init_device_mesh((WORLD.size,))
    for output_dtype, want in ((None, dt.bfloat16), (np.float32, np.float32)):
        dt.manual_seed(0)
        model = GPT(CFG)
        mp = dt.MixedPrecisionPolicy(param_dtype=dt.bfloat16)
        for block in model.blocks:
            dt.fully_shard(block, mesh=mesh, mp_policy=mp)
        # the root's outputs (the logits) cast to output_dtype
        root_mp = dt.MixedPrecisionPolicy(param_dtype=dt.bfloat16, output_dtype=output_dtype)
        dt.fully_shard(model, mesh=mesh, mp_policy=root_mp)
        seen = []
        model.blocks[0].mlp.fc.register_forward_hook(
            lambda m, a, out, seen=seen: seen.append((a[0].dtype, m.weight.dtype)))
        logits = model(x)
        assert logits.dtype == want
        assert seen == [(dt.bfloat16, dt.bfloat16)]  # computed in param_dtype
        logits.float().sum().backward()
        assert model.blocks[0].mlp.fc.weight.grad.dtype == np.float32


@pytest.mark.mpi(min_size=1)
def test_unshard_async_handle_waits_for_the_gather():
    run = build("fsdp", CFG)
    block = run.model.blocks[1]
    handle = block.unshard(async_op=True)
    handle.wait()
    state = block._fsdp_state
    assert state.unsharded and state.buffer.committed
    full = state.views[0]  # the first parameter, gathered
    want = run.model.blocks[1].ln1.weight.full_tensor().numpy()
    np.testing.assert_array_equal(want, np.ones(CFG.d_model, np.float32))  # LayerNorm's init
    np.testing.assert_array_equal(full, want)
    block.reshard()
    assert not state.buffer.committed
