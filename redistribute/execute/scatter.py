"""Scattering a tensor that one rank holds: every rank gets its shard
(:func:`scatter_from`, what ``distribute_tensor`` runs).

This module owns the scatter: the source packs each destination's block once and sends
them with one ``Scatterv`` (or broadcasts a tensor without Shard placements); ranks of one
node may copy their blocks straight out of the source's buffer in shared memory instead
(:mod:`redistribute.execute.shared`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from placements.errors import ShardingError
from placements.layout import local_slices, partial_fill

from .. import comm as _comm
from ..comm.datatypes import displacements
from .programs import Alloc, copy
from .shared import pull_from_source, shares, tries_shared

__all__ = ["scatter_from"]


def scatter_from(
    src_rank_in_base: int,
    global_or_none: np.ndarray | None,
    spec: Any,
    coord: Sequence[int],
    base_comm: _comm.Comm,
    alloc: Alloc | None = None,
) -> np.ndarray:
    """Give every rank its shard of a global array that only one rank holds.

    **Collective** over ``base_comm`` (every rank of the mesh takes part).

    The source packs each destination's block once and scatters them with one
    ``Scatterv`` (its own block is copied locally); when no placement is a Shard, every
    block is the whole tensor and it is broadcast instead. Ranks that hold the identity
    of a Partial(sum/prod) placement (mesh coordinate not 0 on that dim) receive nothing
    and fill their shard locally; other Partial kinds receive the data. For a tensor of at
    least ``DTENSOR_SHM_MIN_BYTES`` on ranks of one node, the other ranks copy their blocks
    straight out of the source's packed buffer (for a broadcast, its output) in shared
    memory instead (:mod:`redistribute.shm`).

    Parameters
    ----------
    src_rank_in_base : int
        Rank of ``base_comm`` that holds the global array.
    global_or_none : ndarray or None
        The global array of shape ``spec.shape`` and dtype ``spec.dtype`` on the source
        (any strides); ignored elsewhere.
    spec : DTensorSpec
        Target spec, identical on every rank.
    coord : sequence of int
        This rank's mesh coordinate.
    base_comm : Comm
        The communicator the mesh spans.
    alloc : callable, optional
        As in :func:`execute`.

    Returns
    -------
    ndarray
        This rank's shard (a new buffer).
    """
    alloc = np.empty if alloc is None else alloc
    coord = tuple(coord)
    src = src_rank_in_base
    what = ("distribute_tensor", spec)
    coords = _check_source(src, global_or_none, spec, coord, base_comm, what)
    out = alloc(spec.local_shape(coord), spec.dtype)
    fill = partial_fill(spec.placements, coord)
    shared = (
        type(out) is np.ndarray and tries_shared(spec, spec.dtype.itemsize) and shares(base_comm)
    )
    if not any(p.is_shard() for p in spec.placements):
        if base_comm.rank == src:
            copy(out, global_or_none)
        if not (shared and pull_from_source(base_comm, src, out, out, 0, "broadcast", what)):
            base_comm.bcast_array(out, src, what)
    else:
        blocks, counts, displs = _scatter_layout(spec, src, coords)
        if base_comm.rank == src:
            sbuf = _pack_blocks(global_or_none, spec, blocks, counts, displs, alloc)
            if fill is None:
                copy(out, _block(global_or_none, spec, coord))
            _scatter_send(base_comm, sbuf, counts, displs, out, shared, what)
        else:
            recv = out if fill is None else out.reshape(-1)[:0]
            _scatter_receive(base_comm, src, counts, displs, recv, shared, what)
    if fill is not None:
        out.fill(fill)
    return out


def _check_source(
    src: int, data: Any, spec: Any, coord: tuple, comm: _comm.Comm, what: Any
) -> list[list[int]]:
    """Every rank's mesh coordinate (by rank of ``comm``), after checking that the source
    holds an array of ``spec``'s shape and dtype; all ranks raise if it does not.
    **Collective** (one metadata exchange)."""
    is_src = comm.rank == src
    # any ndarray of the mesh's array module (numpy or cupy)
    is_array = hasattr(data, "shape") and hasattr(data, "dtype")
    bad = is_src and (not is_array or data.shape != spec.shape or data.dtype != spec.dtype)
    meta = comm.allgather_ints((int(bad),) + coord, what)
    if meta[src, 0]:
        got = f"{data.dtype} {data.shape}" if is_array else type(data).__name__
        raise ShardingError(
            f"distribute_tensor: the source rank {src} holds "
            f"{got if is_src else 'data'} that does not match {spec!r}"
        )
    return meta[:, 1:].tolist()


def _scatter_layout(
    spec: Any, src: int, coords: list[list[int]]
) -> tuple[list[tuple | None], list[int], list[int]]:
    """What the source sends each rank, in rank order: the coordinate of its block (None
    for the source, whose block is copied locally, and for the ranks that hold a Partial
    identity), and the element counts and displacements of the blocks in the pack buffer."""
    blocks = [
        None if rank == src or partial_fill(spec.placements, c) is not None else tuple(c)
        for rank, c in enumerate(coords)
    ]
    counts = [0 if c is None else math.prod(spec.local_shape(c)) for c in blocks]
    displs = displacements(counts)
    return blocks, counts, displs


def _block(data: Any, spec: Any, coord: tuple) -> Any:
    """The view of the global ``data`` that mesh coordinate ``coord`` holds under ``spec``."""
    return data[local_slices(spec.shape, spec.mesh_shape, spec.placements, coord)]


def _pack_blocks(
    data: Any, spec: Any, blocks: list, counts: list[int], displs: list[int], alloc: Alloc
) -> np.ndarray:
    """The source's flat pack buffer: each block of :func:`_scatter_layout` copied once
    out of the global ``data``, at its displacement. **Local**."""
    sbuf = alloc((sum(counts),), spec.dtype)
    for c, start, n in zip(blocks, displs, counts):
        if n:
            copy(sbuf[start : start + n].reshape(spec.local_shape(c)), _block(data, spec, c))
    return sbuf


def _scatter_send(
    comm: _comm.Comm,
    sbuf: np.ndarray,
    counts: list[int],
    displs: list[int],
    out: np.ndarray,
    shared: bool,
    what: Any,
) -> None:
    """The source's part of the scatter (its own block is already in ``out``): hand the
    pack buffer ``sbuf`` to the other ranks, through shared memory when ``shared`` and all
    ranks can, else with ``Scatterv``. **Collective**."""
    flat = out.reshape(-1)  # every rank passes two 1-D arrays
    pulled = shared and pull_from_source(comm, comm.rank, sbuf, flat, 0, "scatter", what)
    if not pulled:
        comm.scatterv(sbuf, counts, displs, None, comm.rank, what)


def _scatter_receive(
    comm: _comm.Comm,
    src: int,
    counts: list[int],
    displs: list[int],
    recv: np.ndarray,
    shared: bool,
    what: Any,
) -> None:
    """A non-source rank's part of the scatter: its block (``counts[rank]`` elements, 0
    for an identity holder) into ``recv``, read from the source's pack buffer in shared
    memory when ``shared`` and all ranks can, else with ``Scatterv``. **Collective**."""
    total = sum(counts)
    packed = np.empty((total,), recv.dtype)[:0]  # stands for the source's buffer
    flat, start = recv.reshape(-1), displs[comm.rank]
    pulled = shared and pull_from_source(comm, src, packed, flat, start, "scatter", what, total)
    if not pulled:
        comm.scatterv(None, counts, displs, recv, src, what)
