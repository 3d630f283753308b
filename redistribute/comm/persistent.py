"""Persistent all-gathers (MPI 4 ``Allgather_init``/``Allgatherv_init``).

This module owns :class:`PersistentGather`, the per-communicator pools of them
(:func:`pooled_gather`): each communicator keeps a pool keyed by the byte counts per rank,
made in the same order on every rank (their initialisation is a collective), kept
oldest-made-first-out, and freed when dropped, when the communicator is freed and at exit
(before MPI finalizes). They are off by default (on this machine an 8x8 all-gather measured
no faster persistent than blocking); ``DTENSOR_PERSISTENT=1`` or :func:`set_persistent`
turns them on (the setting lives in :data:`redistribute.comm.hooks.HOOKS`).

It also owns :func:`request_c_api`: the MPI library's ``MPI_Start``/``MPI_Wait`` and
mpi4py's request accessor, with which compiled code runs a persistent request without
Python calls.
"""

from __future__ import annotations

import atexit
import ctypes
from typing import Any

import numpy as np
from mpi4py import MPI

from placements.env import env_flag

from .datatypes import BYTES, displacements
from .hooks import HOOKS, update

__all__ = [
    "PersistentGather",
    "free_pool",
    "persistent_enabled",
    "pooled_gather",
    "read_env",
    "request_c_api",
    "set_persistent",
]

# Persistent all-gathers kept per communicator; beyond this the oldest made is freed. The
# pool changes only when a request is made (a lookup that finds one changes nothing), so it
# evolves the same way on every rank of a communicator: all of them ask for the same counts
# in the same order, since each request stands for one collective call they all make.
_PERSISTENT_MAX = 64
# Whether this MPI has persistent collectives (MPI 4; one library, so the same on every rank)
_HAS_PERSISTENT = MPI.Get_version() >= (4, 0) and hasattr(MPI.Comm, "Allgather_init")
_persistent_forced: bool | None = None  # set_persistent; None follows DTENSOR_PERSISTENT
# The pools that hold requests, freed at exit (registered after mpi4py's finalizer was, so
# this runs first)
_pools: list[dict] = []


def read_env() -> None:
    """Set the persistent all-gathers from ``DTENSOR_PERSISTENT`` (unless
    :func:`set_persistent` forced them). **Local**.

    Raises
    ------
    ConfigError
        ``DTENSOR_PERSISTENT`` is not an on/off value.
    """
    on = env_flag("DTENSOR_PERSISTENT", False) if _persistent_forced is None else _persistent_forced
    update(persistent=_HAS_PERSISTENT and on)


def persistent_enabled() -> bool:
    """Whether redistributes run their small all-gathers as persistent requests, after
    reading ``DTENSOR_PERSISTENT`` again (a :func:`set_persistent` setting wins). **Local**.

    Raises
    ------
    ConfigError
        ``DTENSOR_PERSISTENT`` is not an on/off value.
    """
    read_env()
    return HOOKS.persistent


def set_persistent(on: bool | None) -> bool | None:
    """Turn the persistent all-gathers of redistributes on or off for this process. **Local**.

    MPI does not match a persistent collective with a blocking one, so call this at the
    same point of the program on every rank (``DTENSOR_PERSISTENT`` is compared between
    the ranks at mesh creation). Without MPI 4 persistent collectives they stay off.

    Parameters
    ----------
    on : bool or None
        True or False forces the setting; None follows ``DTENSOR_PERSISTENT`` (default off).

    Returns
    -------
    bool or None
        The previous forced setting (pass it back to restore).
    """
    global _persistent_forced
    prev, _persistent_forced = _persistent_forced, None if on is None else bool(on)
    read_env()
    return prev


class PersistentGather:
    """One persistent all-gather of fixed byte counts on one communicator, with its own
    send and receive buffers (bytes). Made by :func:`pooled_gather`.

    Attributes
    ----------
    request : mpi4py.MPI.Prequest or None
        The persistent request (None once freed).
    send, recv : ndarray of uint8
        The buffers the request is bound to: this rank's block, and every rank's blocks in
        rank order.
    """

    __slots__ = ("recv", "request", "send")

    def __init__(self, mpi_comm: Any, counts: tuple[int, ...], rank: int) -> None:
        mine = counts[rank]
        self.send = np.empty(mine, np.uint8)
        self.recv = np.empty(sum(counts), np.uint8)
        if counts.count(mine) == len(counts):
            self.request = mpi_comm.Allgather_init([self.send, BYTES], [self.recv, BYTES])
        else:
            spec = [self.recv, list(counts), displacements(counts), BYTES]
            self.request = mpi_comm.Allgatherv_init([self.send, BYTES], spec)

    def run(self, send: np.ndarray, recv: np.ndarray) -> None:
        """Gather the C-contiguous ``send`` of every rank into the C-contiguous ``recv``
        through the request. **Collective**. ``recv`` is a copy of the request's buffer, so
        an output handed out earlier is never written by a later start."""
        np.copyto(self.send, send.reshape(-1).view(np.uint8))
        self.request.Start()
        self.request.Wait()
        np.copyto(recv.reshape(-1).view(np.uint8), self.recv)

    def free(self) -> None:
        """Release the request (nothing once MPI is finalized). **Local**."""
        if self.request is not None and not MPI.Is_finalized():
            self.request.Free()
        self.request = None


def pooled_gather(
    pool: dict, mpi_comm: Any, counts: tuple[int, ...], rank: int
) -> PersistentGather:
    """The persistent all-gather of ``counts`` bytes per rank in ``pool`` (a communicator's;
    ``mpi_comm`` and ``rank`` are that communicator and this rank in it).

    **Collective** when it is made (the first time, or again after the pool dropped it:
    every rank of the communicator asks for the same counts in the same order, so all of
    them make it together), Local when the pool holds it.
    """
    found = pool.get(counts)
    if found is None:
        if not pool:
            if not any(p is pool for p in _pools):
                _pools.append(pool)
        elif len(pool) >= _PERSISTENT_MAX:
            pool.pop(next(iter(pool))).free()
        found = pool[counts] = PersistentGather(mpi_comm, counts, rank)
    return found


def request_c_api() -> tuple | None:
    """What compiled code needs to start and wait for a persistent request without a Python
    call: ``(address of MPI_Start, address of MPI_Wait, mpi4py's PyMPIRequest_Get capsule,
    MPI.Exception)``, from the MPI library mpi4py runs on; None where one of them cannot be
    found (the caller then calls the request's ``Start`` and ``Wait``). Both functions take
    only pointers (``MPI_Request *``, ``MPI_Status *``), whatever the library's handle
    types. **Local**."""
    try:
        lib = ctypes.CDLL(MPI.__file__)
        start = ctypes.cast(lib.MPI_Start, ctypes.c_void_p).value
        wait = ctypes.cast(lib.MPI_Wait, ctypes.c_void_p).value
        get = MPI.__pyx_capi__["PyMPIRequest_Get"]
    except (OSError, AttributeError, KeyError):
        return None
    return start, wait, get, MPI.Exception


def free_pool(pool: dict) -> None:
    """Release every persistent all-gather of ``pool`` and empty it. **Local**."""
    for p in pool.values():
        p.free()
    pool.clear()


@atexit.register
def _free_pools() -> None:
    for pool in _pools:
        free_pool(pool)
