"""``dt.optim`` and ``dt.nn.utils.clip_grad_norm_`` on DTensor parameters: training steps
over sharded, replicated and 2-D layouts (uneven shards included) equal ``torch.optim``'s
steps (with ``torch.nn.utils.clip_grad_norm_``) on the global values, an optimizer step moves
no data, clipping uses the global norm, and state dicts load across placements."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from mpi4py import MPI

import dtensor as dt
from dtensor.debug import CommDebugMode

WORLD = MPI.COMM_WORLD
R, S = dt.Replicate(), dt.Shard
SHAPES = ((5, 3), (7,))  # uneven shards at 2-4 ranks
OPTIMIZERS = [
    ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    ("Adam", {"lr": 0.05, "amsgrad": True}),
    ("AdamW", {"lr": 0.05, "weight_decay": 0.1}),
]


def layouts():
    """(mesh, placements of the 2-D parameter, of the 1-D one) to try."""
    mesh = dt.init_device_mesh((WORLD.size,))
    out = [(mesh, (S(0),), (S(0),)), (mesh, (S(1),), (R,)), (mesh, (R,), (S(0),))]
    if WORLD.size == 4:
        mesh2 = dt.init_device_mesh((2, 2))
        out += [(mesh2, pa, pb) for pa, pb in itertools.islice(
            itertools.product(itertools.product([R, S(0), S(1)], repeat=2),
                              itertools.product([R, S(0)], repeat=2)), 0, None, 7)]
    return out


def loss_of(w, b, x):
    return ((x @ w + b[:3]).tanh() * 2.0).square().sum() + (b * b).sum()


def _train(name, kwargs, params, x, steps=3, clip=None, lib=dt):
    """``steps`` steps of ``lib.optim.<name>`` (``lib``: dtensor, or torch as the oracle);
    the optimizer and the total norm before each clip."""
    opt = getattr(lib.optim, name)(params, **kwargs)
    norms = []
    for _ in range(steps):
        opt.zero_grad()
        loss_of(*params, x).backward()
        if clip is not None:
            norms.append(float(lib.nn.utils.clip_grad_norm_(params, clip)))
        opt.step()
    return opt, norms


def _torch_train(name, kwargs, arrays, x, steps=3, clip=None):
    """The oracle: the same steps in torch on the global values; parameters as numpy."""
    import torch  # lazy: the oracle (the tests using it are marked torch)

    params = [torch.tensor(a, requires_grad=True) for a in arrays]
    _, norms = _train(name, kwargs, params, torch.tensor(x), steps, clip, lib=torch)
    return [p.detach().numpy() for p in params], norms


@pytest.mark.torch
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize(("name", "kwargs"), OPTIMIZERS, ids=[o[0] for o in OPTIMIZERS])
def test_training_steps_match_torch_on_every_layout(name, kwargs):
    rng = np.random.default_rng(11)
    w0, b0 = (rng.standard_normal(s) for s in SHAPES)
    x0 = rng.standard_normal((4, 5))
    want, want_norms = _torch_train(name, kwargs, (w0, b0), x0, clip=1.0)
    for mesh, pw, pb in layouts():
        w = dt.distribute_tensor(w0, mesh, list(pw)).requires_grad_()
        b = dt.distribute_tensor(b0, mesh, list(pb)).requires_grad_()
        x = dt.distribute_tensor(x0, mesh, [R] * mesh.ndim)
        opt, norms = _train(name, kwargs, [w, b], x, clip=1.0)
        where = f"{name} on {mesh.shape} with {pw}, {pb}"
        np.testing.assert_allclose(norms, want_norms, rtol=1e-10, err_msg=where)
        for d, ref in zip((w, b), want):
            assert tuple(d.placements) == tuple(d.grad.placements), where
            np.testing.assert_allclose(d.full_tensor().numpy(), ref,
                                       rtol=1e-10, atol=1e-12, err_msg=where)
        for state in opt.state.values():  # the state is laid out like its parameter
            for key, v in state.items():
                if key != "step":
                    assert isinstance(v, dt.DTensor) and v.device_mesh is mesh, where


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(("name", "kwargs"), OPTIMIZERS, ids=[o[0] for o in OPTIMIZERS])
def test_an_optimizer_step_moves_no_data(name, kwargs):
    mesh = dt.init_device_mesh((WORLD.size,))
    w = dt.distribute_tensor(np.ones((6, 4)), mesh, [S(1)]).requires_grad_()
    b = dt.distribute_tensor(np.ones(4), mesh, [R]).requires_grad_()
    opt = getattr(dt.optim, name)([w, b], **kwargs)
    for _ in range(2):  # the first step creates the state
        opt.zero_grad()
        ((w * 3.0).sum() + (b * b).sum()).backward()
        with CommDebugMode() as comm:
            opt.step()
        assert comm.get_total_counts() == 0, comm.get_comm_counts()


@pytest.mark.mpi(min_size=1)
def test_clip_grad_norm_uses_the_global_norm():
    mesh = dt.init_device_mesh((WORLD.size,))
    g0 = np.arange(1.0, 8.0)
    for pl in ([S(0)], [R]):
        p = dt.distribute_tensor(np.zeros(7), mesh, pl).requires_grad_()
        p.grad = dt.distribute_tensor(g0, mesh, pl)
        total = dt.nn.utils.clip_grad_norm_([p], 1.0)
        np.testing.assert_allclose(float(total.numpy()), np.linalg.norm(g0), rtol=1e-6)
        np.testing.assert_allclose(p.grad.full_tensor().numpy(),
                                   g0 / (np.linalg.norm(g0) + 1e-6), rtol=1e-6)


@pytest.mark.torch
@pytest.mark.mpi(min_size=1)
def test_state_dict_loads_onto_other_placements():
    mesh = dt.init_device_mesh((WORLD.size,))
    rng = np.random.default_rng(12)
    w0, b0 = (rng.standard_normal(s) for s in SHAPES)
    x = dt.distribute_tensor(rng.standard_normal((4, 5)), mesh, [R])
    a = [dt.distribute_tensor(w0, mesh, [S(0)]).requires_grad_(),
         dt.distribute_tensor(b0, mesh, [S(0)]).requires_grad_()]
    b = [dt.distribute_tensor(w0, mesh, [S(1)]).requires_grad_(),
         dt.distribute_tensor(b0, mesh, [R]).requires_grad_()]
    oa, _ = _train("Adam", {"lr": 0.05}, a, x, steps=2)
    with dt.no_grad():
        for pa, pb in zip(a, b):
            pb.copy_(pa.redistribute(mesh, pb.placements))
    ob = dt.optim.Adam(b, lr=0.5)
    ob.load_state_dict(oa.state_dict())
    for p in b:
        assert ob.state[p]["exp_avg"].placements == p.placements
    for opt, params in ((oa, a), (ob, b)):
        opt.zero_grad()
        loss_of(*params, x).backward()
        opt.step()
    # the oracle: three uninterrupted steps of torch's Adam (the loaded state dict carries
    # the learning rate 0.05 over the 0.5 the second optimizer was built with)
    want, _ = _torch_train("Adam", {"lr": 0.05}, (w0, b0), x.full_tensor().numpy())
    for pa, pb, ref in zip(a, b, want):
        np.testing.assert_allclose(pa.full_tensor().numpy(), ref, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(pb.full_tensor().numpy(), ref, rtol=1e-12, atol=1e-14)
