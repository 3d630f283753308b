"""Collectives on device (GPU) buffers: the CUDA-aware path and the pinned-host staging path.

This module owns how a collective reaches MPI when its buffers live in device memory:

- :class:`PinnedPool`, a cache of host staging buffers (page-locked on a GPU machine, so
  that device copies run at full speed without an extra driver bounce). Buffers are taken
  per collective and returned right after it; freed buffers are kept by size class and
  handed out again, so a repeated redistribute pays no fresh allocation or pinning.
- :class:`DeviceBackend`, the four operations the staging logic needs from an array
  module (is this a device array, copy device to host, copy host to device, wait for the
  device). They are injected, so numpy can stand in for cupy where no GPU exists.
- :class:`DeviceComm`, a wrapper over a :class:`redistribute.comm.Comm` with the same
  collective methods. On the ``"cuda-aware"`` path it waits for the device, then hands the
  device buffers to MPI unchanged. On the ``"staged"`` path it copies every device buffer
  that the collective reads into a pooled host buffer, waits for the device once, runs the
  host collective on the host buffers and copies what the collective wrote back to the
  device, waiting again before the host buffers return to the pool. Host (numpy) buffers
  pass through untouched on both paths.
- :func:`select_path`, the choice between the two paths.

This module imports no MPI library: it calls the wrapped communicator's methods.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from placements.errors import ArgumentError, CommError

__all__ = [
    "PATHS",
    "DeviceBackend",
    "DeviceComm",
    "PinnedPool",
    "select_path",
]

#: The two ways device buffers reach MPI.
PATHS = ("cuda-aware", "staged")

_KiB = 1024
_MiB = 1024 * _KiB
_MIN_CLASS = 4 * _KiB  # smallest staging buffer
_SMALL_LIMIT = 2 * _MiB  # up to here: power-of-two classes; above: multiples of 2 MiB
_DEFAULT_MAX_CACHED = 1024 * _MiB


def select_path(cuda_aware: bool, override: str | None = None) -> str:
    """Which path device buffers take to MPI.

    **Local.**

    Parameters
    ----------
    cuda_aware : bool
        Whether the loaded MPI library accepts device pointers.
    override : str, optional
        ``"auto"`` (or empty/None: decide from ``cuda_aware``), ``"cuda-aware"`` or
        ``"staged"``. Default: the environment variable ``DTENSOR_GPU_COMM``.

    Returns
    -------
    str
        ``"cuda-aware"`` or ``"staged"``.

    Raises
    ------
    CommError
        For an unknown override, or ``"cuda-aware"`` asked of an MPI that is not.
    """
    if override is None:
        override = os.environ.get("DTENSOR_GPU_COMM", "")
    choice = override.strip().lower() or "auto"
    if choice == "auto":
        return PATHS[0] if cuda_aware else PATHS[1]
    if choice not in PATHS:
        raise CommError(
            f"DTENSOR_GPU_COMM={override!r}: expected one of 'auto', 'cuda-aware', 'staged'"
        )
    if choice == "cuda-aware" and not cuda_aware:
        raise CommError(
            "DTENSOR_GPU_COMM='cuda-aware', but the loaded MPI library does not report CUDA "
            "support (MPIX_Query_cuda_support); use 'staged' or 'auto'"
        )
    return choice


def _size_class(nbytes: int) -> int:
    """Bytes of the pooled buffer that serves a request of ``nbytes``."""
    if nbytes <= _MIN_CLASS:
        return _MIN_CLASS
    if nbytes <= _SMALL_LIMIT:
        return 1 << (nbytes - 1).bit_length()
    return -(-nbytes // _SMALL_LIMIT) * _SMALL_LIMIT


class PinnedPool:
    """A cache of host staging buffers (1-D uint8 numpy arrays), by size class.

    Requests up to 2 MiB are rounded up to a power of two (at least 4 KiB), larger ones to
    a multiple of 2 MiB. A returned buffer is kept for the next request of its class unless
    the free buffers would then exceed ``max_cached_bytes``; it is then dropped.

    Parameters
    ----------
    alloc_host : callable, optional
        ``alloc_host(nbytes) -> 1-D uint8 numpy array`` of at least ``nbytes`` bytes; on a
        GPU machine a page-locked allocation. Default ``numpy.empty`` (pageable memory).
    max_cached_bytes : int
        Upper bound of the free (cached) bytes. Default 1 GiB.
    """

    def __init__(
        self,
        alloc_host: Callable[[int], np.ndarray] | None = None,
        max_cached_bytes: int = _DEFAULT_MAX_CACHED,
    ) -> None:
        self._alloc_host = alloc_host or (lambda n: np.empty(n, np.uint8))
        self._max_cached = int(max_cached_bytes)
        self._free: dict[int, list[np.ndarray]] = {}
        self._in_use: dict[int, np.ndarray] = {}  # id(buffer) -> buffer
        self._lock = threading.Lock()
        self._reserved = self._cached = self._peak = 0
        self._allocs = self._hits = 0

    def acquire(self, nbytes: int) -> np.ndarray:
        """A buffer of at least ``nbytes`` bytes (its whole size class). **Local**.

        Give it back with :meth:`release`.
        """
        size = _size_class(int(nbytes))
        with self._lock:
            free = self._free.get(size)
            if free:
                buf = free.pop()
                self._cached -= size
                self._hits += 1
            else:
                buf = None
        if buf is None:
            buf = self._alloc_host(size)
            if buf.dtype != np.uint8 or buf.ndim != 1 or buf.nbytes < size:
                raise ArgumentError(
                    f"PinnedPool: alloc_host({size}) returned a {buf.dtype} array of shape "
                    f"{buf.shape}; expected a 1-D uint8 array of at least {size} bytes"
                )
            buf = buf[:size]
            with self._lock:
                self._allocs += 1
                self._reserved += size
                self._peak = max(self._peak, self._reserved)
        with self._lock:
            self._in_use[id(buf)] = buf
        return buf

    def release(self, buf: np.ndarray) -> None:
        """Return a buffer from :meth:`acquire` to the pool. **Local**."""
        with self._lock:
            if self._in_use.pop(id(buf), None) is not buf:
                raise ArgumentError(
                    f"PinnedPool.release: a buffer of {buf.nbytes} bytes that is not in use "
                    "(released twice, or not from this pool)"
                )
            size = buf.nbytes
            if self._cached + size <= self._max_cached:
                self._free.setdefault(size, []).append(buf)
                self._cached += size
            else:
                self._reserved -= size

    @contextmanager
    def borrow(self, sizes: Sequence[int]):
        """Context manager: one buffer per entry of ``sizes`` (exactly that many bytes each,
        views of pooled buffers), returned to the pool on exit. **Local**."""
        taken: list[np.ndarray] = []
        try:
            for n in sizes:
                taken.append(self.acquire(n))
            yield [buf[:n] for buf, n in zip(taken, sizes)]
        finally:
            for buf in taken:
                self.release(buf)

    def stats(self) -> dict[str, int]:
        """Counters of the pool, as a flat dict. **Local**.

        ``reserved_bytes`` (held by the pool, in use or cached), ``cached_bytes`` (free,
        kept for reuse), ``in_use_bytes``, ``peak_reserved_bytes``, ``num_allocs`` (calls
        of ``alloc_host``) and ``cache_hits`` (requests served from the cache).
        """
        with self._lock:
            return {
                "reserved_bytes": self._reserved,
                "cached_bytes": self._cached,
                "in_use_bytes": self._reserved - self._cached,
                "peak_reserved_bytes": self._peak,
                "num_allocs": self._allocs,
                "cache_hits": self._hits,
            }

    def empty_cache(self) -> None:
        """Drop every cached (free) buffer; buffers in use are kept. **Local**."""
        with self._lock:
            self._free.clear()
            self._reserved -= self._cached
            self._cached = 0


@dataclass(frozen=True)
class DeviceBackend:
    """What the staging logic needs from an array module.

    Attributes
    ----------
    name : str
        Shown in :meth:`DeviceComm.describe` (e.g. ``"cupy"``).
    is_device : callable
        ``is_device(obj) -> bool``: True for an array in device memory.
    to_host : callable
        ``to_host(device_array, host_array)``: copy a C-contiguous device array into a
        numpy array of the same shape and dtype, ordered after the work already issued on
        the device (the current stream).
    to_device : callable
        ``to_device(host_array, device_array)``: the reverse copy.
    synchronize : callable
        ``synchronize()``: wait until the device finished all issued work and copies.
    """

    name: str
    is_device: Callable[[Any], bool]
    to_host: Callable[[Any, np.ndarray], None]
    to_device: Callable[[np.ndarray, Any], None]
    synchronize: Callable[[], None]


_IN, _OUT, _INOUT = 1, 2, 3  # what a collective does with a buffer: reads, writes, both


def _host_reduction(send: Any, op: str) -> bool:
    """Whether a reduction of ``send`` with ``op`` must see host buffers on every path:
    floating max/min reduce with a user-defined MPI op (NaN-propagating, see
    :mod:`redistribute.comm`) that runs numpy on the buffers MPI hands it, which a
    CUDA-aware MPI would hand as device memory."""
    return op in ("max", "min") and send.dtype.kind == "f"


class DeviceComm:
    """A communicator whose collectives accept device buffers.

    It has the collective methods of :class:`redistribute.comm.Comm` with the same
    signatures and semantics; any other attribute (``rank``, ``size``, ``mesh_dim``,
    ``mpi``, ``barrier``, ``allgather_ints``, ``free``...) is the wrapped communicator's.

    Parameters
    ----------
    comm : Comm
        The wrapped host communicator.
    backend : DeviceBackend
        Array-module operations.
    path : str
        ``"cuda-aware"`` or ``"staged"`` (see :func:`select_path`).
    pool : PinnedPool, optional
        Host staging buffers (staged path); default a new pool over ``numpy.empty``.

    Notes
    -----
    Staging copies, per collective, the device buffers it reads to the host and the ones
    it writes back to the device. A receive buffer that the collective may fill only in
    part (``alltoallv``/``alltoallw``, ``allgatherv`` with displacements or slack) is also
    copied to the host first, so that its other bytes survive the copy back.
    """

    __slots__ = ("_comm", "_pool", "backend", "path")

    def __init__(
        self,
        comm: Any,
        backend: DeviceBackend,
        path: str,
        pool: PinnedPool | None = None,
    ) -> None:
        if path not in PATHS:
            raise CommError(f"DeviceComm: path {path!r} is not one of {PATHS}")
        self._comm = comm
        self.backend = backend
        self.path = path
        self._pool = pool if pool is not None else PinnedPool()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_comm":  # copy/pickle probe an unset instance
            raise AttributeError(name)
        return getattr(self._comm, name)

    def __repr__(self) -> str:
        return f"DeviceComm({self._comm!r}, path={self.path!r})"

    def describe(self) -> str:
        """One line naming the path device buffers take, for ``explain``/``--info``. **Local**."""
        if self.path == "cuda-aware":
            return f"cuda-aware MPI ({self.backend.name} device buffers passed directly)"
        return f"staged through pooled pinned host buffers ({self.backend.name})"

    # -- the staging logic --------------------------------------------------------------

    def _run(
        self,
        fn: Callable[..., Any],
        args: list,
        roles: dict[int, int],
        kw: dict[str, Any],
        host: bool = False,
    ) -> Any:
        """Call ``fn(*args, **kw)`` with the device arrays among ``args[i]`` (role
        ``roles[i]``) replaced per the path (``host``: staged on either path); returns
        ``fn``'s result (a host stand-in mapped back)."""
        be = self.backend
        staged = [(i, role) for i, role in roles.items() if be.is_device(args[i])]
        if not staged:
            return fn(*args, **kw)
        if self.path == "cuda-aware" and not host:
            be.synchronize()  # kernels that produce or still read the buffers are done
            return fn(*args, **kw)
        # one host buffer per distinct device array; roles of repeated arrays are merged
        uses: dict[int, list] = {}
        for i, role in staged:
            arr = args[i]
            if not arr.flags.c_contiguous:
                raise CommError(
                    f"{fn.__name__}: device buffer of shape {arr.shape} and strides "
                    f"{arr.strides} is not C-contiguous"
                )
            entry = uses.setdefault(id(arr), [arr, 0, []])
            entry[1] |= role
            entry[2].append(i)
        entries = list(uses.values())
        with self._pool.borrow([arr.nbytes for arr, _, _ in entries]) as bufs:
            hosts = []
            for (arr, role, positions), buf in zip(entries, bufs):
                host = buf.view(arr.dtype).reshape(arr.shape)
                if role & _IN:
                    be.to_host(arr, host)
                for i in positions:
                    args[i] = host
                hosts.append(host)
            be.synchronize()  # device data on the host, before MPI reads it
            result = fn(*args, **kw)
            back = [(host, arr) for (arr, role, _), host in zip(entries, hosts) if role & _OUT]
            for host, arr in back:
                be.to_device(host, arr)
            if back:
                be.synchronize()  # copies done before the host buffers are reused
        for (arr, _, _), host in zip(entries, hosts):
            if result is host:
                return arr
        return result

    # -- collectives (signatures of Comm) -----------------------------------------------
    # Arguments after the buffers' own (``kind``, ``what``, ...) pass through unchanged.

    def allgatherv(self, send, recv, counts, displs=None, *rest, **kw) -> None:
        """:meth:`Comm.allgatherv` on device or host buffers. **Collective**."""
        full = displs is None and sum(int(c) for c in counts) * recv.itemsize == recv.nbytes
        roles = {0: _IN, 1: _OUT if full else _INOUT}
        return self._run(self._comm.allgatherv, [send, recv, counts, displs, *rest], roles, kw)

    def allreduce(self, send, recv=None, op: str = "sum", *rest, **kw) -> None:
        """:meth:`Comm.allreduce` on device or host buffers. **Collective**."""
        roles = {0: _INOUT} if recv is None else {0: _IN, 1: _OUT}
        host = _host_reduction(send, op)
        return self._run(self._comm.allreduce, [send, recv, op, *rest], roles, kw, host)

    def reduce_scatter(self, send, recv, counts, op: str = "sum", *rest, **kw) -> None:
        """:meth:`Comm.reduce_scatter` on device or host buffers. **Collective**."""
        args = [send, recv, counts, op, *rest]
        host = _host_reduction(send, op)
        return self._run(self._comm.reduce_scatter, args, {0: _IN, 1: _OUT}, kw, host)

    def alltoallv(
        self, send, send_counts, send_displs, recv, recv_counts, recv_displs, *rest, **kw
    ) -> None:
        """:meth:`Comm.alltoallv` on device or host buffers. **Collective**."""
        args = [send, send_counts, send_displs, recv, recv_counts, recv_displs, *rest]
        return self._run(self._comm.alltoallv, args, {0: _IN, 3: _INOUT}, kw)

    def alltoallw(
        self,
        send,
        send_counts,
        send_displs,
        send_types,
        recv,
        recv_counts,
        recv_displs,
        recv_types,
        *rest,
        **kw,
    ) -> None:
        """:meth:`Comm.alltoallw` on device or host buffers. **Collective**."""
        args = [send, send_counts, send_displs, send_types]
        args += [recv, recv_counts, recv_displs, recv_types, *rest]
        return self._run(self._comm.alltoallw, args, {0: _IN, 4: _INOUT}, kw)

    def scatterv(self, send, counts, displs, recv, root: int, *rest, **kw) -> None:
        """:meth:`Comm.scatterv` on device or host buffers. **Collective**."""
        roles = {} if send is None else {0: _IN}
        if recv is not None:
            roles[3] = _OUT
        return self._run(self._comm.scatterv, [send, counts, displs, recv, root, *rest], roles, kw)

    def bcast_array(self, arr, root: int = 0, *rest, **kw):
        """:meth:`Comm.bcast_array` on a device or host buffer; returns ``arr``.
        **Collective**."""
        role = _IN if self._comm.rank == root else _OUT
        return self._run(self._comm.bcast_array, [arr, root, *rest], {0: role}, kw)
