"""The blocked attention kernels and the fused backward (``scaled_dot_product_attention``
without mask and dropout, ``scaled_dot_product_attention_backward``) against torch's
``scaled_dot_product_attention`` (optional: where torch is installed): forward and the
gradients of query, key and value for causal and full attention, sequences shorter and
longer than a block and not a multiple of it, a single query, L != S, float32 and float64,
grouped-query heads, the projections' strided views of a GPT, a block size of a few rows
(many blocks on small shapes); the sharding rule's candidates of the backward, the fused op
called directly, and double backward (``create_graph``), which keeps the differentiable
formula."""

from __future__ import annotations

import numpy as np
import pytest

import dtensor as dt
from dtensor.local.kernels import attention as attn
from placements import Partial, Replicate, Shard
from placements.rules import ArgMeta, OpSchema, rule_result

pytestmark = pytest.mark.torch  # torch is the oracle of most tests here

R = Replicate()
TOL = {np.float32: {"rtol": 2e-4, "atol": 2e-5}, np.float64: {"rtol": 1e-10, "atol": 1e-12}}

#: (batch dims, L, S, E, is_causal, scale, key/value heads for grouped queries)
CASES = [
    ((2, 3), 130, 130, 8, True, None, None),  # over two blocks, not a multiple of one
    ((2, 3), 130, 130, 8, False, None, None),
    ((2, 2), 64, 64, 4, True, 0.3, None),  # exactly a block
    ((3,), 1, 1, 5, True, None, None),  # a single query and key
    ((2, 2), 1, 70, 4, True, None, None),  # one query: it sees key 0 only
    ((1, 2), 70, 150, 4, True, None, None),  # L < S: the last block sees a prefix
    ((1, 2), 150, 70, 4, True, None, None),  # L > S: late blocks see every key
    ((2, 2), 100, 90, 6, False, 0.7, None),
    ((2, 4), 80, 80, 4, True, None, 2),  # grouped-query heads
    ((1, 4), 66, 66, 4, False, None, 1),
    ((), 70, 70, 3, True, None, None),  # plain 2-D
]


def _torch_attention(q, k, v, g, causal, scale, gqa):
    import torch  # lazy: an optional test dependency (the module is marked torch)

    tq, tk, tv = (torch.from_numpy(a.copy()).requires_grad_() for a in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(
        tq, tk, tv, is_causal=causal, scale=scale, **({"enable_gqa": True} if gqa else {}))
    out.backward(torch.from_numpy(g))
    return [t.detach().numpy() for t in (out, tq.grad, tk.grad, tv.grad)]


def _check(case, dtype, seed=0):
    batch, n_q, n_k, e, causal, scale, heads = case
    rng = np.random.default_rng(seed + n_q + 7 * n_k)
    kv = batch if heads is None else (*batch[:-1], heads)
    q, k, v = (rng.standard_normal(s).astype(dtype)
               for s in ((*batch, n_q, e), (*kv, n_k, e), (*kv, n_k, e)))
    g = rng.standard_normal((*batch, n_q, e)).astype(dtype)
    want = _torch_attention(q, k, v, g, causal, scale, heads is not None)
    leaves = [dt.from_numpy(a.copy()).requires_grad_() for a in (q, k, v)]
    out = dt.scaled_dot_product_attention(*leaves, is_causal=causal, scale=scale,
                                          enable_gqa=heads is not None)
    out.backward(dt.from_numpy(g))
    got = [out.detach().numpy(), *(t.grad.numpy() for t in leaves)]
    for name, a, w in zip(("output", "query", "key", "value"), got, want):
        assert a.dtype == dtype and a.shape == w.shape, (name, a.dtype, a.shape)
        np.testing.assert_allclose(a, w, **TOL[dtype], err_msg=f"{name} {case}")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_blocked_attention_matches_torch(case, dtype):
    _check(case, dtype)


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_any_block_size_gives_the_same_result(rows, monkeypatch):
    monkeypatch.setattr(attn, "BLOCK_ROWS", rows)
    for case in (CASES[0], CASES[4], CASES[5], CASES[6], CASES[8]):
        _check(case, np.float64, seed=rows)


def test_gpt_layout_views_match_torch():
    # the projections of launch/examples/gpt.py: (B, S, H, hd) viewed as (B, H, S, hd)
    import torch  # lazy: an optional test dependency (the module is marked torch)

    rng = np.random.default_rng(5)
    x = [rng.standard_normal((2, 100, 3, 8)).astype(np.float32) for _ in range(3)]
    g = rng.standard_normal((2, 3, 100, 8)).astype(np.float32)
    leaves = [dt.from_numpy(a).requires_grad_() for a in x]
    out = dt.scaled_dot_product_attention(*(t.transpose(1, 2) for t in leaves), is_causal=True)
    out.backward(dt.from_numpy(g))
    tl = [torch.from_numpy(a).requires_grad_() for a in x]
    want = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in tl), is_causal=True)
    want.backward(torch.from_numpy(g))
    np.testing.assert_allclose(out.detach().numpy(), want.detach().numpy(), **TOL[np.float32])
    for t, w in zip(leaves, tl):
        np.testing.assert_allclose(t.grad.numpy(), w.grad.numpy(), **TOL[np.float32])


def test_fused_backward_called_directly_matches_torch():
    batch, n_q, n_k, e = (2, 3), 90, 75, 4
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((*batch, n, e)) for n in (n_q, n_k, n_k))
    g = rng.standard_normal((*batch, n_q, e))
    for causal in (True, False):
        want = _torch_attention(q, k, v, g, causal, 0.4, False)
        got = dt.scaled_dot_product_attention_backward(
            dt.from_numpy(g), dt.from_numpy(q), dt.from_numpy(k), dt.from_numpy(v),
            is_causal=causal, scale=0.4)
        for a, w in zip(got, want[1:]):
            np.testing.assert_allclose(a.numpy(), w, **TOL[np.float64])


def test_fused_backward_rejects_broadcast_batch_dims():
    q = dt.from_numpy(np.zeros((2, 3, 4, 5)))
    k = dt.from_numpy(np.zeros((1, 3, 4, 5)))
    with pytest.raises(dt.errors.ShardingError, match="scaled_dot_product_attention_backward"):
        dt.scaled_dot_product_attention_backward(q, q, k, k)
    with pytest.raises(dt.errors.DTypeError, match="grad of the query's dtype"):
        dt.scaled_dot_product_attention_backward(q.float(), q, q, q)


def test_double_backward_keeps_the_differentiable_formula():
    import torch  # lazy: an optional test dependency (the module is marked torch)

    rng = np.random.default_rng(9)
    q, k, v = (rng.standard_normal((2, 70, 4)) for _ in range(3))
    leaves = [dt.from_numpy(a.copy()).requires_grad_() for a in (q, k, v)]
    out = dt.scaled_dot_product_attention(*leaves, is_causal=True)
    (gq,) = dt.autograd.grad(out.sum(), [leaves[0]], create_graph=True)
    (gq * gq).sum().backward()
    tl = [torch.from_numpy(a.copy()).requires_grad_() for a in (q, k, v)]
    tout = torch.nn.functional.scaled_dot_product_attention(*tl, is_causal=True)
    (tgq,) = torch.autograd.grad(tout.sum(), [tl[0]], create_graph=True)
    (tgq * tgq).sum().backward()
    np.testing.assert_allclose(gq.detach().numpy(), tgq.detach().numpy(), rtol=1e-10)
    for t, w in zip(leaves, tl):
        np.testing.assert_allclose(t.grad.numpy(), w.grad.numpy(), rtol=1e-8, atol=1e-10)


def test_backward_rule_shards_batch_heads_and_queries():
    S, P = Shard, Partial()
    q, k, g = (2, 4, 6, 8), (2, 4, 7, 8), (2, 4, 6, 3)
    v = (2, 4, 7, 3)
    got = _candidates((g, q, k, v), enable_gqa=False)
    # and ring attention's backward: everything sharded on the sequence dim
    assert got == {(R,) * 7, (S(0),) * 7, (S(1),) * 7, (S(2), P, P, S(2), S(2), R, R),
                   (S(2),) * 7}
    # no ring for a causal attention of more keys than queries
    got = _candidates((g, q, k, v), enable_gqa=False, is_causal=True)
    assert got == {(R,) * 7, (S(0),) * 7, (S(1),) * 7, (S(2), P, P, S(2), S(2), R, R)}
    # nor for grouped key/value heads
    got = _candidates((g, q, (2, 2, 7, 8), (2, 2, 7, 3)), enable_gqa=True)
    assert got == {(R,) * 7, (S(0),) * 7, (S(2), P, P, S(2), S(2), R, R)}


def _candidates(shapes, **static):
    args = tuple(ArgMeta(s, np.dtype(np.float32)) for s in shapes)
    res = rule_result(OpSchema("scaled_dot_product_attention_backward", args,
                               tuple(static.items()), (2,)))
    return {c.placements for c in res.candidates}


def _forward(shapes, mesh=(2,), mask=None, **static):
    args = (*(ArgMeta(s, np.dtype(np.float32)) for s in shapes),
            None if mask is None else ArgMeta(mask, np.dtype(np.bool_)))
    return OpSchema("scaled_dot_product_attention", args, tuple(static.items()), mesh)


def test_forward_rule_offers_the_ring_only_where_it_applies():
    S = Shard
    q, k = (2, 4, 6, 8), (2, 4, 7, 8)
    ring = (S(2), S(2), S(2), S(2), None)

    def has_ring(schema):
        cands = [c for c in rule_result(schema).candidates if c.passes]
        assert all(c.collective for c in cands)
        return [c.placements for c in cands] == [ring[: len(c.placements)] for c in cands] \
            and bool(cands)

    # priced by the key and value it passes: their whole element counts
    (c,) = [c for c in rule_result(_forward((q, k, k))).candidates if c.passes]
    assert c.placements == ring and c.passes == (2 * 2 * 4 * 7 * 8,)
    assert not has_ring(_forward((q, k, k), is_causal=True))  # causal: as many keys as queries
    assert has_ring(_forward((q, q, q), is_causal=True))
    assert not has_ring(_forward((q, k, k), dropout_p=0.1))
    assert not has_ring(_forward((q, k, k), mask=(6, 7)))
    assert not has_ring(_forward((q, (2, 2, 7, 8), (2, 2, 7, 8)), enable_gqa=True))
    assert not has_ring(_forward((q, (1, 4, 7, 8), (1, 4, 7, 8))))  # broadcast batch


def test_propagate_takes_the_ring_on_one_mesh_dim_only():
    from dtensor.distributed.abstract import AbstractMesh  # lazy: a metadata-only mesh
    from placements.rules import propagate  # lazy: only this test searches strategies

    def cost(meta, target):  # one latency plus the elements of each move
        return (1.0 + float(np.prod(meta.shape))) * (meta.placements != tuple(target))

    S = Shard
    q = (2, 4, 6, 8)
    args = tuple(ArgMeta(q, np.dtype(np.float32), pl) for pl in [(S(2),)] * 3) + (None,)
    schema = OpSchema("scaled_dot_product_attention", args, (), (4,))
    st = propagate(schema, AbstractMesh((4,)), cost)
    # the ring moves what gathering key and value does, in one message per step
    assert st.input_placements[:3] == ((S(2),),) * 3
    assert st.candidates_considered[-1][0][0].passes
    # the sequence sharded on both mesh dims: the ring runs on one, so not here
    args2 = tuple(ArgMeta(q, np.dtype(np.float32), (S(2), S(2))) for _ in range(3)) + (None,)
    res = rule_result(OpSchema("scaled_dot_product_attention", args2, (), (2, 2)))
    ring = next(c for c in res.candidates if c.passes)
    seq_q = next(c for c in res.candidates if not c.passes and c.placements[1] == S(2))
    assert not res.nd_check((ring, ring)) and not res.nd_check((ring, seq_q))
    assert res.nd_check((ring, res.candidates[0])) and res.nd_check((seq_q, seq_q))
