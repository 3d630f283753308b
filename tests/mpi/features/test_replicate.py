"""Data parallelism (``dt.replicate``, PyTorch's composable DDP) at 1-4 ranks: the GPT of
``launch/examples/gpt.py`` trained under ``replicate`` on each rank's share of a batch
equals the local model trained on the whole batch (losses, gradients, final state dict);
CommDebugMode counts one all-reduce per bucket per step; ``no_sync`` accumulates the
gradient of the micro-batches together; parameters that some or no rank used; and the
errors, raised before anything changes."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import dtensor as dt
from dtensor.errors import ArgumentError, MeshError
from dtensor.parallel import _replicate
from launch.examples.gpt import GPT, GPTConfig, batch

WORLD = MPI.COMM_WORLD
CFG = GPTConfig(vocab_size=48, block_size=8, n_layer=2, n_head=2, d_model=16)
GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4 ranks


@pytest.fixture(params=["start", "submit"])
def path(request, monkeypatch):
    """Both ways a bucket's all-reduce runs asynchronously (the same MPI calls)."""
    monkeypatch.setattr(_replicate, "ASYNC_PATH", request.param)
    return request.param


def _gpt(seed=0):
    dt.manual_seed(seed)
    return GPT(CFG)


def _mine(a):
    """This rank's share of a global batch (equal shares)."""
    n = a.shape[0] // WORLD.size
    return a[WORLD.rank * n:(WORLD.rank + 1) * n]


def _loss(model, idx, tgt):
    return model(dt.tensor(idx), dt.tensor(tgt))


def _torch_gpt(seed=0):
    """The oracle: torch's twin of the GPT (``launch/bench/_torch_gpt.py``) holding
    ``_gpt(seed)``'s weights."""
    import torch  # lazy: the oracle (the tests using it are marked torch)

    from launch.bench._torch_gpt import TorchGPT, load_numpy  # lazy: imports torch

    torch.manual_seed(0)
    model = TorchGPT(CFG)
    load_numpy(model, {n: p.detach().numpy() for n, p in _gpt(seed).named_parameters()})
    return model


def _torch_loss(model, idx, tgt):
    import torch  # lazy: the oracle (the tests using it are marked torch)

    return model(torch.from_numpy(np.ascontiguousarray(idx)),
                 torch.from_numpy(np.ascontiguousarray(tgt)))


def _torch_grads(model, names):
    params = dict(model.named_parameters())
    return {n: params[n].grad.numpy().copy() for n in names}


def _grads(model):
    return {n: p.grad.numpy().copy() for n, p in model.named_parameters()}


def _param_count(model):
    return sum(1 for _ in model.named_parameters())


def _buckets_expected(model, cap_mb):
    """The bucket count replicate's rule gives (written out again here): parameters in
    reverse order, a bucket closed before a parameter would take it past the cap and when it
    reaches the cap (one dtype here)."""
    cap = cap_mb * (1 << 20)
    sizes = [p.numel() * 4 for _, p in model.named_parameters()][::-1]
    count, fill = 0, 0
    for s in sizes:
        if fill and fill + s > cap:
            count, fill = count + 1, 0
        fill += s
        if fill >= cap:
            count, fill = count + 1, 0
    return count + (fill > 0)


@pytest.mark.torch
@pytest.mark.mpi(min_size=1)
def test_replicated_gpt_trains_like_torchs_gpt_on_the_whole_batch(path):
    import torch  # lazy: the oracle (marked torch)

    start = _gpt(0)
    names, keys = [n for n, _ in start.named_parameters()], list(start.state_dict())
    ref = _torch_gpt(0)
    # every rank builds its replica from a different seed: replicate broadcasts rank 0's
    model = dt.replicate(_gpt(WORLD.rank), bucket_cap_mb=0.01)
    assert type(model).__name__ == "ReplicateGPT" and isinstance(model, GPT)
    for (name, p), (_, q) in zip(model.named_parameters(), start.named_parameters()):
        np.testing.assert_array_equal(p.numpy(), q.numpy(), err_msg=name)
    opt_t = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1)
    opt_r = dt.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    for step in range(20):
        idx, tgt = batch(CFG, GLOBAL_BATCH, seed=step)
        opt_t.zero_grad()
        want = _torch_loss(ref, idx, tgt)
        want.backward()
        opt_r.zero_grad()
        loss = _loss(model, _mine(idx), _mine(tgt))
        loss.backward()
        got = WORLD.allreduce(float(loss.item())) / WORLD.size
        np.testing.assert_allclose(got, float(want.detach()), rtol=1e-5, err_msg=f"step {step}")
        if step in (0, 19):
            g_ref, g_rep = _torch_grads(ref, names), _grads(model)
            for name, g in g_ref.items():
                np.testing.assert_allclose(g_rep[name], g, rtol=1e-4, atol=1e-6,
                                           err_msg=f"step {step}: {name}")
        opt_t.step()
        opt_r.step()
    want_sd, got_sd = ref.state_dict(), model.state_dict()
    assert list(got_sd) == keys
    # Adam divides by the gradients' running RMS, so a rounding difference in a near-zero
    # gradient element moves its update by a fraction of lr (3e-3): 4e-6 seen at 2-4 ranks
    for name in keys:
        np.testing.assert_allclose(got_sd[name].numpy(), want_sd[name].numpy(), rtol=1e-5,
                                   atol=1e-5, err_msg=name)
    # the replicas are identical on every rank, bit for bit
    for name, t in got_sd.items():
        ref = WORLD.bcast(t.numpy(), root=0)
        np.testing.assert_array_equal(t.numpy(), ref, err_msg=name)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("cap_mb", [0, 0.004, 0.02, 25])
def test_one_all_reduce_per_bucket_per_step(path, cap_mb):
    model = dt.replicate(_gpt(), bucket_cap_mb=cap_mb)
    opt = dt.optim.SGD(model.parameters(), lr=0.1)
    buckets = _buckets_expected(model, cap_mb)
    if cap_mb == 0:
        assert buckets == _param_count(model)
    if cap_mb == 25:
        assert buckets == 1
    assert 1 < _buckets_expected(model, 0.02) < _buckets_expected(model, 0.004) < _param_count(
        model)
    total = sum(p.numel() * 4 for p in model.parameters())
    for step in range(3):
        idx, tgt = batch(CFG, GLOBAL_BATCH, seed=step)
        with dt.debug.CommDebugMode() as mode:
            opt.zero_grad()
            _loss(model, _mine(idx), _mine(tgt)).backward()
            opt.step()
        assert mode.get_comm_counts() == {"all_reduce": buckets}
        assert mode.get_async_counts() == buckets
        assert mode.get_comm_counts_by_phase() == {"backward": {"all_reduce": buckets}}
        # the gradients once, and one float32 count per parameter
        assert sum(r.nbytes for r in mode.records) == total + 4 * _param_count(model)


@pytest.mark.torch
@pytest.mark.mpi(min_size=1)
def test_no_sync_accumulates_the_micro_batches_gradient(path):
    idx, tgt = batch(CFG, 2 * GLOBAL_BATCH, seed=7)
    mi, mt = _mine(idx), _mine(tgt)
    h = mi.shape[0] // 2
    names = [n for n, _ in _gpt().named_parameters()]
    ref = _torch_gpt()
    for k in range(2):  # micro-batch k of every rank, together: its mean loss
        rows = np.concatenate([np.arange(r * 2 * h + k * h, r * 2 * h + (k + 1) * h)
                               for r in range(WORLD.size)])
        _torch_loss(ref, idx[rows], tgt[rows]).backward()
    mine_only = _torch_gpt()
    _torch_loss(mine_only, mi[:h], mt[:h]).backward()

    model = dt.replicate(_gpt(), bucket_cap_mb=0.01)
    with model.no_sync(), dt.debug.CommDebugMode() as mode:
        _loss(model, mi[:h], mt[:h]).backward()
    assert mode.get_total_counts() == 0
    for name, g in _torch_grads(mine_only, names).items():  # this rank's own, not averaged
        np.testing.assert_allclose(model.get_parameter(name).grad.numpy(), g, rtol=1e-5,
                                   atol=1e-7, err_msg=name)
    with dt.debug.CommDebugMode() as mode:
        _loss(model, mi[h:], mt[h:]).backward()
    assert mode.get_total_counts() > 0
    for name, g in _torch_grads(ref, names).items():
        np.testing.assert_allclose(model.get_parameter(name).grad.numpy(), g, rtol=1e-4,
                                   atol=1e-6, err_msg=name)


@pytest.mark.mpi(min_size=1)
def test_no_sync_is_read_at_forward_time(path):
    idx, tgt = batch(CFG, GLOBAL_BATCH, seed=3)
    model = dt.replicate(_gpt(), bucket_cap_mb=0.01)
    with model.no_sync():
        loss = _loss(model, _mine(idx), _mine(tgt))
    with dt.debug.CommDebugMode() as mode:
        loss.backward()  # a forward inside no_sync: its backward does not communicate
    assert mode.get_total_counts() == 0
    model.zero_grad()
    loss = _loss(model, _mine(idx), _mine(tgt))
    with model.no_sync(), dt.debug.CommDebugMode() as mode:
        loss.backward()  # a forward outside: it does
    assert mode.get_total_counts() > 0


class Two(dt.nn.Module):
    """Three linear maps: ``a`` always used, ``b`` where ``use_b``, ``c`` never."""

    def __init__(self) -> None:
        super().__init__()
        self.a = dt.nn.Linear(4, 4)
        self.b = dt.nn.Linear(4, 4)
        self.c = dt.nn.Linear(4, 4)

    def forward(self, x, use_b):
        y = self.a(x)
        if use_b:
            y = self.b(y)
        return (y * y).sum()


def _torch_mean_grads(module, forward, xs):
    """The oracle: torch's gradients of ``forward(layers, x, rank)`` with ``module``'s initial
    weights (``layers``: name -> torch Linear), averaged over the ranks' inputs ``xs``, as
    name -> array; a parameter no rank used is absent."""
    import torch  # lazy: the oracle (the tests using it are marked torch)

    want = {}
    for r, x in enumerate(xs):
        layers = {}
        for name, child in module.named_children():
            lin = torch.nn.Linear(4, 4)
            with torch.no_grad():
                lin.weight.copy_(torch.from_numpy(child.weight.detach().numpy()))
                lin.bias.copy_(torch.from_numpy(child.bias.detach().numpy()))
            layers[name] = lin
        forward(layers, torch.from_numpy(x), r).backward()
        for name, lin in layers.items():
            for leaf in ("weight", "bias"):
                g = getattr(lin, leaf).grad
                if g is not None:
                    key = f"{name}.{leaf}"
                    want[key] = want.get(key, 0) + g.numpy() / len(xs)
    return want


def _two_forward(layers, x, rank):
    y = layers["a"](x)
    if rank == 0:
        y = layers["b"](y)
    return (y * y).sum()


@pytest.mark.torch
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("cap_mb", [0, 25])
def test_parameters_that_some_or_no_rank_used(path, cap_mb):
    xs = [np.random.default_rng(r).standard_normal((3, 4)).astype(np.float32)
          for r in range(WORLD.size)]
    dt.manual_seed(0)
    # oracle: torch's gradients of each rank's pass, averaged over the ranks
    want = _torch_mean_grads(Two(), _two_forward, xs)
    assert sorted(want) == ["a.bias", "a.weight", "b.bias", "b.weight"]
    dt.manual_seed(0)
    model = dt.replicate(Two(), bucket_cap_mb=cap_mb)
    for _ in range(2):  # the second pass starts from the first's state
        model.zero_grad()
        model(dt.tensor(xs[WORLD.rank]), WORLD.rank == 0).backward()
        for name, g in want.items():
            np.testing.assert_allclose(model.get_parameter(name).grad.numpy(), g, rtol=1e-5,
                                       atol=1e-6, err_msg=name)
        assert model.c.weight.grad is None and model.c.bias.grad is None


class Rechecked(dt.nn.Module):
    """``a`` and ``b`` used outside and inside an activation-checkpointed call: each gets
    its gradient accumulated twice per backward (the recomputation's edges are added while
    the pass runs), the second time after its bucket may have started."""

    def __init__(self) -> None:
        super().__init__()
        self.a = dt.nn.Linear(4, 4)
        self.b = dt.nn.Linear(4, 4)

    def forward(self, x):
        y = dt.utils.checkpoint(lambda t: self.b(self.a(t)).tanh(), self.a(x))
        return (self.b(y) ** 2).sum()


def _rechecked_forward(layers, x, rank):
    """``Rechecked``'s forward in torch (the checkpoint changes no gradient)."""
    a, b = layers["a"], layers["b"]
    y = b(a(a(x))).tanh()
    return (b(y) ** 2).sum()


@pytest.mark.torch
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("cap_mb", [0, 25])
def test_a_gradient_accumulated_twice_in_a_pass(path, cap_mb):
    xs = [np.random.default_rng(r).standard_normal((3, 4)).astype(np.float32)
          for r in range(WORLD.size)]
    dt.manual_seed(0)
    want = _torch_mean_grads(Rechecked(), _rechecked_forward, xs)
    dt.manual_seed(0)
    model = dt.replicate(Rechecked(), bucket_cap_mb=cap_mb)
    model(dt.tensor(xs[WORLD.rank])).backward()
    for name, g in want.items():
        np.testing.assert_allclose(model.get_parameter(name).grad.numpy(), g, rtol=1e-5,
                                   atol=1e-6, err_msg=name)


@pytest.mark.mpi(min_size=1)
def test_errors_name_the_module_and_change_nothing():
    mesh = dt.init_device_mesh((WORLD.size,))
    model = _gpt(WORLD.rank)
    before = {n: p.numpy().copy() for n, p in model.named_parameters()}

    def unchanged(m, params=before):
        assert type(m) is GPT and "_replicate_state" not in m.__dict__
        for n, p in m.named_parameters():
            np.testing.assert_array_equal(p.numpy(), params[n], err_msg=n)

    with pytest.raises(MeshError, match=r"replicate\(GPT\).*1-D mesh"):
        dt.replicate(model, dt.init_device_mesh((1, WORLD.size)))
    unchanged(model)
    with pytest.raises(MeshError, match=r"replicate\(GPT\).*includes this rank"):
        dt.replicate(model, dt.AbstractMesh((WORLD.size,)))
    unchanged(model)
    with pytest.raises(ArgumentError, match="bucket_cap_mb"):
        dt.replicate(model, mesh, bucket_cap_mb=-1)
    unchanged(model)
    with pytest.raises(ArgumentError, match="dt.nn.Module"):
        dt.replicate(object(), mesh)

    # a submodule replicated already; then the parent of a replicated module
    dt.replicate(model.blocks[1], mesh)
    with pytest.raises(ArgumentError, match=r"submodule 'blocks\.1'"):
        dt.replicate(model, mesh)
    assert type(model) is GPT and "_replicate_state" not in model.__dict__
    with pytest.raises(ArgumentError, match="replicated already"):
        dt.replicate(model.blocks[1], mesh)
    owned = r"\): parameter '{}' belongs to the replicated module {}"
    with pytest.raises(ArgumentError, match="LayerNorm" + owned.format("weight", "Block")):
        dt.replicate(model.blocks[1].ln1, mesh)
    other = _gpt()
    dt.replicate(other, mesh)
    with pytest.raises(ArgumentError, match="Block" + owned.format(r"ln1\.weight", "GPT")):
        dt.replicate(other.blocks[0], mesh)

    # a module under parallelize_module holds DTensor parameters
    tp = _gpt()
    dt.parallelize_module(tp, mesh, {"blocks.0.attn.wq": dt.ColwiseParallel()})
    tp_before = {n: (p.full_tensor() if isinstance(p, dt.DTensor) else p).numpy().copy()
                 for n, p in tp.named_parameters()}
    with pytest.raises(ArgumentError,
                       match=r"replicate\(GPT\): parameter 'blocks\.0\.attn\.wq\.weight' is a "
                             r"DTensor.*fully_shard or parallelize_module"):
        dt.replicate(tp, mesh)
    assert type(tp) is GPT and "_replicate_state" not in tp.__dict__
    for n, p in tp.named_parameters():
        np.testing.assert_array_equal(
            (p.full_tensor() if isinstance(p, dt.DTensor) else p).numpy(), tp_before[n])


@pytest.mark.mpi(min_size=1)
def test_default_mesh_and_broadcast_buffers():
    class WithBuffer(dt.nn.Module):
        def __init__(self, value):
            super().__init__()
            self.lin = dt.nn.Linear(3, 2)
            self.register_buffer("scale", dt.full((2,), float(value)))

        def forward(self, x):
            return self.lin(x) * self.scale

    dt.manual_seed(WORLD.rank)
    model = dt.replicate(WithBuffer(WORLD.rank + 1))  # the default mesh: all ranks
    np.testing.assert_array_equal(model.scale.numpy(), [1.0, 1.0])
    dt.manual_seed(0)
    want = dt.nn.Linear(3, 2)
    np.testing.assert_array_equal(model.lin.weight.numpy(), want.weight.numpy())
    assert "Replicate" in repr(model).splitlines()[0]
