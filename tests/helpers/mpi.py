"""Helpers of the MPI tests (``tests/mpi``): the meshes every rank builds and the data they
hold. Collective where a docstring says so: every rank calls them in the same order."""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

import dtensor as dt
from dtensor.testing import distribute_random

WORLD = MPI.COMM_WORLD


def meshes(device: str = "cpu") -> list[dt.DeviceMesh]:
    """The 1-D mesh of the world and, at 4 ranks, a 2x2 mesh without dim names
    (collective: every rank builds them)."""
    out = [dt.init_device_mesh((WORLD.size,), device=device)]
    if WORLD.size == 4:
        out.append(dt.init_device_mesh((2, 2), device=device))
    return out


def meshes_dp_tp(device: str = "cpu") -> list[dt.DeviceMesh]:
    """The 1-D mesh of the world and, at 4 ranks, a 2x2 mesh with the dim names
    ``("dp", "tp")`` (collective: every rank builds them)."""
    out = [dt.init_device_mesh((WORLD.size,), device=device)]
    if WORLD.size == 4:
        out.append(dt.init_device_mesh((2, 2), mesh_dim_names=("dp", "tp"), device=device))
    return out


def data(shape, seed=0):
    """A float32 array of standard normal values, the same on every rank for a seed."""
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def dist(arr, mesh, placements):
    """``arr`` on ``mesh``; a Partial mesh dim holds random per-rank contributions."""
    return distribute_random(arr, mesh, placements, seed=len(placements))


def np_local(g, mesh, placements):
    """The block of the global ``g`` this rank holds under Shard/Replicate ``placements``,
    computed here (the oracle): each mesh dim in turn splits its dim as ``torch.chunk``
    does (blocks of ceil(n / k), the last ones short or empty)."""
    block = g
    for m, p in enumerate(placements):
        if not p.is_shard():
            continue
        k, c = mesh.size(m), mesh.get_coordinate()[m]
        n = block.shape[p.dim]
        size = -(-n // k)
        lo, hi = min(c * size, n), min((c + 1) * size, n)
        block = block[(slice(None),) * p.dim + (slice(lo, hi),)]
    return block



def sgd_step(params, lr: float) -> None:
    """A plain SGD update ``p -= lr * p.grad`` of every parameter that has a gradient, which
    is then dropped (local: each rank updates what it holds)."""
    with dt.no_grad():
        for p in params:
            if p.grad is not None:
                p -= lr * p.grad
                p.grad = None
