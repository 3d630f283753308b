"""Shard layout math: which block of the global tensor a mesh coordinate holds.

This module owns the one answer to "which slice of the global tensor does mesh coordinate
``coord`` hold under ``placements``" (:func:`local_offsets`, :func:`local_shape`,
:func:`local_slices`) and the validation of placements against a tensor and a mesh
(:func:`normalize_placements`).

Rules:

- ``n`` elements split over ``k`` coordinates follow ``torch.chunk``: chunks of
  ``ceil(n / k)`` elements; trailing coordinates hold fewer, possibly zero (``n=5, k=4`` gives
  2, 2, 1, 0). Empty shards are legal.
- Nested sharding: a tensor dim sharded on several mesh dims is split by the mesh dims in
  increasing mesh-dim order. Mesh dim 0 splits the tensor dim first, then mesh dim 1 splits
  each of those chunks, and so on (PyTorch's default order). E.g. 8 rows under
  ``[Shard(0), Shard(0)]`` on a (2, 2) mesh: coordinate (i, j) holds rows ``4*i + 2*j`` to
  ``4*i + 2*j + 2``.
- ``Replicate`` and ``Partial`` do not split.
- Placing one value as ``Partial(sum)`` / ``Partial(prod)`` keeps it on coordinate 0 of
  that mesh dim and puts the reduction's identity (0 / 1) elsewhere; ``Partial(avg)``,
  ``Partial(max)`` and ``Partial(min)`` keep the value on every coordinate
  (:func:`partial_fill`, the one answer for factories, ``distribute_tensor``, the
  redistribute engine and the dispatcher).

Pure: numpy-free, no communication.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

from .cache import memoize
from .errors import MeshError, PlacementError, ShardDimError, ShardingError
from .types import Placement, Shard, short_placements

__all__ = [
    "PARTITION_IDENTITY",
    "local_offsets",
    "local_shape",
    "local_slices",
    "max_local_shape",
    "normalize_placements",
    "partial_fill",
    "shard_range",
]

#: The value a non-holding coordinate keeps when one value is placed as ``Partial(op)``.
PARTITION_IDENTITY: dict[str, int] = {"sum": 0, "prod": 1}


def partial_fill(placements: Sequence[Placement], coord: Sequence[int]) -> int | None:
    """What mesh coordinate ``coord`` holds when one value is placed under ``placements``:
    the identity of a Partial reduction (0 for sum, 1 for prod) instead of the value, or
    None when it holds the value itself. **Local**.

    Partial values reduce from the highest mesh dim down to mesh dim 0, so the highest
    ``Partial(sum)``/``Partial(prod)`` mesh dim on which ``coord`` is not 0 decides: with
    ``[P(prod), P(sum)]`` on a (2, 2) mesh, (0, 0) holds v, (0, 1) holds 0, (1, 0) holds 1
    and (1, 1) holds 0, so ``prod(sum(v, 0), sum(1, 0)) = v``.
    """
    for m in range(len(placements) - 1, -1, -1):
        p = placements[m]
        if coord[m] != 0 and p.is_partial():
            fill = PARTITION_IDENTITY.get(p.reduce_op)  # type: ignore[attr-defined]
            if fill is not None:
                return fill
    return None


def shard_range(n: int, k: int, i: int) -> tuple[int, int]:
    """Start and length of chunk ``i`` of ``n`` elements split over ``k`` parts. **Local**.

    ``torch.chunk`` semantics: chunk size ``ceil(n / k)``, ``start = min(i * chunk, n)``;
    trailing chunks are short or empty.

    Parameters
    ----------
    n : int
        Number of elements (>= 0).
    k : int
        Number of parts (>= 1).
    i : int
        Part index, ``0 <= i < k``.

    Returns
    -------
    tuple of int
        ``(start, length)``.
    """
    if n < 0:
        raise ShardingError(f"shard_range(n={n}, k={k}, i={i}): n must be >= 0")
    if not 0 <= i < k:
        raise MeshError(f"shard_range(n={n}, k={k}, i={i}): need k >= 1 and 0 <= i < k")
    chunk = -(-n // k)
    start = min(i * chunk, n)
    return start, min(chunk, n - start)


def normalize_placements(
    placements: Sequence[Placement], shape: Sequence[int], mesh_shape: Sequence[int]
) -> tuple[Placement, ...]:
    """Validate ``placements`` for a tensor and a mesh; resolve negative shard dims. **Local**.

    Parameters
    ----------
    placements : sequence of Placement
        One placement per mesh dim.
    shape : sequence of int
        Global tensor shape (its length is the rank that shard dims refer to).
    mesh_shape : sequence of int
        Shape of the device mesh.

    Returns
    -------
    tuple of Placement
        The placements with every ``Shard(-d)`` replaced by ``Shard(ndim - d)``.

    Raises
    ------
    PlacementError
        A non-placement entry or a count different from the mesh rank; a shard dim out of
        range for the tensor raises its subclass ShardDimError (also a DimError).
    """
    placements = tuple(placements)
    try:
        normalized = _normalized(placements, len(shape), len(mesh_shape))
    except TypeError:  # an unhashable entry, which is no placement: the check below says so
        normalized = None
    if normalized is None:
        _raise_invalid(placements, tuple(shape), tuple(mesh_shape))
    return normalized


@memoize("placements.layout.normalized", 4096)
def _normalized(
    placements: tuple[Placement, ...], ndim: int, mesh_ndim: int
) -> tuple[Placement, ...] | None:
    """The placements with negative shard dims resolved, or None when they are invalid."""
    if len(placements) != mesh_ndim:
        return None
    out = []
    for p in placements:
        if not isinstance(p, Placement):
            return None
        if p.kind == "S" and not 0 <= p.dim < ndim:
            if not -ndim <= p.dim < 0:
                return None
            p = Shard(p.dim + ndim)
        out.append(p)
    return tuple(out)


def _raise_invalid(
    placements: tuple[Placement, ...], shape: tuple[int, ...], mesh_shape: tuple[int, ...]
) -> NoReturn:
    """Raise the PlacementError that explains why ``placements`` are invalid."""
    for p in placements:
        if not isinstance(p, Placement):
            raise PlacementError(
                f"{p!r} ({type(p).__name__}) is not a placement; expected Shard(dim), "
                f"Replicate() or Partial(reduce_op) (placements {placements!r})"
            )
    if len(placements) != len(mesh_shape):
        raise PlacementError(
            f"{len(placements)} placements [{short_placements(placements, ', ')}] for a "
            f"{len(mesh_shape)}-D mesh of shape {mesh_shape}; need one per mesh dim"
        )
    ndim = len(shape)
    bad = next(p for p in placements if p.kind == "S" and not -ndim <= p.dim < ndim)
    raise ShardDimError(
        f"{bad!r} is out of range for a {ndim}-D tensor of shape {shape} "
        f"(placements [{short_placements(placements, ', ')}])"
    )


@memoize("placements.layout.box", 16384)
def _box(
    shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    placements: tuple[Placement, ...],
    coord: tuple[int, ...],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, lengths) of the block ``coord`` holds; placements already normalised."""
    if len(coord) != len(mesh_shape) or not all(
        0 <= c < k for c, k in zip(coord, mesh_shape)
    ):
        raise MeshError(
            f"mesh coordinate {coord} is out of range for a mesh of shape {mesh_shape}"
        )
    offsets = [0] * len(shape)
    lengths = list(shape)
    for m, p in enumerate(placements):  # increasing mesh dim: mesh dim 0 splits first
        if p.kind == "S":
            start, length = shard_range(lengths[p.dim], mesh_shape[m], coord[m])
            offsets[p.dim] += start
            lengths[p.dim] = length
    return tuple(offsets), tuple(lengths)


def _public_box(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    coord: Sequence[int],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    shape = tuple(int(s) for s in global_shape)
    if any(s < 0 for s in shape):
        raise ShardingError(f"global shape {shape} has a negative size")
    mesh_shape = tuple(int(k) for k in mesh_shape)
    placements = normalize_placements(placements, shape, mesh_shape)
    return _box(shape, mesh_shape, placements, tuple(int(c) for c in coord))


def local_shape(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    coord: Sequence[int],
) -> tuple[int, ...]:
    """Shape of the block that mesh coordinate ``coord`` holds. **Local**.

    Parameters
    ----------
    global_shape : sequence of int
        Shape of the global tensor.
    mesh_shape : sequence of int
        Shape of the device mesh.
    placements : sequence of Placement
        One placement per mesh dim (negative shard dims allowed).
    coord : sequence of int
        The mesh coordinate.

    Returns
    -------
    tuple of int
        The local shape (sizes may be zero).
    """
    return _public_box(global_shape, mesh_shape, placements, coord)[1]


def local_offsets(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    coord: Sequence[int],
) -> tuple[int, ...]:
    """Global start index, per tensor dim, of the block ``coord`` holds. **Local**.

    Parameters are those of :func:`local_shape`. For an empty shard the offset is where the
    shard would start (at most the dim's size).
    """
    return _public_box(global_shape, mesh_shape, placements, coord)[0]


def local_slices(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    coord: Sequence[int],
) -> tuple[slice, ...]:
    """Slices of the global tensor that ``coord`` holds: ``global[local_slices(...)]``. **Local**.

    Parameters are those of :func:`local_shape`.
    """
    offsets, lengths = _public_box(global_shape, mesh_shape, placements, coord)
    return tuple(slice(o, o + n) for o, n in zip(offsets, lengths))


@memoize("placements.layout.max_local_shape", 16384)
def max_local_shape(
    global_shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    placements: tuple[Placement, ...],
) -> tuple[int, ...]:
    """Largest local shape over all mesh coordinates, per tensor dim. **Local**.

    Under torch.chunk splits the first chunk is the largest and a larger chunk never splits
    into smaller first chunks, so coordinate ``(0, ..., 0)`` holds the largest block in every
    tensor dim. Cost estimates use it so that they are identical on every rank.

    Parameters
    ----------
    global_shape, mesh_shape : tuple of int
        Global tensor shape and mesh shape (tuples: the result is cached).
    placements : tuple of Placement
        One placement per mesh dim.
    """
    placements = normalize_placements(placements, global_shape, mesh_shape)
    return _box(global_shape, mesh_shape, placements, (0,) * len(mesh_shape))[1]
