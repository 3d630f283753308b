"""Parallel file IO for dtensor: MPI-IO files shared by the ranks of a communicator.

This module owns :class:`File`, a thin wrapper over ``mpi4py.MPI.File`` for the checkpoint
and ``.npy`` code of ``dtensor.checkpoint``: opening a file collectively, independent writes
of byte ranges (:meth:`File.write_at`; a checkpoint's loads read with ``preadv`` on
descriptors opened inside the checkpoint folder, which MPI-IO cannot offer), collective reads
and writes of one N-D block of a C-ordered array stored at a byte offset
(:meth:`File.read_block_all`, :meth:`File.write_block_all`, through a subarray file view),
and syncing. It is, with :mod:`redistribute.comm`, the only library code that imports
mpi4py. MPI errors become :class:`CheckpointError` naming the operation and the file.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
from mpi4py import MPI

from placements.errors import CheckpointError

from .comm import BYTES, Comm

__all__ = ["File", "threads_allowed"]

#: Largest byte count of one MPI call: larger ranges are moved in several calls.
_MAX_CALL = 1 << 30


def threads_allowed() -> bool:
    """Whether a thread other than the main one may call MPI (file IO beside other work)
    while the main thread does not: the MPI library was initialised with at least
    ``MPI_THREAD_SERIALIZED``. **Local**."""
    return MPI.Query_thread() >= MPI.THREAD_SERIALIZED


def _reason(e: MPI.Exception) -> str:
    """The first line of an MPI error's text, without MPICH's error stack."""
    return e.Get_error_string().split(", error stack")[0].splitlines()[0]


def _bytes_of(buf: np.ndarray) -> np.ndarray:
    """The contiguous ``buf`` as a flat uint8 view (shares memory)."""
    if not buf.flags.c_contiguous:
        raise CheckpointError(f"file IO needs a contiguous buffer, got strides {buf.strides}")
    return buf.reshape(-1).view(np.uint8)


class File:
    """One file opened by every rank of a communicator. **Collective** to open and close.

    Parameters
    ----------
    comm : Comm or None
        The ranks that open the file together; None: this rank alone (``COMM_SELF``, then
        every method is **Local**).
    path : str or os.PathLike
        The file.
    mode : {"r", "w"}
        Read only, or write only (created when missing; existing data is kept unless
        overwritten, so writers of a new file should open a path that does not exist).
    op : str
        The caller's operation, named in error messages (``save``, ``load``, ...).

    Raises
    ------
    CheckpointError
        The file cannot be opened (missing, no permission), on every rank of ``comm``.
    """

    __slots__ = ("_fh", "comm", "op", "path")

    def __init__(self, comm: Comm | None, path: str | os.PathLike, mode: str, op: str) -> None:
        self.comm = comm
        self.path = os.fspath(path)
        self.op = op
        amode = MPI.MODE_RDONLY if mode == "r" else MPI.MODE_WRONLY | MPI.MODE_CREATE
        try:
            self._fh = MPI.File.Open(MPI.COMM_SELF if comm is None else comm.mpi, self.path, amode)
        except MPI.Exception as e:
            raise CheckpointError(
                f"{op}: cannot open {self.path!r} ({'read' if mode == 'r' else 'write'}): "
                f"{_reason(e)}"
            ) from None

    def _fail(self, what: str, e: MPI.Exception) -> CheckpointError:
        return CheckpointError(f"{self.op}: {what} of {self.path!r} failed: {_reason(e)}")

    def write_at(self, offset: int, buf: np.ndarray) -> None:
        """Write the contiguous ``buf`` at byte ``offset``. **Local** (independent IO)."""
        data = _bytes_of(buf)
        try:
            for start in range(0, data.size, _MAX_CALL):
                part = data[start : start + _MAX_CALL]
                self._fh.Write_at(offset + start, [part, part.size, BYTES])
        except MPI.Exception as e:
            raise self._fail(f"writing {data.size} bytes at offset {offset}", e) from None

    def _block_view(
        self,
        disp: int,
        shape: Sequence[int],
        offsets: Sequence[int],
        lengths: Sequence[int],
        itemsize: int,
        count: int,
    ) -> tuple[object, list]:
        """Set the file view to the block ``offsets``/``lengths`` of a C-ordered array of
        ``shape`` at byte ``disp`` (``count`` elements; 0: none); returns (etype, types to
        free)."""
        etype = BYTES.Create_contiguous(itemsize).Commit()
        if count == 0 or len(shape) == 0:
            self._fh.Set_view(disp, etype, etype, "native")
            return etype, [etype]
        filetype = etype.Create_subarray(
            [int(s) for s in shape], [int(n) for n in lengths], [int(o) for o in offsets]
        ).Commit()
        self._fh.Set_view(disp, etype, filetype, "native")
        return etype, [etype, filetype]

    def _block_all(self, read: bool, disp, shape, offsets, lengths, buf: np.ndarray) -> None:
        what = "reading" if read else "writing"
        types: list = []
        try:
            count = buf.size
            if count and count != int(np.prod(lengths, dtype=np.int64)):
                raise CheckpointError(
                    f"{self.op}: a buffer of {count} items for a block of shape "
                    f"{tuple(lengths)} of {self.path!r}"
                )
            etype, types = self._block_view(disp, shape, offsets, lengths, buf.itemsize, count)
            spec = [_bytes_of(buf), count, etype]
            (self._fh.Read_all if read else self._fh.Write_all)(spec)
        except MPI.Exception as e:
            raise self._fail(
                f"{what} block at {tuple(offsets)} of shape {tuple(lengths)} (array of shape "
                f"{tuple(shape)} at byte {disp})",
                e,
            ) from None
        finally:
            for t in types:
                t.Free()

    def read_block_all(
        self,
        disp: int,
        shape: Sequence[int],
        offsets: Sequence[int],
        lengths: Sequence[int],
        buf: np.ndarray,
    ) -> None:
        """Read block ``offsets``/``lengths`` of the C-ordered array of ``shape`` (items of
        ``buf.itemsize`` bytes) stored from byte ``disp`` into the contiguous ``buf``.

        **Collective** over the file's ranks (each reads its own block; a rank that reads
        nothing passes an empty ``buf``). The file view is left set: use :meth:`write_at` after it
        only through a new :class:`File`.
        """
        self._block_all(True, disp, shape, offsets, lengths, buf)

    def write_block_all(
        self,
        disp: int,
        shape: Sequence[int],
        offsets: Sequence[int],
        lengths: Sequence[int],
        buf: np.ndarray,
    ) -> None:
        """Write the contiguous ``buf`` as block ``offsets``/``lengths`` of the C-ordered
        array of ``shape`` stored from byte ``disp``. **Collective**, as
        :meth:`read_block_all`."""
        self._block_all(False, disp, shape, offsets, lengths, buf)

    def sync(self) -> None:
        """Flush every rank's writes to storage (fsync). **Collective**."""
        try:
            self._fh.Sync()
        except MPI.Exception as e:
            raise self._fail("syncing", e) from None

    def close(self) -> None:
        """Close the file. **Collective**."""
        try:
            self._fh.Close()
        except MPI.Exception as e:
            raise self._fail("closing", e) from None
