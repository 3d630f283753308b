"""Exception types of dtensor (re-exported from :mod:`placements.errors`, the lowest layer)."""

from __future__ import annotations

from placements.errors import (
    CommError,
    ConfigError,
    DimError,
    DTensorError,
    DTypeError,
    MeshError,
    NoRuleError,
    PlacementError,
    ShardingError,
    ViewError,
)

__all__ = [
    "CommError",
    "ConfigError",
    "DTensorError",
    "DTypeError",
    "DimError",
    "MeshError",
    "NoRuleError",
    "PlacementError",
    "ShardingError",
    "ViewError",
]
