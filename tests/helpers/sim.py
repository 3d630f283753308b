"""Simulated meshes for one-process dispatch tests: a DTensor's shard as one coordinate of a
mesh of any shape holds it (no MPI, no communication)."""

from __future__ import annotations

import numpy as np

import dtensor as dt
from placements.layout import local_slices
from placements.spec import DTensorSpec


class SimMesh:
    """A mesh of ``shape`` seen from ``coord``; equal to any SimMesh of the same shape/name."""

    def __init__(self, shape, coord=None, name="sim"):
        self.shape = tuple(shape)
        self.ndim = len(self.shape)
        self._coord = tuple(coord) if coord is not None else (0,) * self.ndim
        self._dim_comms = (None,) * self.ndim
        self.device_type = "cpu"
        self.name = name

    def get_coordinate(self):
        return self._coord

    def __eq__(self, other):
        return isinstance(other, SimMesh) and (self.shape, self.name) == (other.shape, other.name)

    def __hash__(self):
        return hash((self.shape, self.name))

    def __repr__(self):
        return f"SimMesh({self.shape}, {self.name})"


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
