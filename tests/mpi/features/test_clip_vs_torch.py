"""``dt.nn.utils.clip_grad_norm_`` and ``get_total_norm`` on DTensor gradients against
``torch.nn.utils.clip_grad_norm_`` on the global gradients, at 1-4 ranks.

Norm types 1, 2, 3, inf (and 0.5); gradients Shard on either dim (uneven at 3 ranks, an
empty shard at 4), Replicate and Partial (random per-rank contributions; sum, avg, and the
max and min kinds), on the world's 1-D mesh and, at 4 ranks, 2x2 layouts, mixed with a local
(non-distributed) gradient; clipping or not. Every rank must return the same total (it is
gathered and compared) and hold torch's clipped gradients.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from mpi4py import MPI

import dtensor as dt
from dtensor.testing import distribute_random

pytestmark = pytest.mark.torch

WORLD = MPI.COMM_WORLD
R, S, P = dt.Replicate(), dt.Shard, dt.Partial
NORMS = [1.0, 2.0, 3.0, math.inf, 0.5]
# (shape, placements on the 1-D mesh): uneven rows, one row (empty shards), columns
ONE_D = [((5, 3), [S(0)]), ((1, 4), [S(0)]), ((3, 7), [S(1)]), ((4,), [R]),
         ((2, 5), [P("sum")]), ((2, 3), [P("avg")]), ((6,), [P("max")]), ((3, 2), [P("min")])]
TWO_D = [((5, 3), [S(0), S(1)]), ((3, 5), [P("sum"), S(1)]), ((4, 3), [S(0), P("sum")]),
         ((1, 6), [S(0), S(0)]), ((3,), [R, P("max")])]


def _grads(seed, scale):
    """(global gradient, DTensor or local gradient) pairs on the meshes of this world size."""
    rng = np.random.default_rng(seed)
    layouts = [((WORLD.size,), pl, s) for s, pl in ONE_D]
    if WORLD.size == 4:
        layouts += [((2, 2), pl, s) for s, pl in TWO_D]
    out = []
    for k, (mesh_shape, pl, shape) in enumerate(layouts):
        g = (rng.standard_normal(shape) * scale).astype(np.float32)
        mesh = dt.init_device_mesh(mesh_shape)
        out.append((g, distribute_random(g, mesh, pl, seed=seed + k)))
    g = (rng.standard_normal((2, 3)) * scale).astype(np.float32)
    out.append((g, dt.tensor(g)))  # a local gradient among them
    return out


def _params(pairs):
    params = []
    for _, grad in pairs:
        p = dt.zeros_like(grad).requires_grad_() if isinstance(grad, dt.DTensor) else (
            dt.zeros(grad.shape).requires_grad_())
        p.grad = grad
        params.append(p)
    return params


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("norm_type", NORMS, ids=str)
@pytest.mark.parametrize("max_norm", [0.7, 1e6])  # clips, leaves them
def test_clip_grad_norm_matches_torch_on_the_global_gradients(norm_type, max_norm):
    import torch  # lazy: the oracle (the module is marked torch)

    pairs = _grads(seed=3 + NORMS.index(norm_type), scale=2.0)
    params = _params(pairs)
    total = float(dt.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type).numpy())
    tparams = [torch.zeros(g.shape, requires_grad=True) for g, _ in pairs]
    for tp, (g, _) in zip(tparams, pairs):
        tp.grad = torch.from_numpy(g.copy())
    want = float(torch.nn.utils.clip_grad_norm_(tparams, max_norm, norm_type=norm_type))
    totals = WORLD.allgather(total)
    assert len(set(totals)) == 1, f"ranks disagree on the total {norm_type}-norm: {totals}"
    np.testing.assert_allclose(total, want, rtol=2e-6)
    for i, (p, tp) in enumerate(zip(params, tparams)):
        got = p.grad.full_tensor() if isinstance(p.grad, dt.DTensor) else p.grad
        np.testing.assert_allclose(got.numpy(), tp.grad.numpy(), rtol=2e-6, atol=1e-7,
                                   err_msg=f"gradient {i}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("norm_type", NORMS, ids=str)
def test_total_norm_of_each_layout_alone_matches_torch(norm_type):
    """Each gradient's own norm (one layout at a time): a layout whose shards disagree is
    named, not averaged away among the others."""
    import torch  # lazy: the oracle (the module is marked torch)

    for i, (g, grad) in enumerate(_grads(seed=17, scale=1.0)):
        got = float(dt.nn.utils.get_total_norm([grad], norm_type).numpy())
        want = float(torch.nn.utils.get_total_norm([torch.from_numpy(g)], norm_type))
        totals = WORLD.allgather(got)
        assert len(set(totals)) == 1, (i, grad, totals)
        np.testing.assert_allclose(got, want, rtol=2e-6, err_msg=f"gradient {i}")
