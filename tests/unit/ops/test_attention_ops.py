"""``dt.scaled_dot_product_attention`` and ``dt.rms_norm`` on local tensors (one process):
forward and gradients against the numpy references of ``helpers.attention`` (random shapes,
boolean and float masks, causal with L != S, scale, batch and head dims, grouped-query
heads, float16), dropout (one mask in forward and backward, ``p=0`` is no dropout),
PyTorch's errors, and the sharding rules' candidates."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import attention as ref

import dtensor as dt
from dtensor.errors import ArgumentError, DTypeError, ShardingError
from placements import Replicate, Shard
from placements.rules import ArgMeta, OpSchema, rule_result

R = Replicate()

#: (batch dims, L, S, E, Ev, mask, is_causal, scale, key/value heads for grouped queries)
CASES = [
    ((2, 3), 5, 6, 4, 3, None, False, None, None),
    ((2, 3), 5, 6, 4, 2, "bool", False, 0.4, None),
    ((3,), 4, 7, 3, 5, "float", False, None, None),
    ((2, 2), 6, 4, 4, 3, None, True, 0.7, None),
    ((), 3, 8, 2, 4, None, True, None, None),
    ((2, 4), 5, 5, 3, 3, "bool-bcast", False, None, 2),
    ((1, 4), 6, 6, 4, 2, None, True, None, 1),
]


def _mask(kind, batch, n_q, n_k, rng):
    if kind is None:
        return None
    if kind == "float":
        return rng.standard_normal((*batch[:-1], 1, n_q, n_k))
    m = rng.random((n_q, n_k) if kind == "bool" else (batch[0], 1, 1, n_k)) < 0.7
    m[0] = False  # query 0 (or every query of batch 0) attends to no key: zeros
    return m


def _leaf(a):
    return dt.from_numpy(np.array(a)).requires_grad_()


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_attention_forward_and_gradients_against_numpy(case):
    batch, n_q, n_k, e, ev, kind, causal, scale, heads = case
    rng = np.random.default_rng(len(batch) * 10 + n_q)
    kv = batch if heads is None else (*batch[:-1], heads)
    q, k, v = (rng.standard_normal(s) for s in ((*batch, n_q, e), (*kv, n_k, e), (*kv, n_k, ev)))
    mask = _mask(kind, batch, n_q, n_k, rng)
    opts = {"causal": causal, "scale": scale, "gqa": heads is not None}
    want = ref.attention(q, k, v, mask, **opts)
    g = rng.standard_normal(want.shape)
    leaves = [_leaf(a) for a in (q, k, v)]
    tm = None if mask is None else (_leaf(mask) if mask.dtype != bool else dt.from_numpy(mask))
    out = dt.scaled_dot_product_attention(*leaves, attn_mask=tm, is_causal=causal, scale=scale,
                                          enable_gqa=heads is not None)
    assert out.dtype == dt.float64 and tuple(out.shape) == want.shape
    np.testing.assert_allclose(out.detach().numpy(), want, rtol=1e-12, atol=1e-12)
    (out * dt.from_numpy(g)).sum().backward()
    grads = ref.attention_grads(g, q, k, v, mask, **opts)
    for t, w in zip((*leaves, tm), grads):
        if w is None:
            assert t is None or not t.requires_grad
            continue
        np.testing.assert_allclose(t.grad.numpy(), w, rtol=1e-10, atol=1e-12)


def test_numpy_reference_gradients_are_the_finite_differences():
    """The analytic numpy backward itself, against central differences of its forward."""
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((2, 4, 3, 2)), rng.standard_normal((2, 2, 5, 2)), \
        rng.standard_normal((2, 2, 5, 3))
    mask = rng.standard_normal((3, 5))
    g = rng.standard_normal((2, 4, 3, 3))
    opts = {"scale": 0.8, "gqa": True}
    grads = ref.attention_grads(g, q, k, v, mask, **opts)
    for a, ga in zip((q, k, v, mask), grads):
        flat = a.reshape(-1)
        for i in rng.choice(flat.size, 6, replace=False):
            old = flat[i]
            flat[i] = old + 1e-6
            up = (ref.attention(q, k, v, mask, **opts) * g).sum()
            flat[i] = old - 1e-6
            down = (ref.attention(q, k, v, mask, **opts) * g).sum()
            flat[i] = old
            assert abs(ga.reshape(-1)[i] - (up - down) / 2e-6) < 1e-6
    x, w, gr = rng.standard_normal((3, 4)), rng.standard_normal(4), rng.standard_normal((3, 4))
    for a, ga in zip((x, w), ref.rms_norm_grads(gr, x, 1, w, 1e-3)):
        flat = a.reshape(-1)
        for i in range(flat.size):
            old = flat[i]
            flat[i] = old + 1e-6
            up = (ref.rms_norm(x, 1, w, 1e-3) * gr).sum()
            flat[i] = old - 1e-6
            down = (ref.rms_norm(x, 1, w, 1e-3) * gr).sum()
            flat[i] = old
            assert abs(ga.reshape(-1)[i] - (up - down) / 2e-6) < 1e-6


def test_attention_float32_and_float16_compute_stably():
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((2, 5, 4)) for _ in range(3))
    big = [10 * a for a in (q, k, v)]  # scores far beyond exp's float32 range
    for arrays, dtype, tol in ((big, np.float32, 1e-4), ((q, k, v), np.float16, 2e-2)):
        out = dt.scaled_dot_product_attention(*(dt.from_numpy(a.astype(dtype)) for a in arrays),
                                              is_causal=True)
        assert out.dtype == dtype and np.isfinite(out.numpy()).all()
        np.testing.assert_allclose(out.numpy(), ref.attention(*arrays, causal=True), rtol=tol,
                                   atol=tol * 10)
    m32 = rng.standard_normal((5, 5)).astype(np.float32)  # a float32 mask with float16 data
    out = dt.scaled_dot_product_attention(*(dt.from_numpy(a.astype(np.float16))
                                            for a in (q, k, v)), attn_mask=dt.from_numpy(m32))
    assert out.dtype == np.float16
    np.testing.assert_allclose(out.numpy(), ref.attention(q, k, v, m32), atol=2e-2)


def test_attention_dropout_uses_one_mask_in_forward_and_backward():
    """With ``value`` the identity, the output is the dropped-out weights: the mask read
    off the forward is the one the gradients of query and key must follow."""
    dt.manual_seed(11)
    rng = np.random.default_rng(5)
    n_q, n_k, p = 6, 8, 0.4
    q, k = rng.standard_normal((2, 3, n_q, 4)), rng.standard_normal((2, 3, n_k, 4))
    v = np.broadcast_to(np.eye(n_k), (2, 3, n_k, n_k)).copy()
    leaves = [_leaf(a) for a in (q, k, v)]
    out = dt.scaled_dot_product_attention(*leaves, dropout_p=p, is_causal=True)
    w = ref.attention(q, k, v, causal=True)
    got = out.detach().numpy()
    keep = np.where(w > 0, got / np.where(w > 0, w, 1), 1 / (1 - p))
    assert np.all(np.isclose(keep, 0) | np.isclose(keep, 1 / (1 - p)))
    keep = np.where(np.isclose(keep, 0), 0.0, 1 / (1 - p))
    assert 0.2 < (keep[w > 0] == 0).mean() < 0.6  # about p of the weights dropped
    g = rng.standard_normal(got.shape)
    (out * dt.from_numpy(g)).sum().backward()
    for t, want in zip(leaves, ref.attention_grads(g, q, k, v, causal=True, keep=keep)):
        np.testing.assert_allclose(t.grad.numpy(), want, rtol=1e-10, atol=1e-12)
    # another call draws another mask; p=0 is no dropout and draws nothing
    again = dt.scaled_dot_product_attention(*leaves, dropout_p=p, is_causal=True)
    assert not np.array_equal(again.detach().numpy(), got)
    state = dt.get_rng_state()
    plain = dt.scaled_dot_product_attention(*leaves, dropout_p=0.0, is_causal=True)
    np.testing.assert_array_equal(plain.detach().numpy(), dt.scaled_dot_product_attention(
        *leaves, is_causal=True).detach().numpy())
    np.testing.assert_array_equal(dt.get_rng_state().numpy(), state.numpy())
    np.testing.assert_allclose(plain.detach().numpy(), w, rtol=1e-12)


def test_rms_norm_forward_and_gradients_against_numpy():
    rng = np.random.default_rng(6)
    for shape, ns, with_w, eps in (((4, 5), 5, True, None), ((2, 3, 4), (3, 4), False, 1e-2),
                                   ((3, 2, 6), [6], True, 1e-5)):
        x = rng.standard_normal(shape)
        nd = 1 if isinstance(ns, int) else len(ns)
        w = rng.standard_normal(shape[-nd:]) if with_w else None
        want = ref.rms_norm(x, nd, w, eps)
        g = rng.standard_normal(shape)
        tx = _leaf(x)
        tw = None if w is None else _leaf(w)
        out = dt.rms_norm(tx, ns, tw, eps=eps)
        np.testing.assert_allclose(out.detach().numpy(), want, rtol=1e-12)
        (out * dt.from_numpy(g)).sum().backward()
        gx, gw = ref.rms_norm_grads(g, x, nd, w, eps)
        np.testing.assert_allclose(tx.grad.numpy(), gx, rtol=1e-10, atol=1e-12)
        if w is not None:
            np.testing.assert_allclose(tw.grad.numpy(), gw, rtol=1e-10, atol=1e-12)


def test_rms_norm_dtypes_and_default_eps():
    x = np.full((2, 3), 1e-4)  # eps matters: finfo(dtype).eps, float32's for float16
    for dtype in (np.float64, np.float32, np.float16):
        out = dt.rms_norm(dt.from_numpy(x.astype(dtype)), (3,))
        assert out.dtype == dtype
        np.testing.assert_allclose(out.numpy().astype(np.float64),
                                   ref.rms_norm(x.astype(dtype), 1), rtol=2e-3)
    out = dt.rms_norm(dt.from_numpy(x.astype(np.float32)), 3, dt.ones(3, dtype=dt.float64))
    assert out.dtype == dt.float64  # the normalised value times the weight: promoted


def test_errors_name_the_op_and_say_what_pytorch_says():
    q = dt.ones(2, 3, 4)
    sdpa = dt.scaled_dot_product_attention
    with pytest.raises(ArgumentError, match="Explicit attn_mask should not be set when "
                                            "is_causal=True"):
        sdpa(q, q, q, attn_mask=dt.ones(3, 3, dtype=dt.bool), is_causal=True)
    with pytest.raises(ArgumentError, match="dropout probability has to be between 0 and 1, "
                                            "but got 1.5"):
        sdpa(q, q, q, dropout_p=1.5)
    with pytest.raises(DTypeError, match="same dtype, but got query.dtype: float32 key.dtype: "
                                         "float64"):
        sdpa(q, q.double(), q)
    with pytest.raises(DTypeError, match="attn_mask dtype to be bool or float"):
        sdpa(q, q, q, attn_mask=dt.ones(3, 3, dtype=dt.int64))
    with pytest.raises(ShardingError, match="scaled_dot_product_attention: expected query"):
        sdpa(q, dt.ones(2, 3, 5), q)
    with pytest.raises(ShardingError, match="at least 2 dimensional"):
        sdpa(dt.ones(4), dt.ones(4), dt.ones(4))
    with pytest.raises(ShardingError, match="attn_mask of shape \\[4, 3\\] does not broadcast"):
        sdpa(q, q, q, attn_mask=dt.ones(4, 3, dtype=dt.bool))
    with pytest.raises(ShardingError, match="must divide the number of heads"):
        sdpa(dt.ones(1, 3, 2, 4), dt.ones(1, 2, 2, 4), dt.ones(1, 2, 2, 4), enable_gqa=True)
    with pytest.raises(ShardingError, match="do not broadcast"):  # heads differ, no gqa
        sdpa(dt.ones(1, 4, 2, 4), dt.ones(1, 2, 2, 4), dt.ones(1, 2, 2, 4))
    with pytest.raises(ShardingError, match="rms_norm: given normalized_shape=\\[3\\], expected "
                                            "input with shape \\[\\*, 3\\], but got input of "
                                            "size \\[2, 3, 4\\]"):
        dt.rms_norm(q, 3)
    with pytest.raises(ShardingError, match="rms_norm: weight of shape \\[3\\]"):
        dt.rms_norm(q, 4, dt.ones(3))


def _args(*shapes):
    return tuple(None if s is None else ArgMeta(s, np.dtype(np.float32)) for s in shapes)


def _candidates(op, args, **static):
    return {c.placements for c in rule_result(OpSchema(op, args, tuple(static.items()),
                                                       (2,))).candidates}


def test_rules_shard_the_batch_heads_and_query_dims():
    S = Shard
    q, k, v = (2, 4, 6, 8), (2, 4, 7, 8), (2, 4, 7, 3)
    m = ArgMeta((4, 1, 7), np.dtype(bool))
    got = _candidates("scaled_dot_product_attention", (*_args(q, k, v), m), enable_gqa=False)
    assert got == {(R, R, R, R, R), (S(0), S(0), S(0), S(0), R), (S(1), S(1), S(1), S(1), S(0)),
                   (S(2), S(2), R, R, R)}
    # grouped heads stay whole; a key broadcast on the batch dim is replicated there
    got = _candidates("scaled_dot_product_attention",
                      _args(q, (1, 2, 7, 8), (1, 2, 7, 3), None), enable_gqa=True)
    assert got == {(R, R, R, R, None), (S(0), S(0), R, R, None), (S(2), S(2), R, R, None)}
    got = _candidates("rms_norm", _args((4, 5, 6), (6,)), normalized_shape=(6,))
    assert got == {(R, R, R), (S(0), S(0), R), (S(1), S(1), R)}
