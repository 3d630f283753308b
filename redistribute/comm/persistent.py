"""Persistent all-gathers (MPI 4 ``Allgather_init``/``Allgatherv_init``).

This module owns :class:`PersistentGather`, the per-communicator pools of them
(:func:`pooled_gather`): each communicator keeps a pool keyed by the byte counts per rank,
made in the same order on every rank (their initialisation is a collective), kept
oldest-made-first-out, and freed when dropped, when the communicator is freed and at exit
(before MPI finalizes). They are off by default (on this machine an 8x8 all-gather measured
no faster persistent than blocking); ``DTENSOR_PERSISTENT=1`` or :func:`set_persistent`
turns them on (the setting lives in :data:`redistribute.comm.hooks.HOOKS`).

MPI never matches a persistent all-gather with a blocking one, so a rank that turned them
on alone would hang at the next small redistribute. :func:`set_persistent` is therefore
collective over ``COMM_WORLD`` once a mesh spans it: the ranks meet on a private duplicate
of ``COMM_WORLD`` (made at the first such mesh's creation, :func:`make_channel`), compare
the settings they would run with, and change them only together; ranks that ask for
different settings all raise ``ConfigError``, and a rank whose peers do not call it within
its ``timeout`` raises ``CommError`` (its setting unchanged, so it stays in step with
them). A call that timed out is completed by the next call of that rank (it meets the
others' next call), so the ranks' calls keep pairing in order.

It also owns :func:`request_c_api`: the MPI library's ``MPI_Start``/``MPI_Wait`` and
mpi4py's request accessor, with which compiled code runs a persistent request without
Python calls.
"""

from __future__ import annotations

import atexit
import ctypes
import time
from typing import Any

import numpy as np
from mpi4py import MPI

from placements.env import env_flag
from placements.errors import CommError, ConfigError

from .datatypes import BYTES, displacements
from .hooks import HOOKS, update

__all__ = [
    "PersistentGather",
    "free_pool",
    "make_channel",
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
# The private duplicate of COMM_WORLD on which set_persistent's calls meet (None until a
# mesh spans COMM_WORLD), and the request of a call that timed out, still pending (its
# kind, the request, the buffers MPI owns until it completes): the next call completes it
_channel: Any = None
_pending: Any = None
#: How long set_persistent waits for the other ranks by default (seconds).
AGREE_TIMEOUT_S = 30.0


def make_channel() -> None:
    """Make the channel of :func:`set_persistent`'s agreement, once. **Collective** over
    ``COMM_WORLD`` the first time (a mesh over every rank calls it at its creation)."""
    global _channel
    if _channel is None and MPI.COMM_WORLD.Get_size() > 1:
        _channel = MPI.COMM_WORLD.Dup()


def _wait(request: Any, deadline: float) -> bool:
    """Poll ``request`` until it completes (True) or ``deadline`` passes (False)."""
    pause = 1e-5
    while not request.Test():
        if time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(2 * pause, 0.01)
    return True


def _agree(on: bool | None, timeout: float | None) -> None:
    """The ranks' meeting of :func:`set_persistent` on the channel: every rank arrives
    (a nonblocking barrier), then they exchange the setting each would run with and raise
    alike when those differ. **Collective** over ``COMM_WORLD``."""
    global _pending
    deadline = float("inf") if timeout is None else time.monotonic() + timeout
    arrival = None
    if _pending is not None:
        kind, request, buffers = _pending
        _pending = None
        if kind == "arrival":  # this call is that one's: it meets the others' next call
            arrival = request
        elif not _wait(request, deadline):  # an exchange that the others left: end it first
            _pending = (kind, request, buffers)
            raise CommError("set_persistent: an earlier exchange of settings with the other "
                            f"ranks did not complete within {timeout:g} s")
    wanted = int(_HAS_PERSISTENT and (env_flag("DTENSOR_PERSISTENT", False) if on is None
                                      else on))
    arrival = arrival or _channel.Ibarrier()
    if not _wait(arrival, deadline):
        _pending = ("arrival", arrival, ())
        raise CommError(
            f"set_persistent: the other ranks of COMM_WORLD did not call set_persistent "
            f"within {timeout:g} s; every rank must call it at the same point of the "
            "program (MPI never matches a persistent all-gather with a blocking one: a rank "
            "that switched alone would hang at the next redistribute). This rank's setting "
            "is unchanged; its next set_persistent call completes this one."
        )
    mine, values = np.array([wanted], np.int64), np.empty(_channel.Get_size(), np.int64)
    request = _channel.Iallgather([mine, MPI.INT64_T], [values, MPI.INT64_T])
    if not _wait(request, deadline):
        _pending = ("exchange", request, (mine, values))  # MPI still owns the buffers
        raise CommError(
            f"set_persistent: the other ranks did not exchange their setting within "
            f"{timeout:g} s (this rank's setting is unchanged)")
    if (values != wanted).any():
        on_ranks = np.flatnonzero(values).tolist()
        off_ranks = np.flatnonzero(values == 0).tolist()
        raise ConfigError(
            f"set_persistent: the ranks asked for different settings (persistent all-gathers "
            f"on for world ranks {on_ranks}, off for world ranks {off_ranks}); every rank "
            "must ask for the same (settings unchanged on every rank)"
        )


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


def set_persistent(on: bool | None, timeout: float | None = AGREE_TIMEOUT_S) -> bool | None:
    """Turn the persistent all-gathers of redistributes on or off. **Collective** over
    ``COMM_WORLD`` once a mesh spans it (every rank calls it at the same point of the
    program; see the module docstring), **Local** before that (``DTENSOR_PERSISTENT`` and
    this setting are then compared between the ranks at mesh creation). Without MPI 4
    persistent collectives they stay off.

    Parameters
    ----------
    on : bool or None
        True or False forces the setting; None follows ``DTENSOR_PERSISTENT`` (default off).
    timeout : float or None
        Seconds to wait for the other ranks' calls (None: no limit).

    Returns
    -------
    bool or None
        The previous forced setting (pass it back to restore).

    Raises
    ------
    ConfigError
        On every rank, when the ranks ask for different settings (none changes).
    CommError
        On this rank, when the other ranks do not call it within ``timeout`` (its setting
        unchanged).
    """
    global _persistent_forced
    forced = None if on is None else bool(on)
    if _channel is not None:
        _agree(forced, timeout)
    prev, _persistent_forced = _persistent_forced, forced
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
