"""Exchanges through node-shared memory: what the executor's steps and the scatter share
when ranks of one node read each other's data directly (:mod:`redistribute.shm`).

This module owns the choice of trying that path (:func:`tries_shared`: a global tensor of
at least ``DTENSOR_SHM_MIN_BYTES``, 1 MiB), the communicator's probe (:func:`shares`), the
descriptor table in which the ranks tell each other where their arrays live
(:func:`shared_table`, :func:`peer_array`), the reduction of peers' blocks
(:func:`reduce_into`), copies out of one rank's buffer (:func:`pull_from_source`) and the
count and report of each exchange (:func:`tally`).

A row of the descriptor table: [all shared, pid, shm epoch, then per array: fd, serial,
segment size, byte offset, byte strides (ndim values)]; every rank passes arrays of the same
ndims. The ranks first exchange where their inputs live (one small all-gather) and end with
a barrier-like all-reduce of one flag, so that no input is reused while a peer may still
read it. Any rank whose input is ordinary memory (a wrapped numpy array) sends the whole
exchange down the MPI path.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from .. import shm as _shm
from ..comm import Comm

__all__ = [
    "peer_array",
    "pull_from_source",
    "reduce_into",
    "shared_table",
    "shares",
    "tally",
    "tries_shared",
]


def tries_shared(spec: Any, isz: int) -> bool:
    """Whether an exchange of ``spec`` tries the shared-memory path: a global tensor of at
    least :data:`redistribute.shm.MIN_BYTES`. The answer must be the same on every rank, so
    it does not depend on whether this process makes shared segments (that may differ, and
    the communicator's probe and the descriptor exchange sort it out collectively). A small
    gather (one MPI all-gather) never tries. **Local**."""
    return math.prod(spec.shape) * isz >= max(_shm.MIN_BYTES, 1)


def shares(comm: Comm) -> bool:
    """Whether the ranks of ``comm`` can read each other's shared segments; probed on first
    use and kept on the communicator. **Collective** the first time."""
    if comm.shared is None:
        comm.shared = _shm.probe(comm)
    return comm.shared


def tally(comm: Comm, kind: str, ok: bool, nbytes: int) -> bool:
    """Count a shared-memory exchange of ``kind`` (or its fallback, when not ``ok``) and
    tell the observers of one that ran; returns ``ok``. **Local**."""
    _shm.count(kind if ok else kind + " fallback")
    if ok:
        comm.report(kind, nbytes)
    return ok


_UFUNCS = {"sum": np.add, "avg": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}


def shared_table(
    comm: Comm, arrays: tuple, kind: str, what: Any, detail: str = ""
) -> np.ndarray | None:
    """Tell the ranks where ``arrays`` live; the table of every rank's descriptors, or None
    (on every rank) unless all of them are in shared segments. **Collective**. ``detail``
    goes to the SPMD check's fingerprint."""
    desc, ok = [0, os.getpid(), _shm.epoch()], True
    for a in arrays:
        where = _shm.locate(a)
        ok = ok and (where is not None or a.size == 0)
        desc += [*(where or (-1, 0, 0, 0)), *a.strides]
    desc[0] = int(ok)
    table = comm.shared_exchange(desc, kind, what, detail)
    return table if table[:, 0].all() else None


def peer_array(row: np.ndarray, i: int, shape: tuple, dtype: np.dtype) -> np.ndarray | None:
    """The array of descriptor ``i`` in ``row`` (a peer's), mapped read-only; None when it
    cannot be mapped or does not fit its segment. An empty array maps nothing. **Local**."""
    pos = 3 + i * (4 + len(shape))
    fd, serial, size, offset = (int(v) for v in row[pos : pos + 4])
    strides = [int(v) for v in row[pos + 4 : pos + 4 + len(shape)]]
    if math.prod(shape) == 0:
        return np.empty(shape, dtype)
    try:
        buf = _shm.peer_buffer(int(row[1]), fd, serial, size, int(row[2]))
        return np.ndarray(shape, dtype, buf, offset, strides)
    except (OSError, TypeError, ValueError):
        return None


def reduce_into(out: np.ndarray, parts: list[np.ndarray], op: str, k: int) -> None:
    """``out = parts[0] op parts[1] op ...``, in that order (``out`` may share memory with
    ``parts[0]`` only); avg then divides by ``k``. An overflow gives inf without numpy's
    warning, as MPI's reductions (and PyTorch) do; the ``errstate`` costs microseconds
    against the megabytes that take this path. **Local**."""
    ufunc = _UFUNCS[op]
    with np.errstate(all="ignore"):
        ufunc(parts[0], parts[1], out=out)
        for part in parts[2:]:
            ufunc(out, part, out=out)
        if op == "avg":
            np.divide(out, k, out=out)


def pull_from_source(
    comm: Comm,
    src: int,
    buf: np.ndarray,
    out: np.ndarray,
    start: int,
    kind: str,
    what: Any,
    total: int | None = None,
) -> bool:
    """Every rank but ``src`` copies ``out.size`` elements from element ``start`` of the
    source's flat buffer ``buf`` (``total`` elements; this rank's ``buf`` is a stand-in
    elsewhere) into ``out``, reading the source's shared segment. **Collective**; False on
    every rank when the buffers are not all shared or a rank cannot map the source's (the
    caller then runs the MPI collective)."""
    table = shared_table(comm, (buf, out), kind, what)
    if table is None:
        return False
    read = True
    if comm.rank != src and out.size:
        n = buf.size if total is None else total
        whole = peer_array(table[src], 0, (n,) if buf.ndim == 1 else buf.shape, out.dtype)
        if whole is None:
            read = False
        else:
            np.copyto(out.reshape(-1), whole.reshape(-1)[start : start + out.size])
    nbytes = out.nbytes if comm.rank != src else buf.nbytes
    return tally(comm, kind, comm.all_true(read, what), nbytes)
