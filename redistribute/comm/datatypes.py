"""How buffers look to MPI: raw bytes, strided blocks as derived datatypes, and the byte
counts and displacements of blocks packed in rank order.

This module owns :data:`BYTES`, :func:`block_type` and :func:`free_types` (derived
datatypes that describe a strided block of a C-contiguous buffer, so received data lands in
place), and the count helpers the collectives share (:func:`byte_counts`,
:func:`displacements`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

__all__ = ["BYTES", "block_type", "byte_counts", "displacements", "free_types"]

BYTES = MPI.BYTE
"""The MPI datatype of raw bytes (a contiguous block of n bytes is ``n`` of these)."""


def byte_counts(values: Sequence[int], itemsize: int) -> list[int]:
    """``values`` (counts or displacements in elements) in bytes. **Local**."""
    return [int(v) * itemsize for v in values]


def displacements(counts: Sequence[int]) -> list[int]:
    """The displacements of blocks of ``counts`` packed in rank order. **Local**."""
    return np.concatenate(([0], np.cumsum(counts[:-1], dtype=np.int64))).tolist()


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
