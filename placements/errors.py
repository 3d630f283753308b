"""Exception types of dtensor: one catalogue for every layer.

This module sits in the lowest layer (``placements``) so that every package can raise
these types; ``dtensor.errors`` re-exports it. Each subclass also subclasses the matching
builtin, so ``except ValueError`` keeps working for users who do not know our types.
"""

from __future__ import annotations

__all__ = [
    "DTensorError",
    "ShardingError",
    "PlacementError",
    "NoRuleError",
    "CommError",
    "MeshError",
    "DTypeError",
    "ViewError",
]


class DTensorError(Exception):
    """Base class of every error raised by dtensor."""


class ShardingError(DTensorError, ValueError):
    """Inputs whose placements or shapes cannot be combined as asked."""


class PlacementError(DTensorError, ValueError):
    """An invalid placement: shard dim out of range, wrong count for the mesh, bad op."""


class MeshError(DTensorError, ValueError):
    """A device mesh that does not match the communicator, or a bad mesh dimension."""


class DTypeError(DTensorError, TypeError):
    """A dtype that the op does not support."""


class ViewError(DTensorError, RuntimeError):
    """A ``view`` whose size is not compatible with the input's size and stride."""


class NoRuleError(DTensorError, NotImplementedError):
    """An op that has no sharding rule (or no local kernel) for the given inputs."""


class CommError(DTensorError, RuntimeError):
    """A failure in, or a divergence before, a collective."""
