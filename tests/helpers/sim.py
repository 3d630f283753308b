"""One-process dispatch tests on coordinate meshes (``dt.AbstractMesh(shape, coord=c)``): a
DTensor's shard as one coordinate of a mesh of any shape holds it (no MPI, no
communication)."""

from __future__ import annotations

import numpy as np

import dtensor as dt
from placements.layout import local_slices
from placements.spec import DTensorSpec


def local_part(arr, mesh, placements):
    """The shard of ``arr`` that ``mesh``'s coordinate holds (Partial(sum): the holder)."""
    coord = mesh.get_coordinate()
    part = arr[local_slices(arr.shape, mesh.shape, placements, coord)]
    if any(p.is_partial("sum") and coord[m] for m, p in enumerate(placements)):
        part = np.zeros_like(part)
    return part


def dtensor_of(arr, mesh, placements):
    placements = tuple(placements)
    spec = DTensorSpec(mesh, placements, arr.shape, arr.dtype)
    local = dt.from_numpy(np.array(local_part(arr, mesh, placements)))  # a copy: ops may write
    return dt.DTensor._make(local, spec)


def data(shape, dtype=np.float32, seed=0):
    return (np.random.default_rng(seed).standard_normal(shape) * 4).astype(dtype)
