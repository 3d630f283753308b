"""DTensorSpec: the metadata of a distributed tensor, and a metadata-only mesh.

This module owns :class:`DTensorSpec` (mesh, placements, global shape, dtype, optional
stride). A spec is a frozen value whose hash is computed once at construction: it is the
cache key for sharding rules and redistribute plans. It also owns :class:`MeshShape`, a mesh
that has a shape and nothing else, for planning and explaining without MPI.

Pure: numpy (for dtypes) only, no communication.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from .errors import DTypeError, ShardingError
from .layout import _box, normalize_placements
from .meta import dtype_kind
from .types import Placement, placement_list, short_placements

__all__ = ["DTensorSpec", "MeshShape", "check_partial_dtype"]

_set = object.__setattr__


class MeshShape:
    """A mesh described by its shape only: enough for layout math, plans and costs.

    Hashable and immutable; two ``MeshShape`` objects with the same shape are equal. Use it
    to plan or explain a redistribution without MPI; real programs pass a ``DeviceMesh``.

    Parameters
    ----------
    shape : sequence of int
        Number of coordinates along each mesh dim.
    """

    __slots__ = ("shape",)
    shape: tuple[int, ...]

    def __init__(self, shape: Sequence[int]) -> None:
        _set(self, "shape", tuple(int(k) for k in shape))

    @property
    def ndim(self) -> int:
        """Number of mesh dims. **Local**."""
        return len(self.shape)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"MeshShape is immutable; cannot set {name!r}")

    def __reduce__(self) -> tuple[type, tuple[Any, ...]]:
        return MeshShape, (self.shape,)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MeshShape):
            return NotImplemented
        return self.shape == other.shape

    def __hash__(self) -> int:
        return hash(("MeshShape", self.shape))

    def __repr__(self) -> str:
        return f"MeshShape({self.shape})"


def check_partial_dtype(op: str, placements: Sequence[Placement], dtype: np.dtype) -> None:
    """Refuse placements that hold ``Partial("avg")`` of a dtype that is not floating or
    complex. **Local**.

    An average of integer (or bool) contributions has no exact value of their dtype, so a
    DTensor never holds one: every route that builds a DTensor from placements a user gives
    (``from_local``, ``distribute_tensor``, the factories, ``redistribute``) checks them
    here before it communicates or allocates anything, and no sharding rule produces one
    (:func:`placements.rules._core._dtype_valid`).

    Raises
    ------
    DTypeError
        Naming ``op``, the dtype and the placements.
    """
    # Note: PyTorch builds an integer Partial("avg") and fails at its first reduction (the
    # average cannot be cast back to the integer dtype); it is refused here when built.
    if dtype_kind(dtype) not in "fc" and any(
        p.kind == "P" and p.reduce_op == "avg" for p in placements
    ):
        raise DTypeError(
            f"{op}: Partial(avg) needs a floating or complex dtype, got {dtype.name} "
            f"(placements {placement_list(placements)}); an average of {dtype.name} "
            "contributions has no exact value: use Partial(sum) or a floating dtype"
        )


class DTensorSpec:
    """Metadata of a distributed tensor: mesh, placements, global shape, dtype, stride.

    Frozen; equality is by value and the hash is computed once at construction.

    Parameters
    ----------
    mesh : hashable object with ``.shape`` and ``.ndim``
        The device mesh (a ``DeviceMesh`` or a :class:`MeshShape`).
    placements : sequence of Placement
        One per mesh dim. Negative shard dims are resolved against ``len(shape)``.
    shape : sequence of int
        The global shape.
    dtype : numpy dtype or anything ``numpy.dtype`` accepts
        Element type.
    stride : sequence of int, optional
        Global strides in elements; None means contiguous (row-major). Part of equality.

    Raises
    ------
    PlacementError
        Wrong number of placements for the mesh, a non-placement, a shard dim out of range.
    ShardingError
        A negative size in ``shape`` or a stride of the wrong length.
    """

    __slots__ = ("_hash", "dtype", "mesh", "mesh_shape", "placements", "shape", "stride")
    mesh: Hashable
    placements: tuple[Placement, ...]
    shape: tuple[int, ...]
    dtype: np.dtype
    stride: tuple[int, ...] | None
    mesh_shape: tuple[int, ...]

    def __init__(
        self,
        mesh: Any,
        placements: Sequence[Placement],
        shape: Sequence[int],
        dtype: Any,
        stride: Sequence[int] | None = None,
    ) -> None:
        shape = tuple(map(int, shape))
        if shape and min(shape) < 0:
            raise ShardingError(f"DTensorSpec: global shape {shape} has a negative size")
        if stride is not None:
            stride = tuple(map(int, stride))
            if len(stride) != len(shape):
                raise ShardingError(
                    f"DTensorSpec: stride {stride} does not match the {len(shape)}-D "
                    f"shape {shape}"
                )
        mesh_shape = tuple(mesh.shape)
        placements = normalize_placements(placements, shape, mesh_shape)
        if not isinstance(dtype, np.dtype):
            dtype = np.dtype(dtype)
        self._fill(mesh, placements, shape, dtype, stride, mesh_shape)

    def _fill(
        self,
        mesh: Any,
        placements: tuple[Placement, ...],
        shape: tuple[int, ...],
        dtype: np.dtype,
        stride: tuple[int, ...] | None,
        mesh_shape: tuple[int, ...],
    ) -> None:
        _set(self, "mesh", mesh)
        _set(self, "placements", placements)
        _set(self, "shape", shape)
        _set(self, "dtype", dtype)
        _set(self, "stride", stride)
        _set(self, "mesh_shape", mesh_shape)
        _set(self, "_hash", hash((mesh, placements, shape, dtype, stride)))

    @classmethod
    def _trusted(
        cls,
        mesh: Any,
        placements: tuple[Placement, ...],
        shape: tuple[int, ...],
        dtype: np.dtype,
        stride: tuple[int, ...] | None = None,
        mesh_shape: tuple[int, ...] | None = None,
    ) -> DTensorSpec:
        """Build a spec from already-normalised fields (tuples, a numpy dtype): no checks."""
        self = object.__new__(cls)
        self._fill(
            mesh, placements, shape, dtype, stride,
            tuple(mesh.shape) if mesh_shape is None else mesh_shape,
        )
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"DTensorSpec is immutable; cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"DTensorSpec is immutable; cannot delete {name!r}")

    def __reduce__(self) -> tuple[type, tuple[Any, ...]]:
        return DTensorSpec, (self.mesh, self.placements, self.shape, self.dtype, self.stride)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, DTensorSpec):
            return NotImplemented
        return (
            self._hash == other._hash
            and self.shape == other.shape
            and self.placements == other.placements
            and self.dtype == other.dtype
            and self.stride == other.stride
            and self.mesh == other.mesh
        )

    def __repr__(self) -> str:
        stride = "" if self.stride is None else f", stride={self.stride}"
        return (
            f"DTensorSpec({short_placements(self.placements)}, shape={self.shape}, "
            f"{self.dtype}{stride}, mesh={self.mesh_shape})"
        )

    @property
    def ndim(self) -> int:
        """Rank of the global tensor. **Local**."""
        return len(self.shape)

    def numel(self) -> int:
        """Number of elements of the global tensor. **Local**."""
        return math.prod(self.shape)

    def local_shape(self, coord: Sequence[int]) -> tuple[int, ...]:
        """Shape of the block mesh coordinate ``coord`` holds. **Local**.

        See :mod:`placements.layout` for the split rules (torch.chunk, nested order).
        """
        return _box(self.shape, self.mesh_shape, self.placements, tuple(coord))[1]

    def local_offsets(self, coord: Sequence[int]) -> tuple[int, ...]:
        """Global start index, per tensor dim, of the block ``coord`` holds. **Local**."""
        return _box(self.shape, self.mesh_shape, self.placements, tuple(coord))[0]

    def is_replicated(self) -> bool:
        """True when every mesh dim is Replicate. **Local**."""
        return all(p.kind == "R" for p in self.placements)

    def is_sharded(self) -> bool:
        """True when some mesh dim is a Shard. **Local**."""
        return any(p.kind == "S" for p in self.placements)

    def has_partial(self) -> bool:
        """True when some mesh dim is Partial. **Local**."""
        return any(p.kind == "P" for p in self.placements)

    def with_placements(self, placements: Sequence[Placement]) -> DTensorSpec:
        """The same tensor (mesh, shape, dtype, stride) under other placements. **Local**.

        ``placements`` are validated and normalised as in the constructor.
        """
        return DTensorSpec._trusted(
            self.mesh,
            normalize_placements(placements, self.shape, self.mesh_shape),
            self.shape,
            self.dtype,
            self.stride,
            self.mesh_shape,
        )
