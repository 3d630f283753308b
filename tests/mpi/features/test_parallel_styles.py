"""Tensor and sequence parallelism (``dt.parallelize_module`` with the styles) at 1-4 ranks:
the parallel module computes the outputs and gradients of the same module in torch with the
same weights (the same seed gives the same global weights on any layout), CommDebugMode's counts per forward are the
theory's, and bad plans raise before anything changes."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import dtensor as dt
from dtensor import Replicate, Shard

WORLD = MPI.COMM_WORLD
D, H, B, T, V = 8, 16, 2, 4, 12


class MLP(dt.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = dt.nn.Linear(D, H)
        self.w2 = dt.nn.Linear(H, D)

    def forward(self, x):
        return self.w2(dt.nn.functional.gelu(self.w1(x)))


class Block(dt.nn.Module):
    """A pre-norm residual block: two MLPs, each behind a LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1 = dt.nn.LayerNorm(D)
        self.mlp1 = MLP()
        self.norm2 = dt.nn.LayerNorm(D)
        self.mlp2 = MLP()

    def forward(self, x):
        x = x + self.mlp1(self.norm1(x))
        return x + self.mlp2(self.norm2(x))


def _model(cls, seed=0):
    dt.manual_seed(seed)
    return cls()


def _input(seed=1):
    return np.random.default_rng(seed).standard_normal((B, T, D)).astype(np.float32)


def _torch_twin(cls):
    """The oracle: ``cls`` rebuilt of torch modules with the same parameter names, holding
    the weights ``_model(cls)`` draws (float32)."""
    import torch  # lazy: the oracle (the tests using it are marked torch)

    nn = torch.nn

    class TMLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1, self.w2 = nn.Linear(D, H), nn.Linear(H, D)

        def forward(self, x):
            return self.w2(nn.functional.gelu(self.w1(x)))

    class TBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1, self.mlp1 = nn.LayerNorm(D), TMLP()
            self.norm2, self.mlp2 = nn.LayerNorm(D), TMLP()

        def forward(self, x):
            x = x + self.mlp1(self.norm1(x))
            return x + self.mlp2(self.norm2(x))

    class THead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.out = nn.Embedding(V, D), nn.Linear(D, V, bias=False)

        def forward(self, idx):
            return self.out(self.emb(idx))

    twin = {Block: TBlock, Head: THead}[cls]()
    weights = {n: p.detach().numpy() for n, p in _model(cls).named_parameters()}
    twin.load_state_dict({n: torch.from_numpy(w.copy()) for n, w in weights.items()})
    return twin


def _torch_run(cls, x):
    """torch's output of ``cls`` at ``x`` and the gradients of its sum (name -> array)."""
    import torch  # lazy: the oracle (the tests using it are marked torch)

    model = _torch_twin(cls)
    out = model(torch.from_numpy(x))
    out.sum().backward()
    return out.detach().numpy(), {n: p.grad.numpy() for n, p in model.named_parameters()}


def _full(t):
    return (t.full_tensor() if isinstance(t, dt.DTensor) else t).numpy()


def _counts(mode):
    out = {}
    for r in mode.records:
        out[r.kind] = out.get(r.kind, 0) + 1
    return out


@pytest.fixture(scope="module")
def mesh():
    return dt.init_device_mesh((WORLD.size,))


TP_PLAN = {"mlp*.w1": dt.ColwiseParallel(), "mlp*.w2": dt.RowwiseParallel()}


@pytest.mark.torch
@pytest.mark.mpi(min_size=1)
def test_tensor_parallel_block_equals_torchs_block(mesh):
    x = _input()
    want, grads = _torch_run(Block, x)
    model = dt.parallelize_module(_model(Block), mesh, TP_PLAN)
    assert model.mlp1.w1.weight.placements == (Shard(0),)
    assert model.mlp1.w2.weight.placements == (Shard(1),)
    assert model.mlp1.w2.bias.placements == (Replicate(),)
    with dt.debug.CommDebugMode() as mode:
        out = model(dt.tensor(x))
    # one all-reduce per MLP (the rowwise output), nothing else: two per block
    if WORLD.size > 1:
        assert _counts(mode) == {"all_reduce": 2}
    assert isinstance(out, dt.Tensor)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5)
    out.sum().backward()
    for name, p in model.named_parameters():
        np.testing.assert_allclose(_full(p.grad), grads[name], rtol=1e-4, atol=1e-5,
                                   err_msg=name)


@pytest.mark.torch
@pytest.mark.mpi(min_size=1)
def test_sequence_parallel_block_equals_torchs_block(mesh):
    x = _input()
    want, grads = _torch_run(Block, x)
    plan = {
        "norm*": dt.SequenceParallel(),
        "mlp*.w1": dt.ColwiseParallel(input_layouts=Shard(1)),
        "mlp*.w2": dt.RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }
    model = dt.parallelize_module(_model(Block), mesh, plan)
    n = -(-T // WORLD.size)  # torch.chunk's split: uneven (and empty) shards at 3 ranks
    start = min(WORLD.rank * n, T)
    xs = dt.tensor(x[:, start:min(start + n, T)].copy())
    x_in = dt.DTensor.from_local(xs, mesh, [Shard(1)])
    with dt.debug.CommDebugMode() as mode:
        out = model(x_in)
    if WORLD.size > 1:  # per MLP: gather the sequence before w1, reduce-scatter after w2
        assert _counts(mode) == {"all_gather": 2, "reduce_scatter": 2}
    assert out.placements == (Shard(1),)
    np.testing.assert_allclose(_full(out), want, rtol=1e-5, atol=1e-5)
    out.sum().backward()
    for name, p in model.named_parameters():
        np.testing.assert_allclose(_full(p.grad), grads[name], rtol=1e-4, atol=1e-5,
                                   err_msg=name)


class Head(dt.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = dt.nn.Embedding(V, D)
        self.out = dt.nn.Linear(D, V, bias=False)

    def forward(self, idx):
        return self.out(self.emb(idx))


@pytest.mark.torch
@pytest.mark.mpi(min_size=1)
def test_vocab_parallel_embedding_and_loss_parallel(mesh):
    import torch  # lazy: the oracle (marked torch)

    idx = np.random.default_rng(3).integers(0, V, (B, T))
    target = np.random.default_rng(4).integers(0, V, (B * T,))
    twin = _torch_twin(Head)
    loss = torch.nn.functional.cross_entropy(
        twin(torch.from_numpy(idx)).reshape(B * T, V), torch.from_numpy(target))
    loss.backward()
    loss = loss.detach()
    want = {n: p.grad.numpy() for n, p in twin.named_parameters()}
    plan = {"emb": dt.RowwiseParallel(),
            "out": dt.ColwiseParallel(use_local_output=False)}
    model = dt.parallelize_module(_model(Head), mesh, plan)
    assert model.emb.weight.placements == (Shard(0),)
    with dt.loss_parallel(), dt.debug.CommDebugMode() as mode:
        logits = model(dt.tensor(idx)).reshape(B * T, V)
        assert logits.placements == (Shard(1),)
        tgt = dt.distribute_tensor(dt.tensor(target), mesh, [Replicate()])
        got = dt.nn.functional.cross_entropy(logits, tgt)
        got.backward()
    assert "all_gather" not in _counts(mode)  # the logits are never gathered
    np.testing.assert_allclose(_full(got), loss.numpy(), rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():
        np.testing.assert_allclose(_full(p.grad), want[name], rtol=1e-4, atol=1e-6,
                                   err_msg=name)


@pytest.mark.mpi(min_size=1)
def test_bad_plans_raise_naming_the_module_and_change_nothing(mesh):
    model = _model(Block)
    before = {n: id(p) for n, p in model.named_parameters()}
    with pytest.raises(dt.errors.ArgumentError, match="'mlp9.w1' matches no submodule"):
        dt.parallelize_module(model, mesh, {"mlp1.w1": dt.ColwiseParallel(),
                                            "mlp9.w1": dt.ColwiseParallel()})
    with pytest.raises(dt.errors.ArgumentError, match="'norm1' expects one of Linear"):
        dt.parallelize_module(model, mesh, {"mlp1.w1": dt.ColwiseParallel(),
                                            "norm1": dt.ColwiseParallel()})
    with pytest.raises(dt.errors.ArgumentError, match="SequenceParallel at 'mlp1.w1'"):
        dt.parallelize_module(model, mesh, {"mlp1.w1": dt.SequenceParallel()})
    assert {n: id(p) for n, p in model.named_parameters()} == before
    assert not any(isinstance(p, dt.DTensor) for p in model.parameters())
    if WORLD.size == 4:
        mesh2 = dt.init_device_mesh((2, 2), mesh_dim_names=("dp", "tp"))
        with pytest.raises(dt.errors.MeshError, match="1-D mesh"):
            dt.parallelize_module(model, mesh2, TP_PLAN)
        dt.parallelize_module(model, mesh2["tp"], TP_PLAN)  # the tp dim serves
        assert model.mlp1.w1.weight.device_mesh == mesh2["tp"]


@pytest.mark.mpi(min_size=1)
def test_prepare_module_input_and_output(mesh):
    seen = []

    class Probe(dt.nn.Module):
        def forward(self, x, *, y=None):
            seen.append((type(x).__name__, getattr(x, "placements", None),
                         getattr(y, "placements", None)))
            return x

    probe = Probe()
    dt.parallelize_module(probe, mesh, dt.PrepareModuleInput(
        input_layouts=Shard(0), desired_input_layouts=Replicate(),
        input_kwarg_layouts={"y": Shard(0)}, desired_input_kwarg_layouts={"y": Shard(0)}))
    n = WORLD.size
    xl = dt.tensor(np.full((2, 3), WORLD.rank, np.float32))
    out = probe(xl, y=xl)
    assert seen[-1] == ("DTensor", (Replicate(),), (Shard(0),))
    np.testing.assert_array_equal(_full(out)[::2, 0], np.arange(n, dtype=np.float32))
    post = Probe()
    dt.parallelize_module(post, mesh, dt.PrepareModuleOutput(
        output_layouts=Shard(0), desired_output_layouts=Replicate()))
    got = post(xl)
    assert isinstance(got, dt.Tensor) and tuple(got.shape) == (2 * n, 3)
