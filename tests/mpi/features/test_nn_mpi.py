"""``dt.nn`` with DTensor parameters: ``dt.nn.init`` gives the global values a local tensor
gets for the same seed on every layout, an MLP of ``Linear`` layers with sharded or
replicated weights computes torch's forward and gradients of the same weights (float64), and state dicts
load across placements and between local and distributed modules, and a dtype cast keeps
the placements."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.mpi import meshes

import dtensor as dt
from dtensor.nn import init

nn = dt.nn
R, S = dt.Replicate(), dt.Shard
SHAPE = (5, 7)  # uneven shards at 2-4 ranks
INITS = [
    (init.uniform_, {"a": -1.0, "b": 2.0}),
    (init.normal_, {"mean": 1.0, "std": 0.5}),
    (init.trunc_normal_, {"std": 0.7}),
    (init.kaiming_uniform_, {"a": 5**0.5}),
    (init.xavier_normal_, {}),
]


def layouts(mesh, placement):
    """``placement`` on the last mesh dim, Replicate on the others."""
    return [R] * (mesh.ndim - 1) + [placement]


def distributed(module, mesh, placements):
    """``module`` with each parameter made a DTensor Parameter of ``placements[name]``."""
    for name, p in list(module.named_parameters()):
        owner, _, leaf = name.rpartition(".")
        d = dt.distribute_tensor(p.detach(), mesh, layouts(mesh, placements[name]),
                                 src_data_rank=None)
        setattr(module.get_submodule(owner), leaf, nn.Parameter(d))
    return module


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize(("fn", "kwargs"), INITS, ids=[f.__name__ for f, _ in INITS])
def test_init_gives_the_local_global_values_on_every_layout(fn, kwargs):
    dt.manual_seed(42)
    want = fn(dt.empty(*SHAPE), **kwargs).numpy()
    for mesh in meshes():
        for placement in (S(0), S(1), R):
            pl = layouts(mesh, placement)
            dt.manual_seed(42)
            p = nn.Parameter(dt.empty(*SHAPE, device_mesh=mesh, placements=pl))
            assert fn(p, **kwargs) is p and tuple(p.placements) == tuple(pl)
            np.testing.assert_array_equal(p.full_tensor().numpy(), want,
                                          err_msg=f"{mesh.shape} {pl}")


MLP_LAYOUTS = {
    "rows sharded": {"0.weight": S(0), "0.bias": S(0), "2.weight": S(0), "2.bias": R},
    "replicated": {"0.weight": R, "0.bias": R, "2.weight": R, "2.bias": R},
    "rows then columns": {"0.weight": S(0), "0.bias": S(0), "2.weight": S(1), "2.bias": R},
}


def mlp():
    return nn.Sequential(nn.Linear(6, 5, dtype=dt.float64), nn.GELU(),
                         nn.Linear(5, 3, dtype=dt.float64))


def _torch_mlp(params, x, target):
    """The oracle: torch's Linear-GELU-Linear with the weights ``params`` (name -> array),
    its output and the gradients of the MSE loss (name -> array)."""
    import torch  # lazy: the oracle (the test using it is marked torch)

    model = torch.nn.Sequential(torch.nn.Linear(6, 5, dtype=torch.float64), torch.nn.GELU(),
                                torch.nn.Linear(5, 3, dtype=torch.float64))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(params[name]))
    out = model(torch.from_numpy(x))
    torch.nn.MSELoss()(out, torch.from_numpy(target)).backward()
    return out.detach().numpy(), {n: p.grad.numpy() for n, p in model.named_parameters()}


@pytest.mark.torch
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("layout", list(MLP_LAYOUTS))
def test_mlp_with_dtensor_weights_matches_torch(layout):
    rng = np.random.default_rng(0)
    x, target = rng.standard_normal((4, 6)), rng.standard_normal((4, 3))
    dt.manual_seed(1)
    local = mlp()
    out, grads = _torch_mlp({n: p.detach().numpy() for n, p in local.named_parameters()},
                            x, target)
    for mesh in meshes():
        dt.manual_seed(1)
        model = distributed(mlp(), mesh, MLP_LAYOUTS[layout])
        rep = layouts(mesh, R)
        y = model(dt.distribute_tensor(x, mesh, rep, src_data_rank=None))
        where = f"{layout} on {mesh.shape}"
        np.testing.assert_allclose(y.full_tensor().numpy(), out, rtol=1e-12, err_msg=where)
        loss = nn.MSELoss()(y, dt.distribute_tensor(target, mesh, rep, src_data_rank=None))
        loss.backward()
        for name, p in model.named_parameters():
            assert isinstance(p, nn.Parameter) and isinstance(p, dt.DTensor)
            assert tuple(p.grad.placements) == tuple(p.placements), where
            np.testing.assert_allclose(p.grad.full_tensor().numpy(), grads[name],
                                       rtol=1e-10, atol=1e-14, err_msg=f"{where}: {name}")


@pytest.mark.mpi(min_size=1)
def test_state_dict_across_placements_and_local_modules():
    dt.manual_seed(2)
    local = mlp()
    want = {k: v.numpy() for k, v in local.state_dict().items()}
    for mesh in meshes():
        src = distributed(mlp(), mesh, MLP_LAYOUTS["rows sharded"])
        src.load_state_dict(local.state_dict())  # local values into DTensors: sliced
        sd = src.state_dict()
        assert all(isinstance(v, dt.DTensor) and not v.requires_grad for v in sd.values())
        dst = distributed(mlp(), mesh, MLP_LAYOUTS["rows then columns"])
        weight = dst[2].weight
        assert dst.load_state_dict(sd) == ([], [])  # redistributed into the targets
        assert dst[2].weight is weight and tuple(weight.placements) == tuple(
            layouts(mesh, S(1)))
        back = mlp()
        back.load_state_dict(dst.state_dict())  # DTensors into local tensors: gathered
        for key, value in back.state_dict().items():
            np.testing.assert_array_equal(value.numpy(), want[key], err_msg=f"{key}")
            np.testing.assert_array_equal(dst.state_dict()[key].full_tensor().numpy(),
                                          want[key], err_msg=f"{mesh.shape} {key}")
        assert dst.to(dt.float32) is dst  # a cast keeps the layouts
        w32 = dst[2].weight
        assert isinstance(w32, nn.Parameter) and w32.dtype == np.float32
        assert tuple(w32.placements) == tuple(layouts(mesh, S(1)))
        np.testing.assert_allclose(w32.full_tensor().numpy(), want["2.weight"], rtol=1e-6)
