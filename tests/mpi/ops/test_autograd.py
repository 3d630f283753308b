"""Autograd on DTensors: the gradients of DTensor programs equal torch's gradients of the
same program on the global values (float64), over sampled input placements (uneven and empty
shards, Partial inputs with real per-rank contributions), redistribute chains,
``from_local``/``to_local`` with ``grad_placements``, and the backward collectives that
CommDebugMode sees. The programs are written once against a namespace (``dtensor`` or
``torch``); where torch has no equal (scatter with repeated indices, dtensor's own dropout
mask) the oracle is numpy or the definition itself."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from helpers.mpi import meshes
from mpi4py import MPI

import dtensor as dt
from dtensor.debug import CommDebugMode
from dtensor.errors import AutogradError, PlacementError
from dtensor.testing import distribute_random

WORLD = MPI.COMM_WORLD
R, S, P = dt.Replicate(), dt.Shard, dt.Partial


def placement_choices(mesh, ndim, partial=True):
    """Every placement list of a tensor of ``ndim`` dims on ``mesh``."""
    one = [R, *[S(d) for d in range(ndim)]] + ([P("sum")] if partial else [])
    return list(itertools.product(one, repeat=mesh.ndim))


def grad_placements(placements):
    return tuple(R if isinstance(p, dt.Partial) else p for p in placements)


def _nn(F):
    """Where the functional nn ops live: ``dtensor`` itself, ``torch.nn.functional``."""
    return F if F is dt else F.nn.functional


# program name -> (function of a namespace and tensors, shapes); the same code runs on torch
# tensors (the oracle, on the global values) and on DTensors
PROGRAMS = {
    "mlp": (lambda F, x, w1, b1, w2: ((x @ w1 + b1).relu() @ w2).tanh().sum(),
            ((5, 6), (6, 7), (7,), (7, 3))),
    "pointwise": (lambda F, x, y: (x * y).exp().mean() + (x - y * 2.0).sigmoid().sum()
                  + (x / (y * y + 1.0)).sum(), ((5, 6), (5, 6))),
    "broadcast": (lambda F, x, b: ((x + b) * b).square().sum(), ((5, 6), (6,))),
    "reductions": (lambda F, x: x.amax(dim=1).sum() + x.var(dim=0).sum()
                   + x.logsumexp(1).sum() + x.norm() + x.mean(dim=0).pow(2.0).sum(),
                   ((5, 6),)),
    "nn": (lambda F, x, w, b: _nn(F).layer_norm(x.softmax(-1) * 3.0, (6,), w, b)
           .log_softmax(0).sum(), ((5, 6), (6,), (6,))),
    "views": (lambda F, x, y: (x.T @ y).sum() + F.cat([x, y], 0).sum(0).square().sum()
              + x.reshape(-1).cumsum(0).sum() + x[1:4].sum() + x.transpose(0, 1)[2].sum(),
              ((5, 6), (5, 6))),
}


def _global(shapes, seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s) for s in shapes]


def _torch_grads(fn, arrays, *args):
    """torch's gradients of ``fn(torch, *args, *leaves)`` at ``arrays`` (float64)."""
    import torch  # lazy: the oracle (the tests using it are marked torch)

    leaves = [torch.from_numpy(a.copy()).requires_grad_() for a in arrays]
    fn(torch, *args, *leaves).backward()
    return [t.grad.numpy() for t in leaves]


def _check_program(fn, arrays, mesh, placements, seed):
    want = _torch_grads(fn, arrays)
    leaves = [distribute_random(a, mesh, pl, seed=seed + i).requires_grad_()
              for i, (a, pl) in enumerate(zip(arrays, placements))]
    loss = fn(dt, *leaves)
    loss.backward()
    for a, d, pl, w in zip(arrays, leaves, placements, want):
        assert d.grad is not None
        assert tuple(d.grad.placements) == grad_placements(pl)
        np.testing.assert_allclose(d.grad.full_tensor().numpy(), w, rtol=1e-9, atol=1e-9,
                                   err_msg=f"placements {placements}")


@pytest.mark.torch
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_program_gradients_match_torch(name, rng):
    fn, shapes = PROGRAMS[name]
    arrays = _global(shapes, 3)
    for mesh in meshes():
        choices = [placement_choices(mesh, len(s)) for s in shapes]
        for k in range(4 if mesh.ndim == 1 else 3):
            placements = [c[rng.integers(len(c))] for c in choices]
            _check_program(fn, arrays, mesh, placements, seed=10 * k)


def _ce_embedding(F, t, i, x, w):
    return _nn(F).cross_entropy(x + _nn(F).embedding(i, w), t)


@pytest.mark.torch
@pytest.mark.mpi(min_size=1)
def test_cross_entropy_and_embedding_gradients_match_torch():
    import torch  # lazy: the oracle (marked torch)

    rng_data = np.random.default_rng(5)
    logits = rng_data.standard_normal((6, 5))
    target = rng_data.integers(0, 5, (6,))
    weight = rng_data.standard_normal((7, 5))
    idx = rng_data.integers(0, 7, (6,))
    want_x, want_w = _torch_grads(_ce_embedding, (logits, weight), torch.from_numpy(target),
                                  torch.from_numpy(idx))
    for mesh in meshes():
        reps = [R] * mesh.ndim
        for pl in ([S(0)] + [R] * (mesh.ndim - 1), reps):
            x = distribute_random(logits, mesh, pl, seed=1).requires_grad_()
            w = distribute_random(weight, mesh, reps, seed=2).requires_grad_()
            t = dt.distribute_tensor(dt.from_numpy(target), mesh, pl, src_data_rank=None)
            i = dt.distribute_tensor(dt.from_numpy(idx), mesh, pl, src_data_rank=None)
            _ce_embedding(dt, t, i, x, w).backward()
            np.testing.assert_allclose(x.grad.full_tensor().numpy(), want_x, atol=1e-12)
            np.testing.assert_allclose(w.grad.full_tensor().numpy(), want_w, atol=1e-12)


_IDX = np.array([[0, 2, 1], [4, 0, 0], [1, 1, 3], [2, 5, 0], [3, 3, 3]])
#: Fixed weights of the scatter term: its output enters the loss linearly, so no gradient
#: depends on which of several writes to one position torch keeps.
_SCATTER_W = np.random.default_rng(12).standard_normal((5, 6))
#: The entries of ``_IDX`` whose write a scatter keeps (the last of equal indices in a row).
_KEPT = np.array([[j == max(k for k in range(3) if row[k] == row[j]) for j in range(3)]
                  for row in _IDX])


def _index_program(F, mk, x, src):
    """Indexing ops (gather, sort, topk, kthvalue, masked_fill, index_select, scatter,
    scatter_add, x[idx] = v) of ``x`` (5, 6) and ``src`` (5, 3); ``mk`` makes an index
    (or constant) tensor of the program's kind from an array."""
    i = mk(_IDX)
    y = x * 1.0
    y[1:3, 2] = src[0, 0] * 2.0 + src[1:3, 1:].sum()  # two ints: a DTensor getitem backward
    return (x.gather(1, i).square().sum() + x.sort(1)[0][:, :2].sum() * 2.0
            + x.topk(2, 0)[0].exp().sum() + x.kthvalue(2, 1)[0].sum()
            + x.masked_fill(x > 0.5, 0.0).square().sum()
            + x.index_select(0, mk(np.array([4, 1, 1]))).sum() * 3.0
            + (x.scatter(1, i, src) * mk(_SCATTER_W)).sum()
            + x.scatter_add(1, i, src * src).sum() + y.tanh().sum())


@pytest.mark.torch
@pytest.mark.mpi(min_size=1)
def test_index_op_gradients_match_torch(rng):
    import torch  # lazy: the oracle (marked torch)

    a, s = rng.standard_normal((5, 6)), rng.standard_normal((5, 3))
    want = _torch_grads(_index_program, (a, s), torch.from_numpy)
    # torch gives every entry of ``src`` the gradient of its position, also an overwritten
    # one; dtensor gives an overwritten entry none (its value reaches no output)
    want[1] = want[1] - np.take_along_axis(_SCATTER_W, _IDX, 1) * ~_KEPT
    for mesh in meshes():
        choices = placement_choices(mesh, 2)
        for k, pl in enumerate(choices[:: 3 if mesh.ndim > 1 else 1]):
            x = distribute_random(a, mesh, pl, seed=k).requires_grad_()
            src = distribute_random(s, mesh, [R] * mesh.ndim, seed=k).requires_grad_()
            index = lambda n, mesh=mesh: dt.distribute_tensor(n, mesh, [R] * mesh.ndim)
            _index_program(dt, index, x, src).backward()
            for d, w in zip((x, src), want):
                np.testing.assert_allclose(d.grad.full_tensor().numpy(), w, rtol=1e-9,
                                           atol=1e-9, err_msg=f"placements {pl}")


@pytest.mark.mpi(min_size=1)
def test_redistribute_chains(rng):
    value = np.random.default_rng(9).standard_normal((5, 6))
    want = 3 * value * value  # d/dx sum(x^3)
    for mesh in meshes():
        choices = placement_choices(mesh, 2)
        for _ in range(5):
            chain = [choices[rng.integers(len(choices))] for _ in range(4)]
            x = distribute_random(value, mesh, chain[0], seed=4).requires_grad_()
            y = x
            for pl in chain[1:]:
                y = y.redistribute(mesh, pl)
            assert y.grad_fn is not None or tuple(y.placements) == tuple(chain[0])
            (y * y * y).sum().backward()
            assert tuple(x.grad.placements) == grad_placements(chain[0])
            np.testing.assert_allclose(x.grad.full_tensor().numpy(), want, rtol=1e-12,
                                       err_msg=f"chain {chain}")


@pytest.mark.mpi(min_size=1)
def test_redistribute_gradient_goes_back_to_input_placements():
    mesh = dt.init_device_mesh((WORLD.size,))
    value = np.arange(12.0).reshape(6, 2)
    x = dt.distribute_tensor(value, mesh, [S(0)]).requires_grad_()
    y = x.redistribute(mesh, [R])
    assert y.grad_fn.name() == "RedistributeBackward0"
    (g,) = dt.autograd.grad((y * 2.0).sum(), [x])
    assert tuple(g.placements) == (S(0),)  # arrives Replicate, goes back as S(0)
    np.testing.assert_allclose(g.full_tensor().numpy(), 2.0)
    p = distribute_random(value, mesh, [P("sum")], seed=3).requires_grad_()
    q = p.redistribute(mesh, [R])
    (gp,) = dt.autograd.grad((q * q).sum(), [p])
    assert tuple(gp.placements) == (R,)  # the gradient of a P(sum) input is Replicate
    np.testing.assert_allclose(gp.full_tensor().numpy(), 2 * value)


@pytest.mark.mpi(min_size=1)
def test_full_tensor_is_differentiable():
    mesh = dt.init_device_mesh((WORLD.size,))
    value = np.random.default_rng(2).standard_normal((7, 3))
    x = dt.distribute_tensor(value, mesh, [S(0)]).requires_grad_()
    full = x.full_tensor()
    assert isinstance(full, dt.Tensor) and full.requires_grad
    (full * full).sum().backward()
    np.testing.assert_allclose(x.grad.full_tensor().numpy(), 2 * value)


@pytest.mark.mpi(min_size=1)
def test_to_local_and_from_local_grad_placements():
    mesh = dt.init_device_mesh((WORLD.size,))
    value = np.random.default_rng(4).standard_normal((2 * WORLD.size + 1, 3))
    x = dt.distribute_tensor(value, mesh, [S(0)]).requires_grad_()
    local = x.to_local()
    assert local.grad_fn.name() == "ToLocalBackward0"
    (local * local).sum().backward()  # each rank's shard: gradient laid out S(0)
    np.testing.assert_allclose(x.grad.full_tensor().numpy(), 2 * value)
    # grad_placements=R: every rank's local gradient is the whole gradient
    r = dt.distribute_tensor(value, mesh, [R]).requires_grad_()
    (r.to_local(grad_placements=[R]) * 3.0).sum().backward()
    np.testing.assert_allclose(r.grad.full_tensor().numpy(), 3.0)
    # from_local: the DTensor's gradient comes back as this rank's shard
    shard = x.detach().to_local().clone().requires_grad_()
    d = dt.DTensor.from_local(shard, mesh, [S(0)], shape=value.shape)
    assert d.grad_fn.name() == "FromLocalBackward0"
    (d * d).sum().backward()
    np.testing.assert_allclose(shard.grad.numpy(), 2 * shard.detach().numpy())
    # from_local of a P(sum) contribution: every contribution gets the sum's gradient
    part = dt.from_numpy(np.ones((2, 2))).requires_grad_()
    s = dt.DTensor.from_local(part, mesh, [P("sum")])
    (s.redistribute(mesh, [R]) * 5.0).sum().backward()
    np.testing.assert_allclose(part.grad.numpy(), 5.0)
    # mismatched grad_placements
    with pytest.raises(PlacementError, match="to_local"):
        x.to_local(grad_placements=[R, R])
    if WORLD.size > 1:
        with pytest.raises(AutogradError, match="to_local: grad_placements"):
            dt.distribute_tensor(value, mesh, [R]).requires_grad_().to_local(
                grad_placements=[S(0)])


@pytest.mark.mpi(min_size=2)
def test_comm_debug_mode_sees_backward_collectives():
    mesh = dt.init_device_mesh((WORLD.size,))
    x = dt.distribute_tensor(np.ones((8, 4)), mesh, [S(0)])
    w = dt.distribute_tensor(np.ones((4, 3)), mesh, [R]).requires_grad_()
    loss = (x @ w).sum()
    with CommDebugMode() as forward:
        pass
    with CommDebugMode() as backward:
        loss.backward()
    # data parallel: the weight's gradient is a Partial sum, all-reduced into its layout
    assert forward.get_total_counts() == 0
    assert backward.get_comm_counts().get("all_reduce", 0) >= 1
    np.testing.assert_allclose(w.grad.full_tensor().numpy(), 8.0)


@pytest.mark.mpi(min_size=1)
def test_errors_name_the_op_on_dtensors():
    mesh = dt.init_device_mesh((WORLD.size,))
    x = dt.distribute_tensor(np.ones((4, 3)), mesh, [S(0)]).requires_grad_()
    with pytest.raises(AutogradError, match="implicitly created only for scalar outputs"):
        (x * 2).backward()
    with pytest.raises(AutogradError, match="mul_: a leaf Variable"):
        x.mul_(2.0)
    y = x.exp()
    y.add_(1.0)
    with pytest.raises(AutogradError, match="exp: one of the variables needed"):
        y.sum().backward()
    z = (x * x).sum()
    z.backward()
    with pytest.raises(AutogradError, match="second time"):
        z.backward()


@pytest.mark.mpi(min_size=1)
def test_dropout_gradient_is_the_kept_mask_over_one_minus_p():
    """The gradient of ``sum(dropout(x, p))`` is ``1 / (1 - p)`` exactly where the output
    kept the input and 0 where it dropped it (the definition, on the global values); the
    DTensor draws the single-device mask of the same seed (dtensor's own generator, so
    that part compares with the local op)."""
    p = 0.4
    value = np.random.default_rng(6).standard_normal((9, 4))
    dt.manual_seed(3)
    local_out = dt.dropout(dt.from_numpy(value.copy()), p).numpy()
    for mesh in meshes():
        for pl in placement_choices(mesh, 2, partial=False)[:3]:
            dt.manual_seed(3)
            x = dt.distribute_tensor(value, mesh, pl).requires_grad_()
            out = dt.dropout(x, p)
            out.sum().backward()
            got_out = out.full_tensor().numpy()
            kept = got_out != 0
            assert 0 < kept.sum() < kept.size, f"{pl}: a mask of all {kept.flat[0]}"
            np.testing.assert_allclose(got_out[kept], value[kept] / (1 - p), rtol=1e-12)
            np.testing.assert_allclose(x.grad.full_tensor().numpy(), kept / (1 - p),
                                       rtol=1e-12, err_msg=f"{pl}")
            np.testing.assert_array_equal(got_out, local_out)


@pytest.mark.mpi(min_size=1)
def test_cat_gives_a_skipped_legacy_empty_dtensor_an_empty_gradient():
    # the DTensor side of the unit regression test: cat skips a 1-D empty input, whose
    # gradient is an empty (0,) DTensor, the others' the pieces of the output's gradient
    w = np.random.default_rng(7).standard_normal((5, 3))
    for mesh in meshes():
        for pl in placement_choices(mesh, 2, partial=False):
            x = dt.distribute_tensor(np.ones((5, 3)), mesh, pl).requires_grad_()
            empty = dt.distribute_tensor(np.zeros(0), mesh, [R] * mesh.ndim).requires_grad_()
            y = dt.cat([empty, x], dim=0) * dt.distribute_tensor(w, mesh, [R] * mesh.ndim)
            y.sum().backward()
            assert tuple(empty.grad.shape) == (0,)
            np.testing.assert_array_equal(x.grad.full_tensor().numpy(), w)


def _penalty(F, x, w1, b1, w2):
    """A loss plus the squared norm of its gradient (``create_graph=True``)."""
    h = (x @ w1 + b1).tanh()
    out = _nn(F).gelu(h @ w2, approximate="tanh")
    loss = ((out.softmax(-1) * out.exp().sigmoid()).sum() + h.relu().pow(3).mean()
            + (x.sin() * x).sum() + x[1:, 2].exp().sum())
    (g,) = F.autograd.grad(loss, x, create_graph=True)
    return (g * g).sum() + loss


def _write_through_views(F, a, x):
    """In-place writes through views (of dim 1: local on a row-sharded base) of a
    non-leaf; ``v`` is used after later writes to its base."""
    b = a.clone()
    v = b[:, 1]
    v.add_(x)
    b[:, 2:4].mul_((b[:, :2] + 0.0).sin())
    b.t()[4].mul_(x)
    b.narrow(1, 0, 1).mul_(3.0)
    return (b * b).sum() + (v * v.exp()).sum()


@pytest.mark.torch
@pytest.mark.mpi(min_size=2)
def test_second_derivatives_and_writes_through_views_match_torch(rng):
    """Higher-order gradients (a gradient penalty, sampled placements with Partial inputs)
    and in-place writes through views of a row-sharded or replicated base."""
    shapes = ((5, 4), (4, 6), (6,), (6, 3))
    arrays = _global(shapes, 6)
    mesh = dt.init_device_mesh((WORLD.size,))
    choices = [placement_choices(mesh, len(s)) for s in shapes]
    for k in range(2):
        placements = [c[rng.integers(len(c))] for c in choices]
        _check_program(_penalty, arrays, mesh, placements, seed=20 * k)
    arrays = _global(((2 * WORLD.size + 1, 6), (2 * WORLD.size + 1,)), 7)
    for pl in ([S(0)], [R]):
        _check_program(_write_through_views, arrays, mesh, [pl, pl], seed=30)
    # through to_local: its backward's wrap of the local gradient is recorded
    value = arrays[0]
    x = dt.distribute_tensor(value, mesh, [S(0)]).requires_grad_()
    (g,) = dt.autograd.grad(x.to_local().pow(3).sum(), x, create_graph=True)
    g.sum().backward()
    np.testing.assert_allclose(x.grad.full_tensor().numpy(), 6 * value, atol=1e-12)


#: Index keys whose gradient writes into zeros (stepped slices, masks, integer arrays,
#: repeated entries along one dim): functions of the global value (for the mask) and of a
#: maker of index tensors (``dt.from_numpy`` or ``torch.from_numpy``).
_ADVANCED_KEYS = (
    lambda v, mk: (slice(None, None, 2),),
    lambda v, mk: ([0, 3, 1],),
    lambda v, mk: (slice(None), [1, 3, 1]),
    lambda v, mk: (mk(v > 0),),
    lambda v, mk: ([0, 1], [2, 3]),
    lambda v, mk: (np.array([[2], [0]]), np.array([3, 1, 0])),  # broadcast; dims kept sharded
    lambda v, mk: (np.array([4, 1]), -1),  # an int among the arrays
    lambda v, mk: (Ellipsis, mk(np.array([2, 2, 0]))),
)


@pytest.mark.mpi(min_size=2)
def test_advanced_index_gradients_match_numpy():
    """The gradient of ``x[k].exp().sum()`` is ``exp(x[k])`` added into zeros at ``k``
    (numpy's ``add.at``: repeated entries add up)."""
    mesh = dt.init_device_mesh((WORLD.size,))
    value = np.random.default_rng(9).standard_normal((2 * WORLD.size + 1, 4))
    for key in _ADVANCED_KEYS:
        k_np = key(value, lambda a: a)
        want = np.zeros_like(value)
        np.add.at(want, k_np, np.exp(value[k_np]))
        k = key(value, dt.from_numpy)
        for pl in ([R], [S(0)], [S(1)]):
            x = dt.distribute_tensor(value, mesh, pl).requires_grad_()
            x[k].exp().sum().backward()
            np.testing.assert_allclose(x.grad.full_tensor().numpy(), want,
                                       atol=1e-12, err_msg=f"{k} {pl}")
