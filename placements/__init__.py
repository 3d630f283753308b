"""placements: pure metadata of distributed tensors.

Placement types (:mod:`placements.types`), shard layout math (:mod:`placements.layout`),
specs (:mod:`placements.spec`), PyTorch's metadata semantics shared by the sharding rules and
the local tensor (:mod:`placements.meta`) and the sharding rules (:mod:`placements.rules`).
Imports numpy at most: no MPI, no data.
"""

from __future__ import annotations

from .layout import (
    local_offsets,
    local_shape,
    local_slices,
    max_local_shape,
    normalize_placements,
    shard_range,
)
from .spec import DTensorSpec, MeshShape
from .types import (
    REDUCE_OPS,
    Partial,
    Placement,
    Replicate,
    Shard,
    placement_list,
    short_placements,
)

__all__ = [
    "REDUCE_OPS",
    "DTensorSpec",
    "MeshShape",
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "local_offsets",
    "local_shape",
    "local_slices",
    "max_local_shape",
    "normalize_placements",
    "placement_list",
    "shard_range",
    "short_placements",
]
