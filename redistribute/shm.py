"""Node-shared memory: ranks on one node read each other's shards directly.

The caching allocator (``dtensor.local.allocator``) takes its segments from here. On Linux each
segment is a ``memfd`` (an anonymous shared-memory file) mapped into this process; a peer
process on the same node maps the same pages through ``/proc/<pid>/fd/<fd>``. A
redistribute exchange whose ranks all hold their input in such segments then copies each
peer's block straight out of the peer's memory into its own output (one read and one
write of every byte), where going through MPI needs a pack of every strided block first
(MPICH's single-copy transport reads contiguous buffers only at full speed) and so moves
half as many bytes again.

What this module owns:

- :class:`Segment`: one shared segment, registered by address so that :func:`locate` can
  tell whether (and where) an array lives in one.
- :func:`peer_buffer`: a read-only mapping of a peer's segment, cached (bounded, oldest
  out; a segment the peer has since replaced is mapped again).
- :func:`probe`: whether every rank of a communicator can map every other's segments (same
  node, same kernel namespace, permission to open the peer's descriptors). It is
  **Collective** and is run once per communicator by its caller.
- fork safety: a process forked from a rank would share the segments' pages with it, so
  a child's writes would show in the parent's tensors. After a fork the child remaps every
  segment as private memory holding the same bytes, so the two processes' tensors are
  separate, as with ordinary memory.

Cost: where the kernel gives shared memory no transparent huge pages (``shmem_enabled``
``never``) and numpy's large arrays get them, an MPI call that writes into a shared segment
is slower than one into ordinary memory (a 16 MiB ``Allgather``: about 1.5x), and copies
between shared segments pay 4 KiB-page translation; measured in BENCHMARKS.md.

Settings (read at import): ``DTENSOR_SHM=0`` turns shared segments off (every segment is
ordinary memory and every exchange goes through MPI); ``DTENSOR_SHM_MIN_BYTES`` (default
1 MiB) is the global tensor size from which an exchange tries the shared path.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
from bisect import bisect_right, insort
from collections import OrderedDict
from typing import Any

import numpy as np

from placements.env import env_flag, env_int

__all__ = [
    "MIN_BYTES",
    "Segment",
    "clear_peer_maps",
    "count",
    "counts",
    "disable",
    "enabled",
    "epoch",
    "locate",
    "peer_buffer",
    "probe",
    "requested",
]


def requested() -> bool:
    """Whether the settings ask for shared memory here: ``DTENSOR_SHM`` (default on) on a
    Linux with ``memfd``. **Local**. Unlike :func:`enabled`, a later :func:`disable` (a
    failed probe) does not change it, so ranks can compare what they were asked for."""
    return (
        env_flag("DTENSOR_SHM", True)
        and sys.platform.startswith("linux")
        and hasattr(os, "memfd_create")
    )


def _env_min_bytes() -> int:
    return env_int("DTENSOR_SHM_MIN_BYTES", 1 << 20)


_ENABLED = requested()

#: Exchanges of a global tensor of at least this many bytes try the shared path.
MIN_BYTES: int = _env_min_bytes()

# peer mappings kept: at most this many, and at most this many bytes in all
_MAX_PEER_MAPS = 64
_MAX_PEER_BYTES = 4 << 30

_PAGE = mmap.PAGESIZE
_HUGE = 2 << 20  # segments from this size ask for transparent huge pages


def _max_segments() -> int:
    """Live shared segments allowed: each holds a file descriptor, so at most a quarter of
    the descriptor limit (and 1024); later segments are ordinary memory."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft == resource.RLIM_INFINITY:
            soft = 4096
    except (ImportError, OSError, ValueError):
        soft = 1024
    return max(1, min(1024, soft // 4))


_MAX_SEGMENTS = _max_segments()


def _machine_bytes() -> int:
    """RAM plus swap: the most one allocation may ask for. Private memory (``numpy.empty``)
    beyond it is refused by the kernel's overcommit heuristic with a MemoryError, but a
    shared ``memfd`` mapping bypasses that heuristic (the kernel would grant it and the
    OOM killer would strike while filling it), so segments check it themselves."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("SwapTotal:"):
                    total += int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    return total


_MACHINE_BYTES = _machine_bytes()


def enabled() -> bool:
    """Whether new allocator segments are shared. **Local**."""
    return _ENABLED


#: How many exchanges of each kind (``all_gather``, ``all_to_all``, ``all_reduce``,
#: ``reduce_scatter``) this process has run through shared memory, and how many tried and
#: fell back to MPI (``"<kind> fallback"``).
counts: dict[str, int] = {}


def count(key: str) -> None:
    """Add one to ``counts[key]``. **Local**."""
    counts[key] = counts.get(key, 0) + 1


# -- own segments -------------------------------------------------------------------------

_lock = threading.Lock()
_addresses: list[int] = []  # sorted start addresses of the live segments
_segments: dict[int, Segment] = {}  # address -> segment
_serial = 0
_closed = 0  # segments closed so far: a peer that sees this change drops its old mappings


class Segment:
    """``size`` bytes of shared memory, mapped read-write at :attr:`address`. **Local**.

    Attributes
    ----------
    buffer : numpy.ndarray
        The memory as a 1-D uint8 array (it keeps the mapping alive).
    address : int
        Address of the first byte (page-aligned).
    size : int
        Size in bytes.
    fd : int
        The memfd; peers open it as ``/proc/<pid>/fd/<fd>``.
    serial : int
        A number unique in this process, so that a peer never mistakes a later segment
        with the same descriptor number for this one.

    Raises
    ------
    MemoryError
        When ``size`` exceeds the machine's RAM plus swap (as ``numpy.empty`` would).
    OSError
        When the kernel refuses the memfd or the mapping, or this process already holds
        its quota of segments (the caller falls back to ordinary memory).
    """

    __slots__ = ("address", "buffer", "fd", "serial", "size")

    def __init__(self, size: int) -> None:
        global _serial
        if size > _MACHINE_BYTES:
            raise MemoryError(
                f"Unable to allocate {size / (1 << 30):.3g} GiB ({size} bytes) of shared "
                f"memory: more than this machine's RAM and swap ({_MACHINE_BYTES} bytes)"
            )
        if len(_segments) >= _MAX_SEGMENTS:
            raise OSError(f"dtensor: {_MAX_SEGMENTS} shared segments already live")
        fd = os.memfd_create("dtensor", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, max(size, 1))
            mapping = mmap.mmap(fd, max(size, 1))
        except BaseException:
            os.close(fd)
            raise
        if size >= _HUGE and hasattr(mmap, "MADV_HUGEPAGE"):
            try:  # huge pages where the kernel allows them for shared memory
                mapping.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass
        self.buffer = np.frombuffer(mapping, np.uint8)[:size]
        self.address = self.buffer.ctypes.data
        self.size = size
        self.fd = fd
        with _lock:
            _serial += 1
            self.serial = _serial
            _segments[self.address] = self
            insort(_addresses, self.address)

    def close(self) -> None:
        """Unregister the segment and close its descriptor. **Local**. The memory is
        unmapped when :attr:`buffer` (and every array viewing it) dies."""
        global _closed
        with _lock:
            if _segments.get(self.address) is self:
                del _segments[self.address]
                del _addresses[bisect_right(_addresses, self.address) - 1]
                _closed += 1
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __repr__(self) -> str:
        return f"Segment(address={self.address:#x}, size={self.size}, fd={self.fd})"


def epoch() -> int:
    """How many segments this process has closed; a peer that sees the number change drops
    its mappings of this process's segments (see :func:`peer_buffer`). **Local**."""
    return _closed


def locate(arr: np.ndarray) -> tuple[int, int, int, int] | None:
    """``(fd, serial, size, offset)`` of the shared segment holding all of ``arr``
    (``offset``: bytes from the segment's start to ``arr``'s first element), or None.
    **Local**."""
    if arr.size == 0:
        return None
    start = arr.__array_interface__["data"][0]
    lo = hi = start
    for n, s in zip(arr.shape, arr.strides):
        if s < 0:
            lo += (n - 1) * s
        else:
            hi += (n - 1) * s
    hi += arr.itemsize
    with _lock:
        i = bisect_right(_addresses, lo) - 1
        if i < 0:
            return None
        seg = _segments[_addresses[i]]
        if hi > seg.address + seg.size or seg.fd < 0:
            return None
        return seg.fd, seg.serial, seg.size, start - seg.address


# -- peers' segments ----------------------------------------------------------------------

_peer_maps: OrderedDict[tuple[int, int], tuple[int, np.ndarray]] = OrderedDict()
_peer_epochs: dict[int, int] = {}  # pid -> the epoch its mappings were made in
_peer_bytes = 0
_peer_lock = threading.Lock()


def _map_peer(pid: int, fd: int, size: int) -> np.ndarray:
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    handle = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY)
    try:
        if os.fstat(handle).st_size < size:
            raise OSError(f"shared segment {pid}/{fd} is smaller than {size} bytes")
        mapping = mmap.mmap(handle, max(size, 1), flags=flags, prot=mmap.PROT_READ)
    finally:
        os.close(handle)
    return np.frombuffer(mapping, np.uint8)[:size]


def peer_buffer(pid: int, fd: int, serial: int, size: int, peer_epoch: int = 0) -> np.ndarray:
    """A read-only uint8 view of a peer's segment (as :func:`locate` described it there).
    **Local**; cached.

    The cache holds at most 64 mappings (4 GiB); a mapping keeps the peer's memory alive
    even after the peer frees the segment, so when ``peer_epoch`` (the peer's
    :func:`epoch`) differs from the one of the cached mappings, all of them are dropped.

    Raises
    ------
    OSError
        The segment cannot be opened or mapped.
    """
    with _peer_lock:
        return _peer_buffer(pid, fd, serial, size, peer_epoch)


def _peer_buffer(pid: int, fd: int, serial: int, size: int, peer_epoch: int) -> np.ndarray:
    global _peer_bytes
    if _peer_epochs.get(pid, peer_epoch) != peer_epoch:
        for old in [k for k in _peer_maps if k[0] == pid]:
            _peer_bytes -= _peer_maps.pop(old)[1].size
    _peer_epochs[pid] = peer_epoch
    key = (pid, fd)
    hit = _peer_maps.get(key)
    if hit is not None and hit[0] == serial and hit[1].size == size:
        _peer_maps.move_to_end(key)
        return hit[1]
    if hit is not None:
        _peer_bytes -= _peer_maps.pop(key)[1].size
    buf = _map_peer(pid, fd, size)
    _peer_maps[key] = (serial, buf)
    _peer_bytes += size
    while len(_peer_maps) > _MAX_PEER_MAPS or (
        _peer_bytes > _MAX_PEER_BYTES and len(_peer_maps) > 1
    ):
        _peer_bytes -= _peer_maps.popitem(last=False)[1][1].size
    return buf


def clear_peer_maps() -> None:
    """Drop every cached peer mapping. **Local**."""
    global _peer_bytes
    with _peer_lock:
        _peer_maps.clear()
        _peer_epochs.clear()
        _peer_bytes = 0


def _node_id() -> int:
    """This process's host (:func:`redistribute.comm.process.my_host`), below 2**62."""
    from .comm.process import my_host  # lazy: probe runs after MPI is up; import is early

    return my_host()


def disable() -> None:
    """Take new allocator segments from ordinary memory from now on. **Local**."""
    global _ENABLED
    _ENABLED = False


def probe(comm: Any) -> bool:
    """Whether every rank of ``comm`` can read every other rank's segments. **Collective**.

    Every rank makes a one-page segment holding a random token; each maps every peer's and
    compares the token (this also rejects a peer on another node whose process id happens to
    exist here). Ranks of different hosts (:mod:`redistribute.hosts`, simulated ones
    included) never share. ``comm`` is a :class:`redistribute.comm.Comm`.

    When the ranks are on one node but cannot map each other's segments (the kernel's
    ptrace policy forbids opening a sibling's descriptors, for instance), shared segments
    bring no gain and MPI moves data into them more slowly than into ordinary memory, so
    :func:`disable` is called: later segments are ordinary memory.
    """
    seg = None
    if _ENABLED:
        try:
            seg = Segment(_PAGE)
        except OSError:
            seg = None
    token = int.from_bytes(os.urandom(7), "little")
    if seg is not None:
        seg.buffer[:8] = np.frombuffer(token.to_bytes(8, "little"), np.uint8)
        mine = [1, os.getpid(), seg.fd, seg.serial, token, _node_id()]
    else:
        mine = [0, 0, 0, 0, 0, _node_id()]
    try:
        table = comm.shared_exchange(mine, "probe", what="shared-memory probe")
        # ranks of several hosts never share segments (a simulated host could map them)
        ok = bool(table[:, 0].all()) and len(set(table[:, 5].tolist())) == 1
        for j in range(comm.size):
            if not ok:
                break
            if j == comm.rank:
                continue
            _, pid, fd, _, tok, _ = (int(v) for v in table[j])
            try:
                buf = _map_peer(pid, fd, _PAGE)
                ok = int.from_bytes(buf[:8].tobytes(), "little") == tok
            except OSError:
                ok = False
        ok = comm.all_true(ok, what="shared-memory probe result")
        if not ok and len(set(table[:, 5].tolist())) == 1:
            disable()
        return ok
    finally:
        if seg is not None:
            seg.close()


# -- fork ---------------------------------------------------------------------------------

_MAP_PRIVATE, _MAP_ANONYMOUS, _MAP_FIXED = 0x02, 0x20, 0x10
_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2


def _after_fork_in_child() -> None:
    """Give this (forked) process private copies of the segments it inherited."""
    global _lock, _peer_lock
    _lock, _peer_lock = threading.Lock(), threading.Lock()  # another thread may have held them
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]  # fmt: skip
    libc.mremap.restype = ctypes.c_void_p
    libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int,
                            ctypes.c_void_p]  # fmt: skip
    failed = ctypes.c_void_p(-1).value
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    for seg in list(_segments.values()):
        length = -(-max(seg.size, 1) // _PAGE) * _PAGE
        tmp = libc.mmap(None, length, prot, _MAP_PRIVATE | _MAP_ANONYMOUS, -1, 0)
        if tmp in (None, failed):
            raise OSError(ctypes.get_errno(), "dtensor: cannot copy a shared segment after fork")
        ctypes.memmove(tmp, seg.address, length)
        moved = libc.mremap(tmp, length, length, _MREMAP_MAYMOVE | _MREMAP_FIXED, seg.address)
        if moved != seg.address:
            raise OSError(ctypes.get_errno(), "dtensor: cannot remap a shared segment after fork")
        seg.close()
    clear_peer_maps()


if _ENABLED:
    os.register_at_fork(after_in_child=_after_fork_in_child)
