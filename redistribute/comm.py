"""MPI communicators for dtensor: the only library module that imports mpi4py.

This module owns:

- :class:`Comm`, a thin wrapper over an mpi4py communicator whose methods move data with
  the *buffer-based* collectives only (``Allgatherv``, ``Allreduce``, ``Reduce_scatter``,
  ``Alltoallv``/``Alltoallw``, ``Scatterv``, ``Bcast``); the pickling lower-case calls are
  never used for data. Data movement is dtype-agnostic (buffers travel as bytes);
  reductions are typed.
- the mapping of reduce ops (``sum``, ``avg``, ``max``, ``min``, ``prod``) to MPI ops;
- derived datatypes that describe a strided block of a C-contiguous buffer
  (:func:`block_type`, :func:`free_types`), so received data lands in place;
- :func:`world` and :func:`make_mesh_comms`, which split a base communicator into one
  sub-communicator per mesh dim (the caller, ``DeviceMesh``, caches them);
- the observer registry of the communication debug mode (:func:`add_observer`).

Counts and displacements of :class:`Comm` methods are in *elements* of the buffers' dtype,
except :meth:`Comm.alltoallw`, which follows MPI (counts in units of each datatype,
displacements in bytes).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from placements.errors import CommError, DTypeError, MeshError

__all__ = [
    "BYTES",
    "REDUCE_OPS",
    "Comm",
    "add_observer",
    "block_type",
    "free_types",
    "make_mesh_comms",
    "remove_observer",
    "world",
]

BYTES = MPI.BYTE
"""The MPI datatype of raw bytes (a contiguous block of n bytes is ``n`` of these)."""

REDUCE_OPS = ("sum", "avg", "max", "min", "prod")

# Observers of the communication debug mode, called as fn(kind, nbytes, comm) before a
# collective is issued. An empty list costs one falsy check per collective.
_observers: list[Callable[[str, int, Comm], None]] = []


def add_observer(fn: Callable[[str, int, Comm], None]) -> None:
    """Register ``fn(kind, nbytes, comm)``, called before every collective. **Local**.

    ``kind`` is one of ``"all_gather"``, ``"all_reduce"``, ``"reduce_scatter"``,
    ``"all_to_all"``, ``"scatter"``, ``"broadcast"``, ``"barrier"`` and
    ``"all_gather_ints"`` (small metadata exchanges); ``nbytes`` is the larger of the bytes
    this rank passes into the collective and the bytes it gets out of it; ``comm`` is the
    :class:`Comm` the collective runs on (``comm.mesh_dim`` tells the mesh dim).
    """
    _observers.append(fn)


def remove_observer(fn: Callable[[str, int, Comm], None]) -> None:
    """Unregister an observer added with :func:`add_observer`. **Local**."""
    try:
        _observers.remove(fn)
    except ValueError:
        raise CommError(f"remove_observer: {fn!r} is not a registered observer") from None


def _notify(kind: str, nbytes: int, comm: Comm) -> None:
    for fn in tuple(_observers):
        fn(kind, int(nbytes), comm)


# -- reduce ops ---------------------------------------------------------------------------

_MPI_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}
# Note: on bool data, sum and max are logical or, prod and min logical and (PyTorch and
# numpy agree: True + True is True for bool tensors).
_BOOL_OPS = {"sum": MPI.LOR, "max": MPI.LOR, "min": MPI.LAND, "prod": MPI.LAND}


_reductions: dict[tuple[np.dtype, str], tuple[Any, Any]] = {}


def _reduction(dtype: np.dtype, op: str, where: str) -> tuple[Any, Any]:
    """(MPI datatype, MPI op) for reducing ``dtype`` data with ``op``; raises on bad pairs."""
    found = _reductions.get((dtype, op))
    if found is None:
        found = _reductions[dtype, op] = _check_reduction(dtype, op, where)
    return found


def _check_reduction(dtype: np.dtype, op: str, where: str) -> tuple[Any, Any]:
    if op not in _MPI_OPS:
        raise DTypeError(f"{where}: unknown reduce op {op!r}; expected one of {REDUCE_OPS}")
    # mpi4py's own table of predefined types by typecode (float16 included); the
    # ``mpi4py.util.dtlib`` alternative returns duplicated types on which MPICH's predefined
    # ops are not defined. Non-native byte orders are not builtin and are refused.
    mpi_type = MPI._typedict.get(dtype.char) if dtype.isbuiltin else None
    if mpi_type is None or dtype.kind not in "biufc":
        raise DTypeError(f"{where}: cannot reduce dtype {dtype} with op {op!r}")
    if dtype.kind == "b":
        if op == "avg":
            raise DTypeError(f"{where}: reduce op 'avg' needs a floating dtype, got bool")
        return mpi_type, _BOOL_OPS[op]
    # Note: 'avg' of integer or bool data is refused, not floor-divided (no exact result).
    if op == "avg" and dtype.kind not in "fc":
        raise DTypeError(f"{where}: reduce op 'avg' needs a floating or complex dtype, got {dtype}")
    # Note: complex data has no max/min (PyTorch refuses; numpy would order lexicographically).
    if op in ("max", "min") and dtype.kind == "c":
        raise DTypeError(f"{where}: reduce op {op!r} is not defined for complex dtype {dtype}")
    return mpi_type, _MPI_OPS[op]


# -- derived datatypes --------------------------------------------------------------------


def block_type(shape: Sequence[int], byte_strides: Sequence[int], itemsize: int) -> tuple[int, Any]:
    """Describe a strided block (visited in C order) as an MPI datatype. **Local**.

    Parameters
    ----------
    shape, byte_strides : sequence of int
        The block's shape and its strides in bytes within the buffer (non-negative).
    itemsize : int
        Bytes per element.

    Returns
    -------
    (count, datatype)
        Pass ``count`` items of ``datatype`` to a collective. A contiguous block is
        ``(nbytes, BYTES)``; otherwise ``datatype`` is a committed derived type (nested
        hvectors over the block's contiguous runs) that the caller releases with
        :func:`free_types`.
    """
    dims = [(n, s) for n, s in zip(shape, byte_strides) if n != 1]
    if any(n == 0 for n, _ in dims):
        return 0, BYTES
    run = itemsize  # bytes of the innermost contiguous run
    while dims and dims[-1][1] == run:
        run *= dims.pop()[0]
    if not dims:
        return run, BYTES
    n, stride = dims.pop()
    dtype = BYTES.Create_hvector(n, run, stride)
    while dims:
        n, stride = dims.pop()
        outer = dtype.Create_hvector(n, 1, stride)
        dtype.Free()
        dtype = outer
    return 1, dtype.Commit()


def free_types(types: Sequence[Any]) -> None:
    """Release derived datatypes made by :func:`block_type`. **Local**.

    Predefined types are skipped, and nothing is done once MPI is finalized.
    """
    if MPI.Is_finalized():
        return
    for t in types:
        if t != MPI.DATATYPE_NULL and not t.is_predefined:
            t.Free()


# -- the communicator ---------------------------------------------------------------------


def _bytes(values: Sequence[int], itemsize: int) -> list[int]:
    return [int(v) * itemsize for v in values]


def _displs(counts: Sequence[int]) -> list[int]:
    return np.concatenate(([0], np.cumsum(counts[:-1], dtype=np.int64))).tolist()


class Comm:
    """A communicator with buffer-based collectives.

    Attributes
    ----------
    mpi : mpi4py.MPI.Comm
        The raw communicator (for users who call MPI directly).
    rank, size : int
        This process's rank in the communicator and the communicator's size.
    mesh_dim : int or None
        The mesh dim this communicator spans, or None for a base communicator.
    """

    __slots__ = ("mesh_dim", "mpi", "rank", "size")

    def __init__(self, mpi_comm: Any, mesh_dim: int | None = None) -> None:
        if not isinstance(mpi_comm, MPI.Comm) or mpi_comm == MPI.COMM_NULL:
            raise CommError(f"Comm: expected an mpi4py communicator, got {mpi_comm!r}")
        self.mpi = mpi_comm
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        self.mesh_dim = mesh_dim

    def __repr__(self) -> str:
        return f"Comm(rank={self.rank}, size={self.size}, mesh_dim={self.mesh_dim})"

    def free(self) -> None:
        """Release the underlying communicator (not COMM_WORLD/COMM_SELF). **Collective**."""
        if self.mpi not in (MPI.COMM_WORLD, MPI.COMM_SELF) and not MPI.Is_finalized():
            self.mpi.Free()

    def allgatherv(
        self,
        send: np.ndarray,
        recv: np.ndarray,
        counts: Sequence[int],
        displs: Sequence[int] | None = None,
    ) -> None:
        """Gather every rank's ``send`` into ``recv``. **Collective**.

        Equal counts at the default displacements use ``Allgather``, other layouts
        ``Allgatherv``.

        Parameters
        ----------
        send : ndarray
            This rank's contiguous contribution (``counts[rank]`` elements).
        recv : ndarray
            Contiguous output; rank ``i``'s data lands at element ``displs[i]``.
        counts, displs : sequence of int
            Elements per rank and their offsets in ``recv`` (default: packed in rank order).
            Zero counts are legal.
        """
        isz = recv.itemsize
        counts = list(counts)
        if _observers:
            _notify("all_gather", max(send.nbytes, sum(counts) * isz), self)
        mine = counts[self.rank] * isz
        if displs is None and counts.count(counts[self.rank]) == len(counts):
            self.mpi.Allgather([send, mine, BYTES], [recv, mine, BYTES])  # counts per rank
            return
        bdispls = _bytes(_displs(counts) if displs is None else displs, isz)
        self.mpi.Allgatherv([send, mine, BYTES], [recv, _bytes(counts, isz), bdispls, BYTES])

    def allreduce(self, send: np.ndarray, recv: np.ndarray | None = None, op: str = "sum") -> None:
        """Reduce ``send`` over all ranks into ``recv`` (in place when ``recv`` is None).

        **Collective**. ``op`` is one of sum, avg (sum, then divide by the size), max, min,
        prod. Buffers are contiguous and of the same shape and dtype.
        """
        mpi_type, mpi_op = _reduction(send.dtype, op, "all_reduce")
        if _observers:
            _notify("all_reduce", send.nbytes, self)
        if recv is None:
            self.mpi.Allreduce(MPI.IN_PLACE, [send, send.size, mpi_type], mpi_op)
            recv = send
        else:
            self.mpi.Allreduce([send, send.size, mpi_type], [recv, recv.size, mpi_type], mpi_op)
        if op == "avg":
            np.divide(recv, self.size, out=recv)

    def reduce_scatter(
        self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int], op: str = "sum"
    ) -> None:
        """Reduce ``send`` over all ranks; rank ``i`` gets the ``i``-th block. **Collective**.

        ``send`` holds ``sum(counts)`` elements, the blocks in rank order; ``recv`` gets
        ``counts[rank]`` elements. Zero counts are legal. ``op`` as in :meth:`allreduce`.
        Equal counts use ``Reduce_scatter_block``, others ``Reduce_scatter``.
        """
        mpi_type, mpi_op = _reduction(send.dtype, op, "reduce_scatter")
        counts = [int(c) for c in counts]
        if _observers:
            _notify("reduce_scatter", send.nbytes, self)
        mine = counts[self.rank]
        if counts.count(mine) == len(counts):
            # counts per block
            self.mpi.Reduce_scatter_block([send, mine, mpi_type], [recv, mine, mpi_type], mpi_op)
        else:
            self.mpi.Reduce_scatter(
                [send, sum(counts), mpi_type], [recv, mine, mpi_type], counts, mpi_op
            )
        if op == "avg":
            np.divide(recv, self.size, out=recv)

    def alltoallv(
        self,
        send: np.ndarray,
        send_counts: Sequence[int],
        send_displs: Sequence[int],
        recv: np.ndarray,
        recv_counts: Sequence[int],
        recv_displs: Sequence[int],
    ) -> None:
        """Send block ``j`` of ``send`` to rank ``j``; receive rank ``i``'s into ``recv``.

        **Collective**. Counts and displacements in elements; zero counts are legal.
        """
        isz = send.itemsize
        scounts, rcounts = _bytes(send_counts, isz), _bytes(recv_counts, isz)
        if _observers:
            _notify("all_to_all", max(sum(scounts), sum(rcounts)), self)
        self.mpi.Alltoallv(
            [send, scounts, _bytes(send_displs, isz), BYTES],
            [recv, rcounts, _bytes(recv_displs, isz), BYTES],
        )

    def alltoallw(
        self,
        send: np.ndarray,
        send_counts: Sequence[int],
        send_displs: Sequence[int],
        send_types: Sequence[Any],
        recv: np.ndarray,
        recv_counts: Sequence[int],
        recv_displs: Sequence[int],
        recv_types: Sequence[Any],
        kind: str = "all_to_all",
    ) -> None:
        """Like :meth:`alltoallv` with one datatype per peer. **Collective**.

        Counts are in units of the peer's datatype (:data:`BYTES` or one from
        :func:`block_type`), displacements in bytes from the start of the buffer. ``kind``
        is what observers are told (e.g. ``"all_gather"`` when the exchange implements
        one).
        """
        if _observers:
            sent = sum(c * t.Get_size() for c, t in zip(send_counts, send_types))
            got = sum(c * t.Get_size() for c, t in zip(recv_counts, recv_types))
            _notify(kind, max(sent, got), self)
        self.mpi.Alltoallw(
            [send, send_counts, send_displs, send_types],
            [recv, recv_counts, recv_displs, recv_types],
        )

    def scatterv(
        self,
        send: np.ndarray | None,
        counts: Sequence[int],
        displs: Sequence[int],
        recv: np.ndarray | None,
        root: int,
    ) -> None:
        """Rank ``i`` receives ``counts[i]`` elements of ``send`` (read on ``root`` only).

        **Collective**. ``recv=None`` on the root leaves the root's block in place (it is
        not copied); other ranks always pass a buffer (it may be empty).
        """
        if _observers:
            nbytes = send.nbytes if self.rank == root else recv.nbytes
            _notify("scatter", nbytes, self)
        if self.rank == root:
            isz = send.itemsize
            sendspec = [send, _bytes(counts, isz), _bytes(displs, isz), BYTES]
            recvspec = MPI.IN_PLACE if recv is None else [recv, recv.nbytes, BYTES]
        else:
            sendspec = None
            recvspec = [recv, recv.nbytes, BYTES]
        self.mpi.Scatterv(sendspec, recvspec, root)

    def bcast_array(self, arr: np.ndarray, root: int = 0) -> np.ndarray:
        """Broadcast the contiguous ``arr`` from ``root`` in place; returns it. **Collective**."""
        if _observers:
            _notify("broadcast", arr.nbytes, self)
        self.mpi.Bcast([arr, arr.nbytes, BYTES], root)
        return arr

    def barrier(self) -> None:
        """Wait for every rank. **Collective**."""
        if _observers:
            _notify("barrier", 0, self)
        self.mpi.Barrier()

    def allgather_ints(self, values: Sequence[int] | np.ndarray) -> np.ndarray:
        """Exchange a few int64 values; row ``i`` of the result is rank ``i``'s. **Collective**.

        Every rank must pass the same number of values. For metadata (shapes, coordinates,
        consistency checks), not for data.
        """
        mine = np.ascontiguousarray(values, dtype=np.int64).ravel()
        out = np.empty((self.size, mine.size), dtype=np.int64)
        if _observers:
            _notify("all_gather_ints", out.nbytes, self)
        self.mpi.Allgather([mine, MPI.INT64_T], [out, MPI.INT64_T])
        return out


def world() -> Comm:
    """A :class:`Comm` over ``MPI.COMM_WORLD``. **Local**."""
    return Comm(MPI.COMM_WORLD)


def make_mesh_comms(
    base: Comm, rank_grid: np.ndarray
) -> tuple[tuple[int, ...] | None, tuple[Comm, ...]]:
    """Split ``base`` into one communicator per mesh dim. **Collective** over ``base``.

    Parameters
    ----------
    base : Comm
        The communicator whose ranks ``rank_grid`` holds.
    rank_grid : ndarray of int
        The mesh: ``rank_grid[coord]`` is the ``base`` rank at mesh coordinate ``coord``.
        Every rank must pass the same grid (checked); ranks of ``base`` missing from it take
        part in the splits but belong to no mesh.

    Returns
    -------
    (coord, comms)
        This rank's mesh coordinate and, for each mesh dim ``m``, a :class:`Comm` over the
        ranks that share every coordinate except the one along ``m``, ordered by that
        coordinate (so the comm rank is ``coord[m]``). Ranks outside the mesh get
        ``(None, ())``. Nothing is cached here.
    """
    grid = np.asarray(rank_grid)
    if grid.dtype.kind not in "iu" or grid.ndim == 0:
        raise MeshError(
            f"make_mesh_comms: rank_grid must be an integer array with at least one dim, "
            f"got dtype {grid.dtype} and shape {grid.shape}"
        )
    grid = np.ascontiguousarray(grid, dtype=np.int64)
    digest = zlib.crc32(np.asarray(grid.shape, dtype=np.int64).tobytes() + grid.tobytes())
    digests = base.allgather_ints([digest])[:, 0]
    if (digests != digest).any():
        raise MeshError(
            f"make_mesh_comms: ranks passed different rank grids (this rank: shape "
            f"{grid.shape}, ranks {grid.ravel().tolist()})"
        )
    flat = grid.ravel()
    if np.unique(flat).size != flat.size or flat.min() < 0 or flat.max() >= base.size:
        raise MeshError(
            f"make_mesh_comms: rank_grid {grid.tolist()} must hold distinct ranks of a "
            f"communicator of size {base.size}"
        )
    hits = np.flatnonzero(flat == base.rank)
    coord = tuple(int(c) for c in np.unravel_index(hits[0], grid.shape)) if hits.size else None
    comms = []
    for m in range(grid.ndim):
        if coord is None:
            base.mpi.Split(MPI.UNDEFINED, 0)
            continue
        rest = coord[:m] + coord[m + 1 :]
        rest_shape = grid.shape[:m] + grid.shape[m + 1 :]
        color = int(np.ravel_multi_index(rest, rest_shape)) if rest else 0
        comms.append(Comm(base.mpi.Split(color, coord[m]), mesh_dim=m))
    return coord, tuple(comms)
