"""Ring attention and ``dt.context_parallel`` against full attention on the global data.

- ``dt.nn.functional.scaled_dot_product_attention`` on ``Shard(seq)`` query, key and value
  DTensors: the output (``Shard(seq)``) and the gradients of query, key and value equal
  torch's float64 attention of the global tensors, causal and not, for sequence lengths
  that divide the world size and ones that do not (empty shards included), and only
  point-to-point traffic runs (no gather of key and value);
- inside ``dt.context_parallel`` (local Tensors, the load-balanced order): each rank's
  output rows and gradient rows are the global ones at the positions the layout gives it
  (rank ``r`` holds chunks ``r`` and ``2n-1-r`` of ``2n``), and the buffers come back whole;
- the GPT of ``launch/examples/gpt.py`` under ``dt.context_parallel`` gives the local
  model's loss and gradients (its position ids a buffer);
- bad input raises the same typed error on every rank.

Run with ``mpiexec -n K python -m pytest tests/mpi/context --with-mpi`` (K = 1-4), and
again with ``DTENSOR_FASTPATH=0``.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
from mpi4py import MPI

import dtensor as dt
from dtensor.errors import ArgumentError, MeshError
from launch.examples.gpt import GPT, GPTConfig, batch

WORLD = MPI.COMM_WORLD
N = WORLD.Get_size()
F = dt.nn.functional
pytestmark = [pytest.mark.mpi(min_size=1)]


def _torch_attention(q, k, v, g, causal):
    """Output and gradients of float64 attention on the global numpy arrays (torch)."""
    import torch  # lazy: torch is a test extra, only the marked tests import it

    ts = [torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*ts, is_causal=causal)
    out.backward(torch.tensor(g, dtype=torch.float64))
    return out.detach().numpy(), [t.grad.numpy() for t in ts]


def _chunk_sizes(s, n):
    """torch.chunk's split of s over n parts (trailing parts smaller, maybe empty)."""
    c = -(-s // n)
    return [max(0, min(c, s - j * c)) for j in range(n)]


def _balanced_positions(s, n, r):
    """Rank r's load-balanced positions: the first ceil(L_r/2) of its L_r tokens at chunk
    r of the 2n chunks, the rest at chunk 2n-1-r (the chunks in order 0..n-1 early,
    then n-1..0 late)."""
    sizes = _chunk_sizes(s, n)
    early = [(x + 1) // 2 for x in sizes]
    late = [x - e for x, e in zip(sizes, early)]
    order = [("e", j, early[j]) for j in range(n)] + [("l", j, late[j]) for j in reversed(range(n))]
    start, where = 0, {}
    for kind, j, m in order:
        where[kind, j] = np.arange(start, start + m)
        start += m
    return np.concatenate([where["e", r], where["l", r]])


def _data(rng, s, b=2, h=3, e=8, dtype=np.float64):
    return [rng.standard_normal((b, h, s, e)).astype(dtype) for _ in range(4)]


@pytest.mark.torch
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seq", [16, 13, 5, 3])
def test_ring_attention_on_shard_seq_dtensors(rng, causal, seq):
    q, k, v, g = _data(rng, seq)
    want, grads = _torch_attention(q, k, v, g, causal)
    mesh = dt.init_device_mesh((N,))
    pl = [dt.Shard(2)]
    d = [dt.distribute_tensor(dt.tensor(a), mesh, pl) for a in (q, k, v)]
    for t in d:
        t.requires_grad_()
    gd = dt.distribute_tensor(dt.tensor(g), mesh, pl)
    with dt.debug.CommDebugMode() as mode:
        out = F.scaled_dot_product_attention(*d, is_causal=causal)
        assert out.placements == (dt.Shard(2),)
        out.backward(gd)
    counts = mode.get_comm_counts()
    # no gather of K/V: forward n-1 K/V blocks, backward n-1 K/V blocks and n dK/dV blocks
    want_p2p = 3 * (N - 1) + 1 if N > 1 else 0
    assert counts == ({"send": want_p2p, "recv": want_p2p} if N > 1 else {}), counts
    np.testing.assert_allclose(out.full_tensor().numpy(), want, rtol=1e-10, atol=1e-12)
    for t, w in zip(d, grads):
        assert t.grad.placements == (dt.Shard(2),)
        np.testing.assert_allclose(t.grad.full_tensor().numpy(), w, rtol=1e-9, atol=1e-11)


@pytest.mark.torch
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("layout", ["plain", "balanced"])
def test_ring_blocks_of_queries_smaller_than_the_runs(rng, monkeypatch, causal, layout):
    """Blocks of 3 queries against runs of keys longer than a block: a causal block sees
    only a prefix of a run (the rest of the run skipped, its diagonal masked)."""
    from dtensor.ops import ring  # lazy: the kernel's block size, patched here

    monkeypatch.setattr(ring, "BLOCK_ROWS", 3)
    seq = 29
    q, k, v, g = _data(rng, seq)
    want, grads = _torch_attention(q, k, v, g, causal)
    mesh = dt.init_device_mesh((N,))
    pl = [dt.Shard(2)]
    pos = (_balanced_positions(seq, N, mesh.get_local_rank(0)) if layout == "balanced"
           else np.arange(*_plain_range(seq, N, mesh.get_local_rank(0))))
    bufs = [dt.tensor(a) for a in (q, k, v, g)]
    ctx = (dt.context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2] * 4)
           if layout == "balanced" else contextlib.nullcontext())
    with ctx:
        local = [b if layout == "balanced" else dt.tensor(np.ascontiguousarray(a[:, :, pos]))
                 for b, a in zip(bufs, (q, k, v, g))]
        d = [dt.DTensor.from_local(t, mesh, pl, shape=q.shape).requires_grad_()
             for t in local[:3]]
        out = F.scaled_dot_product_attention(*d, is_causal=causal)
        out.backward(dt.DTensor.from_local(local[3], mesh, pl, shape=q.shape))
    np.testing.assert_allclose(out.to_local().numpy(), want[:, :, pos], rtol=1e-10, atol=1e-12)
    for t, w in zip(d, grads):
        np.testing.assert_allclose(t.grad.to_local().numpy(), w[:, :, pos], rtol=1e-9,
                                   atol=1e-11)


@pytest.mark.torch
@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("causal", [True, False])
def test_ring_on_the_cp_dim_of_a_2d_mesh(rng, causal):
    """A (dp, cp) mesh: the batch sharded on dp, the sequence on cp; the ring runs over
    the cp dim only."""
    if N != 4:
        pytest.skip("the 2x2 mesh needs 4 ranks")
    q, k, v, g = _data(rng, 10)
    want, grads = _torch_attention(q, k, v, g, causal)
    mesh = dt.init_device_mesh((2, 2), mesh_dim_names=("dp", "cp"))
    pl = [dt.Shard(0), dt.Shard(2)]
    d = [dt.distribute_tensor(dt.tensor(a), mesh, pl).requires_grad_() for a in (q, k, v)]
    gd = dt.distribute_tensor(dt.tensor(g), mesh, pl)
    with dt.debug.CommDebugMode() as mode:
        out = F.scaled_dot_product_attention(*d, is_causal=causal)
        out.backward(gd)
    assert set(mode.get_comm_counts()) == {"send", "recv"}, mode.get_comm_counts()
    assert out.placements == tuple(pl)
    np.testing.assert_allclose(out.full_tensor().numpy(), want, rtol=1e-10, atol=1e-12)
    for t, w in zip(d, grads):
        np.testing.assert_allclose(t.grad.full_tensor().numpy(), w, rtol=1e-9, atol=1e-11)


def _plain_range(s, n, r):
    c = -(-s // n)
    return min(r * c, s), min((r + 1) * c, s)


@pytest.mark.torch
@pytest.mark.parametrize("seq_q,seq_k", [(7, 12), (12, 5)])
def test_ring_cross_attention_of_other_key_lengths(rng, seq_q, seq_k):
    q, g = _data(rng, seq_q)[:2]
    k, v = _data(rng, seq_k)[:2]
    want, grads = _torch_attention(q, k, v, g, False)
    mesh = dt.init_device_mesh((N,))
    pl = [dt.Shard(2)]
    d = [dt.distribute_tensor(dt.tensor(a), mesh, pl).requires_grad_() for a in (q, k, v)]
    out = F.scaled_dot_product_attention(*d)
    out.backward(dt.distribute_tensor(dt.tensor(g), mesh, pl))
    np.testing.assert_allclose(out.full_tensor().numpy(), want, rtol=1e-10, atol=1e-12)
    for t, w in zip(d, grads):
        np.testing.assert_allclose(t.grad.full_tensor().numpy(), w, rtol=1e-9, atol=1e-11)


@pytest.mark.torch
@pytest.mark.parametrize("causal", [True, False])
def test_ring_attention_double_backward(rng, causal):
    """A gradient of the attention's gradient on ``Shard(seq)`` DTensors
    (``create_graph=True``): ``dL/dq`` and the key and value gradients of ``sum(dL/dq)``
    equal torch's float64 attention written out (its fused CPU attention has no double
    backward)."""
    import torch  # lazy: torch is a test extra, only the marked tests import it

    q, k, v = _data(rng, 12, b=1, h=2, e=4)[:3]
    mesh = dt.init_device_mesh((N,))
    d = [dt.distribute_tensor(dt.tensor(a), mesh, [dt.Shard(2)]).requires_grad_()
         for a in (q, k, v)]
    out = F.scaled_dot_product_attention(*d, is_causal=causal)
    (gq,) = dt.autograd.grad(out.sum(), d[0], create_graph=True)
    assert gq.requires_grad
    gq.sum().backward()
    ts = [torch.tensor(a, requires_grad=True) for a in (q, k, v)]
    scores = ts[0] @ ts[1].transpose(-1, -2) / 2.0
    if causal:
        scores = scores.masked_fill(torch.ones(12, 12, dtype=torch.bool).triu(1), -math.inf)
    (tq,) = torch.autograd.grad((torch.softmax(scores, -1) @ ts[2]).sum(), ts[0],
                                create_graph=True)
    np.testing.assert_allclose(gq.full_tensor().numpy(), tq.detach().numpy(), rtol=1e-10,
                               atol=1e-12)
    tq.sum().backward()
    for t, w in zip(d[1:], ts[1:]):
        np.testing.assert_allclose(t.grad.full_tensor().numpy(), w.grad.numpy(), rtol=1e-9,
                                   atol=1e-11)


@pytest.mark.torch
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seq", [16, 11])
def test_context_parallel_load_balanced_local_tensors(rng, causal, seq):
    q, k, v, g = _data(rng, seq, dtype=np.float32)
    want, grads = _torch_attention(q, k, v, g, causal)
    mesh = dt.init_device_mesh((N,))
    r = mesh.get_local_rank(0)
    pos = _balanced_positions(seq, N, r)
    if seq % (2 * N) == 0:  # the plain rule: chunks r and 2n-1-r of 2n equal chunks
        c = seq // (2 * N)
        np.testing.assert_array_equal(
            pos, np.r_[r * c:(r + 1) * c, (2 * N - 1 - r) * c:(2 * N - r) * c])
    bufs = [dt.tensor(a) for a in (q, k, v, g)]
    with dt.context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2, -2]):
        for b, a in zip(bufs, (q, k, v, g)):
            np.testing.assert_array_equal(b.numpy(), a[:, :, pos])  # sharded in place
        ql, kl, vl = (b.detach().requires_grad_() for b in bufs[:3])
        out = F.scaled_dot_product_attention(ql, kl, vl, is_causal=causal)
        assert not isinstance(out, dt.DTensor)
        out.backward(bufs[3])
    np.testing.assert_allclose(out.numpy(), want[:, :, pos], rtol=1e-5, atol=1e-6)
    for t, w in zip((ql, kl, vl), grads):
        np.testing.assert_allclose(t.grad.numpy(), w[:, :, pos], rtol=1e-4, atol=1e-5)
    for b, a in zip(bufs, (q, k, v, g)):  # restored whole
        np.testing.assert_array_equal(b.numpy(), a)


def test_context_parallel_no_restore_buffers():
    mesh = dt.init_device_mesh((N,))
    x = dt.arange(12).reshape(1, 12)
    y = dt.arange(24).reshape(2, 12)
    with dt.context_parallel(mesh, buffers=[x, y], buffer_seq_dims=[1, 1],
                             no_restore_buffers={x}):
        pass
    pos = _balanced_positions(12, N, mesh.get_local_rank(0))
    np.testing.assert_array_equal(x.numpy(), np.arange(12)[None, pos])
    np.testing.assert_array_equal(y.numpy(), np.arange(24).reshape(2, 12))


CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, d_model=32)


@pytest.mark.parametrize("seq", [16, 10])
def test_gpt_under_context_parallel_gives_the_local_models_loss_and_grads(seq):
    dt.manual_seed(0)
    local = GPT(CFG)
    dt.manual_seed(0)
    model = GPT(CFG)
    idx, tgt = batch(CFG, 2, 1)
    idx, tgt = idx[:, :seq], tgt[:, :seq]
    want = local(dt.tensor(idx), dt.tensor(tgt))
    want.backward()
    mesh = dt.init_device_mesh((N,))
    r = mesh.get_local_rank(0)
    i_b, t_b, p_b = dt.tensor(idx), dt.tensor(tgt), dt.arange(seq)
    with dt.context_parallel(mesh, buffers=[i_b, t_b, p_b], buffer_seq_dims=[1, 1, 0]):
        np.testing.assert_array_equal(p_b.numpy(), _balanced_positions(seq, N, r))
        loss = model(i_b, t_b, positions=p_b)
        # the local loss is the mean over this rank's tokens: its part of the whole mean is
        # that times their share (the ring's backward carries every rank's seed to the
        # others' keys and values, so the parts are weighted before the backward)
        share = len(_balanced_positions(seq, N, r)) / seq
        (loss * share).backward()
    total = WORLD.allreduce(float(loss.item()) * share)
    np.testing.assert_allclose(total, want.item(), rtol=1e-5)
    for (name, p), (_, p0) in zip(model.named_parameters(), local.named_parameters()):
        gsum = np.empty_like(p.grad.numpy())
        WORLD.Allreduce(np.ascontiguousarray(p.grad.numpy()), gsum)
        np.testing.assert_allclose(gsum, p0.grad.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)


def _raises(exc, match, fn):
    with pytest.raises(exc, match=match):
        fn()
    WORLD.Barrier()  # every rank got here: none hangs in a collective


def test_bad_input_raises_the_same_typed_error_on_every_rank():
    mesh = dt.init_device_mesh((N,))
    x = dt.zeros((2, 8))

    def enter(*a, **kw):
        with dt.context_parallel(*a, **kw):
            pass

    _raises(ArgumentError, r"buffer_seq_dims must give one sequence dim per buffer: 2 "
            r"buffers, 1 dims", lambda: enter(mesh, buffers=[x, dt.zeros(8)],
                                               buffer_seq_dims=[1]))
    _raises(ArgumentError, r"buffer 1 of shape \(3, 7\) has 7 positions on its sequence dim 1; "
            r"buffer 0 has 8", lambda: enter(mesh, buffers=[x, dt.zeros((3, 7))],
                                             buffer_seq_dims=[1, 1]))
    _raises(ArgumentError, r"buffer 0 of shape \(2, 8\): sequence dim 2 is out of range",
            lambda: enter(mesh, buffers=[x], buffer_seq_dims=[2]))
    xd = dt.distribute_tensor(dt.zeros((2, 8)), mesh, [dt.Replicate()])
    _raises(ArgumentError, r"buffer 0 must be a local dt.Tensor .* got DTensor",
            lambda: enter(mesh, buffers=[xd], buffer_seq_dims=[1]))
    mesh2 = dt.init_device_mesh((1, N))
    _raises(MeshError, rf"the mesh must be a 1-D DeviceMesh, got \(1, {N}\)",
            lambda: enter(mesh2, buffers=[x], buffer_seq_dims=[1]))
    assert x.shape == (2, 8)  # nothing sharded by a failed entry
    q = dt.zeros((1, 2, 8, 4))

    def wrong_length():
        with dt.context_parallel(mesh, buffers=[dt.zeros((1, 16))], buffer_seq_dims=[1]):
            F.scaled_dot_product_attention(q, q, q, is_causal=True)

    def with_dropout():
        qs = dt.zeros((1, 2, 16, 4))
        with dt.context_parallel(mesh, buffers=[qs], buffer_seq_dims=[2]):
            F.scaled_dot_product_attention(qs, qs, qs, dropout_p=0.5)

    _raises(ArgumentError, r"context_parallel: ring attention takes no attn_mask and no "
            r"dropout.* dropout_p 0.5", with_dropout)
    want = len(_balanced_positions(16, N, mesh.get_local_rank(0)))
    if want != 8:
        _raises(ArgumentError, r"the attention's query has 8 positions on rank \d+, this "
                rf"rank's shard of the sequence of 16 holds {want}", wrong_length)
