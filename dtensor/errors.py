"""Exception types of dtensor (re-exported from :mod:`placements.errors`, the lowest layer)."""

from placements.errors import (  # noqa: F401
    CommError,
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
    "DTensorError",
    "DTypeError",
    "MeshError",
    "NoRuleError",
    "PlacementError",
    "ShardingError",
    "ViewError",
]
