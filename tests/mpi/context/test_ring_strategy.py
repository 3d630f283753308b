"""Ring attention as a strategy of the ``scaled_dot_product_attention`` op (its rule's ring
candidate, priced by the cost model, its kernel the ring's).

- the top-level ``dt.scaled_dot_product_attention`` on ``Shard(seq)`` query, key and value
  equals torch's float64 attention (output and gradients), causal and not, for even and
  uneven sequence lengths, with point-to-point traffic only (no gather), also on a repeated
  call served by the propagation cache (the compiled front in the fast-path mode);
- ``dt.debug.explain`` lists the ring candidate beside the gathering ones, with the cost
  the cost model gives its passes (an all-gather's figures for the bytes each rank sends),
  chooses it, and lists its sends and receives;
- inputs on other placements (key and value replicated, a batch dim sharded, a mask) go
  the old way: no point-to-point traffic.

Run with ``mpiexec -n K python -m pytest tests/mpi/context --with-mpi`` (K = 1-4), and
again with ``DTENSOR_FASTPATH=0``.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import dtensor as dt
from redistribute.cost import default_cost_model

from .test_ring_attention import _data, _torch_attention

WORLD = MPI.COMM_WORLD
N = WORLD.Get_size()
pytestmark = [pytest.mark.mpi(min_size=1)]


def _sharded(arrays, mesh, pl):
    return [dt.distribute_tensor(dt.tensor(a), mesh, pl) for a in arrays]


@pytest.mark.torch
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seq", [16, 13, 5, 3])
def test_top_level_op_runs_the_ring(rng, causal, seq):
    q, k, v, g = _data(rng, seq)
    want, grads = _torch_attention(q, k, v, g, causal)
    mesh = dt.init_device_mesh((N,))
    pl = [dt.Shard(2)]
    d = [t.requires_grad_() for t in _sharded((q, k, v), mesh, pl)]
    gd = dt.distribute_tensor(dt.tensor(g), mesh, pl)
    with dt.debug.CommDebugMode() as mode:
        out = dt.scaled_dot_product_attention(*d, is_causal=causal)
        assert out.placements == (dt.Shard(2),)
        out.backward(gd)
    # forward: n-1 K/V blocks; backward: n-1 K/V blocks and n dK/dV blocks; nothing else
    p2p = 3 * (N - 1) + 1 if N > 1 else 0
    assert mode.get_comm_counts() == ({"send": p2p, "recv": p2p} if N > 1 else {})
    np.testing.assert_allclose(out.full_tensor().numpy(), want, rtol=1e-10, atol=1e-12)
    for t, w in zip(d, grads):
        assert t.grad.placements == (dt.Shard(2),)
        np.testing.assert_allclose(t.grad.full_tensor().numpy(), w, rtol=1e-9, atol=1e-11)
    # a repeated call (a propagation-cache hit; the compiled front's in the fast-path mode)
    with dt.no_grad(), dt.debug.CommDebugMode() as mode:
        for _ in range(2):
            again = dt.scaled_dot_product_attention(*d, is_causal=causal)
    assert mode.get_comm_counts() == ({"send": 2 * (N - 1), "recv": 2 * (N - 1)}
                                      if N > 1 else {})
    np.testing.assert_allclose(again.full_tensor().numpy(), want, rtol=1e-10, atol=1e-12)


def _gather_cost(nbytes: int) -> float:
    """The default cost model's all-gather of ``nbytes`` over the world: each rank
    receives (N-1)/N of it (the oracle of the ring's price: it moves as much)."""
    model = default_cost_model()
    alpha, beta = model.params("all_gather", 0)
    return alpha + round((N - 1) / N * nbytes) / beta


@pytest.mark.mpi(min_size=2)  # a ring of one rank passes nothing
def test_explain_lists_the_ring_candidate_and_chooses_it(rng):
    q, k, v, _ = _data(rng, 13)
    mesh = dt.init_device_mesh((N,))
    d = _sharded((q, k, v), mesh, [dt.Shard(2)])
    e = dt.debug.explain(dt.scaled_dot_product_attention, *d, is_causal=True, top=20)
    op = e.ops[0]
    assert op.output_placements == ("[S(2)]",)
    descs = dict(op.candidates)
    ring = [c for c in op.candidates if "[ring over mesh dim 0]" in c[0]]
    assert len(ring) == 1, op.candidates
    assert op.candidates[0] == ring[0], op.candidates  # chosen: the cheapest
    kv_bytes = k.nbytes + v.nbytes
    np.testing.assert_allclose(ring[0][1], _gather_cost(kv_bytes), rtol=1e-9)
    # the gathering candidate (queries kept, key and value gathered) costs two all-gathers
    gather = [c for c in descs if c == "[S(2)] <- [S(2)], [R], [R], -"]
    assert len(gather) == 1, op.candidates
    np.testing.assert_allclose(descs[gather[0]], _gather_cost(k.nbytes) + _gather_cost(v.nbytes),
                               rtol=1e-9)
    assert e.comm_counts() == {"send": N - 1, "recv": N - 1}
    assert "ring over mesh dim 0" in str(e)


@pytest.mark.torch
@pytest.mark.parametrize("case", ["kv_replicated", "batch_sharded", "mask"])
def test_other_placements_go_the_old_way(rng, case):
    import torch  # lazy: torch is a test extra, only the marked tests import it

    q, k, v, _ = _data(rng, 13, b=N + 1)
    mask = rng.random((13, 13)) > 0.3
    np.fill_diagonal(mask, True)
    mesh = dt.init_device_mesh((N,))
    s = dt.Shard(2)
    if case == "kv_replicated":
        d = [*_sharded((q,), mesh, [s]), *_sharded((k, v), mesh, [dt.Replicate()])]
    elif case == "batch_sharded":
        d = _sharded((q, k, v), mesh, [dt.Shard(0)])
    else:
        d = _sharded((q, k, v), mesh, [s])
    m = None
    if case == "mask":
        m = dt.distribute_tensor(dt.tensor(mask), mesh, [dt.Replicate()])
    with dt.debug.CommDebugMode() as mode:
        out = dt.scaled_dot_product_attention(*d, attn_mask=m)
    counts = mode.get_comm_counts()
    assert "send" not in counts and "recv" not in counts, counts
    if case == "mask" and N > 1:
        assert counts.get("all_gather", 0) >= 2, counts  # key and value gathered
    elif case != "mask":
        assert counts == {}, counts
    tm = None if m is None else torch.tensor(mask)
    want = torch.nn.functional.scaled_dot_product_attention(
        *(torch.tensor(a) for a in (q, k, v)), attn_mask=tm).numpy()
    np.testing.assert_allclose(out.full_tensor().numpy(), want, rtol=1e-10, atol=1e-12)


def test_backward_reads_the_forwards_results(rng, monkeypatch):
    """The ring's backward takes the forward's output and log-sum-exp (one forward ring per
    step, not a second one in the backward); a backward op called on its own runs it."""
    from dtensor.ops import ring  # lazy: the kernel module, its forward counted here

    calls = []
    forward = ring._ring_forward

    def counted(*a, **kw):
        calls.append(1)
        return forward(*a, **kw)

    monkeypatch.setattr(ring, "_ring_forward", counted)
    q, k, v, g = _data(rng, 11)
    mesh = dt.init_device_mesh((N,))
    pl = [dt.Shard(2)]
    d = [t.requires_grad_() for t in _sharded((q, k, v), mesh, pl)]
    out = dt.scaled_dot_product_attention(*d, is_causal=True)
    out.backward(dt.distribute_tensor(dt.tensor(g), mesh, pl))
    assert len(calls) == 1
    plain = _sharded((q, k, v), mesh, pl)
    gd = dt.distribute_tensor(dt.tensor(g), mesh, pl)
    grads = dt.scaled_dot_product_attention_backward(gd, *plain, is_causal=True)
    assert len(calls) == 2
    for a, t in zip(grads, d):
        assert a.placements == (dt.Shard(2),)
        np.testing.assert_allclose(a.full_tensor().numpy(), t.grad.full_tensor().numpy(),
                                   rtol=1e-12, atol=1e-14)
