"""Inputs for testing code that uses dtensor: Partial tensors with real contributions.

``distribute_tensor(value, mesh, [Partial("sum")], src_data_rank=None)`` gives a
*degenerate* Partial tensor: for ``P(sum)`` one coordinate holds the value and the others
zeros, for ``P(max)``/``P(min)``/``P(avg)`` every coordinate holds the value itself. Such
inputs cannot tell ``P(max)`` from ``P(min)`` or ``P(sum)`` from ``Replicate``, so an op whose
rule keeps the wrong Partial kind still gives the right numbers. This module builds Partial
tensors whose per-coordinate contributions are random and differ from each other, yet
reduce to the given global value: exactly for integers and bools, up to rounding for
floats (``sum``/``avg``).

- :func:`partial_contributions`: ``k`` contributions of one array for one reduce op;
- :func:`blocks`: every mesh coordinate's local block of a global array under any
  placements (Partial mesh dims split outer first, then the shard of each coordinate);
- :func:`distribute_random`: this rank's block as a DTensor (no communication).

Every rank that passes the same ``seed`` draws the same contributions, so the blocks of
all ranks fit together.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from placements import Placement
from placements.errors import ArgumentError
from placements.layout import local_slices
from placements.types import placement_list

from .distributed.dtensor import DTensor
from .distributed.mesh import DeviceMesh
from .local.factory import from_numpy

__all__ = ["blocks", "distribute_random", "partial_contributions"]

_BOOL = np.dtype(np.bool_)


def _noise(value: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    if value.dtype.kind in "iu":
        return rng.integers(-3, 4, value.shape).astype(value.dtype)
    if value.dtype.kind == "c":
        return (rng.standard_normal(value.shape) + 1j * rng.standard_normal(value.shape)).astype(
            value.dtype
        )
    return rng.standard_normal(value.shape).astype(value.dtype)


def partial_contributions(
    value: np.ndarray, op: str, k: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """``k`` random contributions whose reduction by ``op`` is ``value``. **Local**.

    - ``sum``: ``k - 1`` random arrays and the remainder (for bools: logical or, each
      True held by one random contribution);
    - ``avg``: ``value`` plus random offsets that add up to zero;
    - ``max`` / ``min``: each element held by one random contribution, the others below
      (``max``) or above (``min``) it; bools: ``max`` is or, ``min`` is and;
    - ``prod``: the value on the first contribution, ones elsewhere.

    NaN and infinities are in every contribution (``prod``: in the first): the sum of equal
    infinities is that infinity, and a product with another operand's infinity at the same
    place stays one on every rank (a 0 addend would give ``0 * inf``, NaN). Floats reduce to
    ``value`` up to rounding (``sum``, ``avg``); integers and bools exactly (integers may
    wrap around, as their reduction does).

    Parameters
    ----------
    value : numpy.ndarray
        The global value of the Partial tensor.
    op : {"sum", "avg", "max", "min", "prod"}
        The reduce op.
    k : int
        The number of contributions (the size of the mesh dim), at least 1.
    rng : numpy.random.Generator
        Where the randomness comes from.

    Raises
    ------
    ArgumentError
        An unknown ``op``, ``k < 1``, or ``avg`` of a bool array.
    """
    value = np.asarray(value)
    if op not in ("sum", "avg", "max", "min", "prod"):
        raise ArgumentError(f"partial_contributions: unknown reduce op {op!r}")
    if k < 1:
        raise ArgumentError(f"partial_contributions: k must be at least 1, got {k}")
    if op == "prod":
        return [value.copy()] + [np.ones_like(value) for _ in range(k - 1)]
    holder = rng.integers(0, k, value.shape)
    if value.dtype == _BOOL:
        if op == "avg":
            raise ArgumentError("partial_contributions: P(avg) of a bool array has no meaning")
        if op == "min":  # logical and: False held by one contribution, True elsewhere
            return [value | (holder != c) for c in range(k)]
        return [value & (holder == c) for c in range(k)]  # sum, max: logical or
    finite = np.isfinite(value) if value.dtype.kind in "fc" else np.ones(value.shape, bool)
    if op == "sum":
        parts = [np.where(finite, _noise(value, rng), value).astype(value.dtype)
                 for _ in range(k - 1)]
        with np.errstate(invalid="ignore"):  # (inf - inf: NaN, replaced by the value)
            rest = value - sum(parts, np.zeros_like(value)) if parts else value.copy()
        rest = np.where(finite, rest, value)
        return [*parts, np.asarray(rest).astype(value.dtype)]
    if op == "avg":
        noise = [np.where(finite, _noise(value, rng), 0).astype(value.dtype) for _ in range(k)]
        if value.dtype.kind in "iu":
            noise[-1] = -sum(noise[:-1], np.zeros_like(value)) if k > 1 else np.zeros_like(value)
            return [(value + n).astype(value.dtype) for n in noise]
        mean = sum(noise, np.zeros_like(value)) / k
        return [np.asarray(value + n - mean).astype(value.dtype) for n in noise]
    sign = -1 if op == "max" else 1
    parts = [
        np.asarray(value + sign * np.abs(_noise(value, rng))).astype(value.dtype) for _ in range(k)
    ]
    for c, part in enumerate(parts):
        mine = (holder == c) | ~finite  # NaN and inf stay where they are
        part[mine] = value[mine]
    return parts


def blocks(
    value: np.ndarray,
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    rng: np.random.Generator,
) -> dict[tuple[int, ...], np.ndarray]:
    """Every mesh coordinate's local block of ``value`` under ``placements``. **Local**.

    Each Partial mesh dim (outer first) splits the value into random contributions
    (:func:`partial_contributions`), then each coordinate takes its shard of its
    contribution. Blocks are C-contiguous copies.
    """
    value = np.asarray(value)
    mesh_shape = tuple(mesh_shape)
    pdims = [m for m, p in enumerate(placements) if p.is_partial()]
    contrib: dict[tuple[int, ...], np.ndarray] = {(): value}
    for m in pdims:
        contrib = {
            key + (c,): part
            for key, val in contrib.items()
            for c, part in enumerate(
                partial_contributions(val, placements[m].reduce_op, mesh_shape[m], rng)
            )
        }
    out = {}
    for coord in np.ndindex(*mesh_shape):
        piece = contrib[tuple(coord[m] for m in pdims)][
            local_slices(value.shape, mesh_shape, placements, coord)
        ]
        out[coord] = np.empty(piece.shape, value.dtype)
        out[coord][...] = piece
    return out


def distribute_random(
    value: np.ndarray,
    device_mesh: DeviceMesh,
    placements: Sequence[Placement],
    *,
    seed: int = 0,
) -> DTensor:
    """A DTensor of global value ``value`` whose Partial mesh dims hold random contributions.

    **Local**: every rank computes the same layout from ``seed`` and keeps its own block,
    with no communication. Shard and Replicate mesh dims are laid out as
    ``distribute_tensor`` lays them out.

    Parameters
    ----------
    value : numpy.ndarray
        The global value (the same on every rank).
    device_mesh : DeviceMesh
        The mesh; this rank must belong to it.
    placements : sequence of Placement
        One per mesh dim.
    seed : int
        Seeds the contributions; every rank must pass the same one.

    Raises
    ------
    ArgumentError
        This rank is not in ``device_mesh``, or ``placements`` does not have one entry per
        mesh dim.
    """
    placements = tuple(placements)
    if len(placements) != device_mesh.ndim:
        raise ArgumentError(
            f"distribute_random: {placement_list(placements)} has {len(placements)} "
            f"placements for a {device_mesh.ndim}-D mesh {tuple(device_mesh.shape)}"
        )
    coord = device_mesh.get_coordinate()
    if coord is None:
        raise ArgumentError(
            f"distribute_random: this rank is not in the mesh {tuple(device_mesh.shape)}"
        )
    value = np.asarray(value)
    mine = blocks(value, device_mesh.shape, placements, np.random.default_rng(seed))[tuple(coord)]
    return DTensor.from_local(from_numpy(mine), device_mesh, placements, shape=value.shape)
