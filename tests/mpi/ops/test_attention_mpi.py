"""``dt.scaled_dot_product_attention`` and ``dt.rms_norm`` on DTensors at 1-4 ranks: query, key
and value sharded on the batch and head dims, or the query on its sequence dim with key and
value replicated (causal: the mask stays the global one on every block of queries; uneven
and empty blocks; sequences longer than a block of the blocked kernels), on the 1-D mesh and the 2x2 one; forward and gradients against the numpy
references of ``helpers.attention`` on the global data; the sharded forward moves nothing;
dropout draws the single-device mask."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import attention as ref
from helpers.mpi import meshes_dp_tp

import dtensor as dt
from dtensor.debug import CommDebugMode

R, S = dt.Replicate(), dt.Shard

#: name -> (q, k, v shapes, mask kind, is_causal, enable_gqa, per mesh dim: q, k/v, mask
#: placements); the 1-D mesh takes the first, the 2x2 mesh both
LAYOUTS = {
    "batch": (((4, 2, 5, 3), (4, 2, 6, 3), (4, 2, 6, 2)), "bool", False, False,
              ((S(0), S(0), S(0)), (S(1), S(1), R))),
    "heads": (((2, 5, 4, 3), (2, 5, 6, 3), (2, 5, 6, 4)), "float", False, False,
              ((S(1), S(1), S(1)), (S(0), S(0), R))),
    "query-causal": (((2, 3, 7, 4), (2, 3, 5, 4), (2, 3, 5, 2)), None, True, False,
                     ((S(2), R, None), (S(0), S(0), None))),
    "query-causal-gqa": (((1, 4, 5, 2), (1, 2, 5, 2), (1, 2, 5, 3)), None, True, True,
                         ((S(2), R, None), (S(2), R, None))),
    # longer than a block of the blocked kernels (64 queries): causal blocks of queries
    # that start inside a block and skip keys, and the fused backward on heads and batch
    "query-causal-long": (((2, 2, 150, 4), (2, 2, 150, 4), (2, 2, 150, 3)), None, True,
                          False, ((S(2), R, None), (S(0), S(0), None))),
    "heads-long": (((2, 3, 70, 4), (2, 3, 90, 4), (2, 3, 90, 2)), None, False, False,
                   ((S(1), S(1), None), (S(0), S(0), None))),
}


def _mask(kind, q, k, rng):
    if kind == "bool":
        m = rng.random((q[0], 1, q[-2], k[-2])) < 0.7
        m[0, :, 1] = False  # a query without any key
        return m
    if kind == "float":
        return rng.standard_normal((1, q[1], q[-2], k[-2]))
    return None


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_sharded_attention_matches_numpy(name):
    (qs, ks, vs), kind, causal, gqa, layouts = LAYOUTS[name]
    rng = np.random.default_rng(len(name))
    q, k, v = (rng.standard_normal(s) for s in (qs, ks, vs))
    mask = _mask(kind, qs, ks, rng)
    opts = {"causal": causal, "scale": 0.6, "gqa": gqa}
    want = ref.attention(q, k, v, mask, **opts)
    g = rng.standard_normal(want.shape)
    grads = ref.attention_grads(g, q, k, v, mask, **opts)
    for mesh in meshes_dp_tp():
        pl = list(zip(*layouts[: mesh.ndim]))  # per argument kind, one placement per mesh dim
        leaves = [dt.distribute_tensor(a, mesh, pl[0 if a is q else 1]).requires_grad_()
                  for a in (q, k, v)]
        tm = None
        if mask is not None:
            tm = dt.distribute_tensor(mask, mesh, pl[2])
            if kind == "float":
                tm.requires_grad_()
        with CommDebugMode() as comm:
            out = dt.scaled_dot_product_attention(*leaves, attn_mask=tm, is_causal=causal,
                                                  scale=0.6, enable_gqa=gqa)
        assert comm.get_total_counts() == 0, comm.get_comm_counts()
        assert tuple(out.placements) == tuple(pl[0]), out.placements
        np.testing.assert_allclose(out.full_tensor().numpy(), want, rtol=1e-12, atol=1e-12)
        (out * dt.distribute_tensor(g, mesh, out.placements)).sum().backward()
        for t, w in zip((*leaves, tm), grads):
            if w is not None:
                np.testing.assert_allclose(t.grad.full_tensor().numpy(), w, rtol=1e-10,
                                           atol=1e-12, err_msg=f"{name} on {mesh.shape}")


@pytest.mark.mpi(min_size=1)
def test_sharded_dropout_draws_the_single_device_mask():
    """Queries sharded (causal), ``value`` the identity: the output is the dropped-out
    weights, equal to the single-device call's from the same generator state; the gradients
    of query and key follow the mask read off it."""
    rng = np.random.default_rng(9)
    n_q, n_k, p = 7, 6, 0.3
    q, k = rng.standard_normal((2, n_q, 3)), rng.standard_normal((2, n_k, 3))
    v = np.broadcast_to(np.eye(n_k), (2, n_k, n_k)).copy()
    g = rng.standard_normal((2, n_q, n_k))
    w = ref.attention(q, k, v, causal=True)
    for mesh in meshes_dp_tp():
        dt.manual_seed(5)
        local = dt.scaled_dot_product_attention(*(dt.from_numpy(a) for a in (q, k, v)),
                                                dropout_p=p, is_causal=True).numpy()
        dt.manual_seed(5)
        pl = [S(1)] * mesh.ndim
        leaves = [dt.distribute_tensor(a, mesh, pl if a is q else [R] * mesh.ndim)
                  .requires_grad_() for a in (q, k, v)]
        out = dt.scaled_dot_product_attention(*leaves, dropout_p=p, is_causal=True)
        got = out.full_tensor().numpy()
        np.testing.assert_allclose(got, local, rtol=1e-12, atol=1e-15)
        keep = np.where(np.isclose(got, 0) & (w > 0), 0.0, 1 / (1 - p))
        assert np.allclose(got, w * keep)
        (out * dt.distribute_tensor(g, mesh, out.placements)).sum().backward()
        for t, want in zip(leaves, ref.attention_grads(g, q, k, v, causal=True, keep=keep)):
            np.testing.assert_allclose(t.grad.full_tensor().numpy(), want, rtol=1e-10,
                                       atol=1e-12)


@pytest.mark.mpi(min_size=1)
def test_sharded_rms_norm_matches_numpy():
    rng = np.random.default_rng(2)
    x, w, g = rng.standard_normal((5, 3, 4)), rng.standard_normal(4), \
        rng.standard_normal((5, 3, 4))
    want = ref.rms_norm(x, 1, w)
    gx, gw = ref.rms_norm_grads(g, x, 1, w)
    for mesh in meshes_dp_tp():
        pl = [S(0), S(1)][: mesh.ndim]
        tx = dt.distribute_tensor(x, mesh, pl).requires_grad_()
        tw = dt.distribute_tensor(w, mesh, [R] * mesh.ndim).requires_grad_()
        out = dt.rms_norm(tx, (4,), tw)
        assert tuple(out.placements) == tuple(pl)
        np.testing.assert_allclose(out.full_tensor().numpy(), want, rtol=1e-12)
        (out * dt.distribute_tensor(g, mesh, pl)).sum().backward()
        np.testing.assert_allclose(tx.grad.full_tensor().numpy(), gx, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(tw.grad.full_tensor().numpy(), gw, rtol=1e-10, atol=1e-12)
