"""The caching memory allocator behind every local tensor's Storage.

This module owns how dtensor gets memory: :func:`empty_array` (the one entry point the
local tensor calls), the caching :class:`CPUAllocator`, the :class:`Block` handles it
hands out, and the memory statistics API (:func:`memory_stats`, :func:`memory_snapshot`,
:func:`empty_cache`, :func:`reset_peak_memory_stats`).

Why a cache: a fresh multi-megabyte buffer costs a page fault per 4 KiB page on first
touch, so a repeated redistribute into fresh buffers is several times slower than into
reused ones. The CPU allocator keeps freed blocks and hands them out again, already
touched.

Layout (modelled on PyTorch's CUDA caching allocator):

* **Segments** are node-shared memory on Linux (a ``memfd`` mapping from
  :class:`redistribute.shm.Segment`, page-aligned), so that the redistribute executor on a
  peer rank of the same node can read a shard directly; elsewhere, with
  ``DTENSOR_SHM=0``, in the ``nocache`` mode, or when the kernel refuses a memfd, they
  come from ``numpy.empty`` (uint8, over-allocated by 64 bytes and aligned to 64 bytes).
  A segment is carved into **blocks**; every block size is a multiple of 512 bytes, so
  every block address is 64-byte aligned.
* **Small pool** (rounded request <= 1 MiB): 2 MiB segments; one free list per 512-byte
  size class. Any leftover of at least 512 bytes is split off as a free block.
* **Large pool** (rounded request > 1 MiB): a request below 10 MiB takes a 20 MiB
  segment (so several mid-sized blocks share one); a larger one takes a segment of its
  size rounded up to 2 MiB. A free block is taken best-fit by size (exact size class
  first, then the smallest larger one) and split when more than 1 MiB would be left.
* A freed block is **merged** with free neighbours in its segment, so a segment whose
  blocks all die becomes one free block again; :func:`empty_cache` returns such
  segments to the system. When no new segment can be had the allocator empties its
  cache and retries once.

Small requests: a request below :data:`POOL_MIN_BYTES` (env ``DTENSOR_POOL_MIN_BYTES``,
default 4096) is served by plain ``numpy.empty`` and does not appear in the statistics.
numpy's own small-block cache is faster than any Python-level pool, and pooling exists to
avoid the page faults of big buffers, which small ones do not have. ``empty_array`` reads
the constant at every call, so it can be changed at run time. Arrays of object dtype are
never pooled (their memory must start zeroed).

Compiled front: with the compiled extension enabled (``DTENSOR_FASTPATH`` not ``0``, read
at import), :func:`empty_array` runs in compiled code (:class:`fastpath._pool.BlockCache`)
and keeps whole blocks of each rounded size that their arrays gave back, up to 16 per size
and 1 GiB in all: an allocation that finds one costs about what ``numpy.empty`` costs
(the Python pool's bookkeeping costs several microseconds), and only a miss reaches the
pool below. The statistics then count the arrays handed out (a block waiting in that
cache is free, as in the pool); :func:`empty_cache` and a failed segment allocation give
the waiting blocks back to the pool first. With ``DTENSOR_FASTPATH=0`` the pure-Python
pool serves every request.

Debugging: ``DTENSOR_ALLOCATOR=nocache`` (read at import) disables caching: every
allocation gets a fresh segment of its own and every free releases it, so memory tools
see each buffer's real lifetime. The statistics keep working (``cache_hits`` stays 0).

Lifetime: an array from :func:`empty_array` views a :class:`Block`; walking ``arr.base``
while it is an ndarray ends at that block. The block returns its memory to the pool when
the block object dies, i.e. when the last array (or Storage) referencing it dies. Frees
may come from any thread, including a garbage collection that runs while this thread
holds the allocator's lock; such a free is deferred until the lock is released.

On ``device="cuda"`` cupy's memory pool is the allocator: :func:`empty_array` returns
``cupy.empty`` and the statistics functions report that pool under the same keys.
"""

from __future__ import annotations

import math
import mmap
import operator
import os
import sys
import threading
import weakref
from bisect import bisect_left, insort
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import numpy as np

import fastpath as _fp
from placements.env import env_int
from placements.errors import AllocationError, ArgumentError, ConfigError
from redistribute import shm as _shm

__all__ = [
    "POOL_MIN_BYTES",
    "Block",
    "CPUAllocator",
    "ReleasableBuffer",
    "allocating",
    "empty_array",
    "empty_cache",
    "memory_snapshot",
    "memory_stats",
    "pooled_empty",
    "reset_peak_memory_stats",
]

_KiB = 1024
_MiB = 1024 * _KiB

_ALIGN = 64  # byte alignment of every segment (and so of every block)
_ROUND = 512  # block sizes are multiples of this
_SMALL_LIMIT = 1 * _MiB  # rounded requests up to this size use the small pool
_SMALL_SEGMENT = 2 * _MiB  # segment size of the small pool
_LARGE_SEGMENT = 20 * _MiB  # segment size for large requests below _MIN_LARGE_ALLOC
_MIN_LARGE_ALLOC = 10 * _MiB  # large requests from here on get a segment of their own
_ROUND_LARGE = 2 * _MiB  # rounding of such own segments
_SMALL_MIN_SPLIT = _ROUND  # small pool: split off any leftover of at least this size
_LARGE_MIN_SPLIT = _SMALL_LIMIT + 1  # large pool: split only if more than 1 MiB is left


def _env_caching() -> bool:
    mode = os.environ.get("DTENSOR_ALLOCATOR", "").strip().lower()
    if mode not in ("", "caching", "nocache"):
        raise ConfigError(
            f"environment variable DTENSOR_ALLOCATOR={mode!r} is not one of 'caching', 'nocache'"
        )
    return mode != "nocache"


#: Requests (in bytes) below this size bypass the pool and use ``numpy.empty``.
POOL_MIN_BYTES: int = env_int("DTENSOR_POOL_MIN_BYTES", 4096)


class _Segment:
    """One buffer (shared or ``numpy.empty``), carved into a linked list of spans."""

    __slots__ = ("address", "buffer", "first", "pool", "shared", "size")

    def __init__(self, size: int, pool: _Pool | None) -> None:
        self.shared = None
        if pool is not None and _shm.enabled():
            try:
                self.shared = _shm.Segment(size)
            except OSError:  # no memfd here (descriptor limit, kernel): ordinary memory
                self.shared = None
        if self.shared is not None:
            self.buffer = self.shared.buffer
            self.address = self.shared.address  # page-aligned
        else:
            self.buffer = np.empty(size + _ALIGN, np.uint8)
            base = self.buffer.ctypes.data
            self.address = base + (-base) % _ALIGN
        self.size = size
        self.pool = pool
        # The lowest span of a segment is never absorbed by a merge (merges keep the
        # lower span), so it stays the head of the list for the segment's lifetime.
        self.first = _Span(self, self.address, size)


class _Span:
    """A contiguous range of a segment: the allocator's record of one block."""

    __slots__ = ("address", "allocated", "next", "prev", "requested", "segment", "size")

    def __init__(self, segment: _Segment, address: int, size: int) -> None:
        self.segment = segment
        self.address = address
        self.size = size
        self.requested = 0
        self.allocated = False
        self.prev: _Span | None = None
        self.next: _Span | None = None


class _Pool:
    """Free spans of one pool, binned by exact size, with a sorted list of the sizes."""

    __slots__ = ("bins", "min_split", "name", "sizes")

    def __init__(self, name: str, min_split: int) -> None:
        self.name = name
        self.min_split = min_split
        self.sizes: list[int] = []  # sorted sizes that have at least one free span
        self.bins: dict[int, dict[_Span, None]] = {}  # size -> free spans (ordered set)

    def segment_size(self, size: int) -> int:
        if self.name == "small":
            return _SMALL_SEGMENT
        if size < _MIN_LARGE_ALLOC:
            return _LARGE_SEGMENT
        return -(-size // _ROUND_LARGE) * _ROUND_LARGE

    def take(self, size: int) -> _Span | None:
        """Remove and return the best-fitting free span of at least ``size`` bytes."""
        key = size
        spans = self.bins.get(key)
        if spans is None:
            i = bisect_left(self.sizes, size)
            if i == len(self.sizes):
                return None
            key = self.sizes[i]
            spans = self.bins[key]
        span = spans.popitem()[0]
        if not spans:
            del self.bins[key]
            del self.sizes[bisect_left(self.sizes, key)]
        return span

    def put(self, span: _Span) -> None:
        spans = self.bins.get(span.size)
        if spans is None:
            spans = self.bins[span.size] = {}
            insort(self.sizes, span.size)
        spans[span] = None

    def remove(self, span: _Span) -> None:
        spans = self.bins[span.size]
        del spans[span]
        if not spans:
            del self.bins[span.size]
            del self.sizes[bisect_left(self.sizes, span.size)]


class Block:
    """One live allocation: the memory owner at the end of a pooled array's base chain.

    ``numpy.asarray(block)`` is a zero-copy 1-D uint8 array of ``nbytes`` bytes whose
    ``base`` is the block. The memory goes back to :attr:`allocator` when the block
    object dies.

    Attributes
    ----------
    allocator : CPUAllocator
        The allocator that made this block.
    nbytes : int
        The requested size in bytes (the pool may reserve a little more).
    address : int
        Address of the first byte (64-byte aligned).
    """

    __slots__ = ("_span", "address", "allocator", "nbytes")

    def __init__(self, allocator: CPUAllocator, span: _Span, nbytes: int) -> None:
        self.allocator = allocator
        self.nbytes = nbytes
        self.address = span.address
        self._span = span

    @property
    def __array_interface__(self) -> dict[str, Any]:
        return {
            "shape": (self.nbytes,),
            "typestr": "|u1",
            "data": (self.address, False),
            "version": 3,
        }

    def __del__(self, _finalizing=sys.is_finalizing) -> None:
        # (a default argument: module globals are None by the time the last Blocks die)
        if _finalizing():  # interpreter shutdown: the module's helpers may be gone, and the
            return  # process's memory goes with it
        self.allocator._release(self._span)

    def __repr__(self) -> str:
        return f"Block(address={self.address:#x}, nbytes={self.nbytes})"


class CPUAllocator:
    """Caching allocator of 64-byte-aligned host memory (see the module docstring).

    Parameters
    ----------
    caching : bool
        ``False`` gives every allocation a fresh segment and releases it on free
        (the ``DTENSOR_ALLOCATOR=nocache`` mode).

    Notes
    -----
    All methods are thread-safe. Blocks are freed by their handles dying, never by an
    explicit call.
    """

    device = "cpu"

    def __init__(self, caching: bool = True) -> None:
        self.caching = caching
        self._small = _Pool("small", _SMALL_MIN_SPLIT)
        self._large = _Pool("large", _LARGE_MIN_SPLIT)
        self._segments: dict[int, _Segment] = {}  # address -> segment
        self._lock = threading.Lock()
        self._ident = threading.get_ident  # bound here: usable while modules are torn down
        self._owner: int | None = None  # thread id holding the lock
        self._pending: list[_Span] = []  # frees deferred by a re-entrant garbage collection
        self._allocated = self._requested = self._reserved = 0
        self._peak_allocated = self._peak_reserved = 0
        self._active = self._num_allocs = self._num_frees = 0
        self._hits = self._misses = self._splits = self._merges = 0
        self._segment_allocs = self._segment_frees = 0
        #: Called before a failed segment allocation is retried: gives back the blocks a
        #: cache in front of this allocator keeps (they can then merge and be released).
        self.on_memory_pressure = None

    def allocate(self, nbytes: int) -> Block:
        """Return a block of at least ``nbytes`` bytes. **Local**, thread-safe.

        Parameters
        ----------
        nbytes : int
            Requested size in bytes (0 is allowed).

        Returns
        -------
        Block
            The handle; the memory returns to the pool when it dies.
        """
        size = max(-(-nbytes // _ROUND) * _ROUND, _ROUND)
        self._acquire()
        try:
            span = self._take(size)
            span.allocated = True
            span.requested = nbytes
            self._num_allocs += 1
            self._active += 1
            self._requested += nbytes
            self._allocated += span.size
            self._peak_allocated = max(self._peak_allocated, self._allocated)
            return Block(self, span, nbytes)
        finally:
            self._unlock()

    # Every critical section runs between _acquire and _unlock, which record the holding
    # thread (see _release) and apply the frees deferred while it was held.
    def _acquire(self) -> None:
        self._lock.acquire()
        self._owner = self._ident()

    def _unlock(self) -> None:
        while self._pending:
            self._free(self._pending.pop())
        self._owner = None
        self._lock.release()

    def _take(self, size: int) -> _Span:
        if not self.caching:
            self._misses += 1
            return self._new_segment(size, None).first
        pool = self._small if size <= _SMALL_LIMIT else self._large
        span = pool.take(size)
        if span is None:
            self._misses += 1
            span = self._new_segment(pool.segment_size(size), pool).first
        else:
            self._hits += 1
        rest = span.size - size
        if rest >= pool.min_split:
            tail = _Span(span.segment, span.address + size, rest)
            tail.prev = span
            tail.next = span.next
            if span.next is not None:
                span.next.prev = tail
            span.next = tail
            span.size = size
            pool.put(tail)
            self._splits += 1
        return span

    def _new_segment(self, size: int, pool: _Pool | None) -> _Segment:
        try:
            segment = _Segment(size, pool)
        except MemoryError:
            if self.on_memory_pressure is not None:
                self.on_memory_pressure()
                while self._pending:  # the frees that giving the blocks back deferred
                    self._free(self._pending.pop())
            self._release_free_segments()
            segment = _Segment(size, pool)
        self._segments[segment.address] = segment
        self._segment_allocs += 1
        self._reserved += size
        self._peak_reserved = max(self._peak_reserved, self._reserved)
        return segment

    def _drop_segment(self, segment: _Segment) -> None:
        segment.first = None  # break the segment <-> span cycle: the memory goes now, not at gc
        if segment.shared is not None:
            segment.shared.close()
        del self._segments[segment.address]
        self._segment_frees += 1
        self._reserved -= segment.size

    def _release(self, span: _Span) -> None:
        """Free ``span`` (called by a dying :class:`Block`, from any thread)."""
        if self._owner == self._ident():
            # A garbage collection inside our own critical section: the holder frees it.
            self._pending.append(span)
            return
        self._acquire()
        try:
            self._free(span)
        finally:
            self._unlock()

    def _free(self, span: _Span) -> None:
        span.allocated = False
        self._num_frees += 1
        self._active -= 1
        self._requested -= span.requested
        self._allocated -= span.size
        segment = span.segment
        pool = segment.pool
        if pool is None:  # nocache: the segment held exactly this span
            self._drop_segment(segment)
            return
        nxt = span.next
        if nxt is not None and not nxt.allocated:
            pool.remove(nxt)
            self._absorb(span, nxt)
        prv = span.prev
        if prv is not None and not prv.allocated:
            pool.remove(prv)
            self._absorb(prv, span)
            span = prv
        pool.put(span)

    def _absorb(self, low: _Span, high: _Span) -> None:
        low.size += high.size
        low.next = high.next
        if high.next is not None:
            high.next.prev = low
        self._merges += 1

    def _release_free_segments(self) -> None:
        for segment in list(self._segments.values()):
            first = segment.first
            if not first.allocated and first.size == segment.size:
                segment.pool.remove(first)
                self._drop_segment(segment)

    def empty_cache(self) -> None:
        """Release every segment whose memory is entirely free. **Local**."""
        self._acquire()
        try:
            self._release_free_segments()
        finally:
            self._unlock()

    def adjust(self, delta: int, reserved: int | None = None) -> None:
        """Count ``delta`` bytes (negative: given back) of memory held outside the pool
        (a :class:`ReleasableBuffer`'s) in the allocated, requested and reserved figures
        (``reserved``: a different change of the reserved figure, for pages that a
        pooled buffer takes from or leaves in its page pool). **Local**, thread-safe."""
        self._acquire()
        try:
            self._allocated += delta
            self._requested += delta
            self._reserved += delta if reserved is None else reserved
            self._peak_allocated = max(self._peak_allocated, self._allocated)
            self._peak_reserved = max(self._peak_reserved, self._reserved)
        finally:
            self._unlock()

    def reset_peak_stats(self) -> None:
        """Set the peak statistics to the current values. **Local**."""
        self._acquire()
        try:
            self._peak_allocated = self._allocated
            self._peak_reserved = self._reserved
        finally:
            self._unlock()

    def stats(self) -> dict[str, int]:
        """Counters of this allocator as a flat dict (see :func:`memory_stats`). **Local**."""
        self._acquire()
        try:
            free_blocks = sum(
                len(spans) for pool in (self._small, self._large) for spans in pool.bins.values()
            )
            return {
                "allocated_bytes": self._allocated,
                "requested_bytes": self._requested,
                "reserved_bytes": self._reserved,
                "peak_allocated_bytes": self._peak_allocated,
                "peak_reserved_bytes": self._peak_reserved,
                "active_blocks": self._active,
                "free_blocks": free_blocks,
                "num_allocs": self._num_allocs,
                "num_frees": self._num_frees,
                "cache_hits": self._hits,
                "cache_misses": self._misses,
                "num_splits": self._splits,
                "num_merges": self._merges,
                "num_segments": len(self._segments),
                "num_segment_allocs": self._segment_allocs,
                "num_segment_frees": self._segment_frees,
            }
        finally:
            self._unlock()

    def snapshot(self) -> list[dict[str, Any]]:
        """Segments and their blocks, by address (see :func:`memory_snapshot`). **Local**."""
        self._acquire()
        try:
            out = []
            for address in sorted(self._segments):
                segment = self._segments[address]
                blocks = []
                span = segment.first
                while span is not None:
                    blocks.append(
                        {
                            "address": span.address,
                            "size": span.size,
                            "requested_size": span.requested if span.allocated else 0,
                            "state": "allocated" if span.allocated else "free",
                        }
                    )
                    span = span.next
                pool = "nocache" if segment.pool is None else segment.pool.name
                out.append(
                    {
                        "address": address,
                        "size": segment.size,
                        "pool": pool,
                        "shared": segment.shared is not None,
                        "blocks": blocks,
                    }
                )
            return out
        finally:
            self._unlock()


_CPU = CPUAllocator(caching=_env_caching())
#: The compiled block cache in front of ``_CPU`` (None: the Python pool serves directly).
_CACHE = _fp.pool.BlockCache(_CPU.allocate) if _fp.ENABLED and _CPU.caching else None
if _CACHE is not None:
    _CPU.on_memory_pressure = _CACHE.drain


def _cuda_index(device: Any) -> int | None:
    """None for 'cpu', else the CUDA device index (-1: current device); raises otherwise."""
    name = str(device)
    if name == "cpu":
        return None
    if name == "cuda":
        return -1
    if name.startswith("cuda:") and name[5:].isdigit():
        return int(name[5:])
    raise ArgumentError(f"unknown device {device!r}: expected 'cpu', 'cuda' or 'cuda:N'")


def _cupy() -> Any:
    try:
        import cupy  # optional dependency ([gpu] extra): imported only when a GPU is asked for
    except ImportError as exc:
        raise ImportError("device 'cuda' needs cupy: pip install 'dtensor[gpu]'") from exc
    return cupy


_cuda_peak = 0  # peak of cupy's used_bytes, as far as it was observed


def empty_array(shape: Any, dtype: Any, device: Any = "cpu") -> Any:
    """Return an uninitialised C-contiguous array from the caching allocator. **Local**.

    Parameters
    ----------
    shape : int or sequence of int
        Shape of the array.
    dtype : dtype-like
        Element type.
    device : str
        ``"cpu"`` (numpy, pooled) or ``"cuda"`` / ``"cuda:N"`` (``cupy.empty``).

    Returns
    -------
    numpy.ndarray or cupy.ndarray
        On CPU, an array whose base chain ends at a :class:`Block` of the default
        allocator, or a plain ``numpy.empty`` array for requests smaller than
        :data:`POOL_MIN_BYTES` and for object dtypes.
    """
    if device != "cpu":
        index = _cuda_index(device)
        if index is not None:
            return _cuda_empty(shape, dtype, index)
    if _CACHE is not None:
        out = _CACHE.empty(shape, dtype, POOL_MIN_BYTES)
        if out is not None:
            return out
    dtype = np.dtype(dtype)
    try:
        shape = tuple(map(operator.index, shape))
    except TypeError:
        shape = (operator.index(shape),)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < POOL_MIN_BYTES or dtype.hasobject or min(shape, default=0) < 0:
        return np.empty(shape, dtype)  # numpy raises for negative dimensions
    return _pool_array(nbytes, shape, dtype)


#: The most bytes one array may span (numpy's limit: the largest signed size).
_MAX_ARRAY_BYTES = np.iinfo(np.intp).max


@contextmanager
def allocating(op: str, shape: tuple[int, ...], dtype: Any) -> Iterator[None]:
    """Around the allocation of a tensor of ``shape`` and ``dtype`` by ``op``: a size beyond
    the address space, and a MemoryError of the allocation, raise :class:`AllocationError`
    naming the op, the shape, the dtype and the bytes. **Local**."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize

    def error(why: str) -> AllocationError:
        return AllocationError(
            f"{op}: cannot allocate a tensor of shape {tuple(shape)} and dtype {dtype} "
            f"({nbytes} bytes, {nbytes / 2**30:.4g} GiB): {why}")

    if nbytes > _MAX_ARRAY_BYTES:
        raise error(f"more than the largest array of this platform ({_MAX_ARRAY_BYTES} bytes)")
    try:
        yield
    except MemoryError as e:
        if isinstance(e, AllocationError):
            raise
        raise error(str(e) or "out of memory") from e


def _pool_array(nbytes: int, shape: tuple, dtype: np.dtype) -> np.ndarray:
    """An array of ``shape`` and ``dtype`` over a new block of the Python pool."""
    return np.asarray(_CPU.allocate(nbytes)).view(dtype).reshape(shape)


def pooled_empty(shape: tuple, dtype: np.dtype) -> Any:
    """A callable that returns a new pooled host array of ``shape`` and ``dtype`` at each
    call (as :func:`empty_array` does for a request of at least :data:`POOL_MIN_BYTES`).
    **Local**. For callers that allocate one shape repeatedly (the dispatcher's compiled
    front): the call then runs without Python code when the compiled cache is enabled."""
    dtype = np.dtype(dtype)
    if _CACHE is not None:
        return partial(_CACHE.empty, tuple(shape), dtype, 0)
    nbytes = math.prod(shape) * dtype.itemsize
    return partial(_pool_array, nbytes, tuple(shape), dtype)


def _cuda_empty(shape: Any, dtype: Any, index: int) -> Any:
    global _cuda_peak
    cp = _cupy()
    with cp.cuda.Device(None if index < 0 else index):
        out = cp.empty(shape, dtype)
    _cuda_peak = max(_cuda_peak, cp.get_default_memory_pool().used_bytes())
    return out


class _PagePool:
    """The pages of released pooled :class:`ReleasableBuffer` s, per page-rounded size:
    each a ``memfd`` whose pages stay in memory while it waits, mapped into the next buffer
    of its size that commits (at that buffer's own address), so that buffer's first writes
    find their pages instead of faulting fresh zeroed ones in. **Local**, thread-safe.

    A size's waiting pages go back to the system when the last pooled buffer of that size
    dies, and at :func:`empty_cache`. They count as reserved (not allocated) memory."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.free: dict[int, list[int]] = {}  # page-rounded size -> waiting memfds
        self.users: dict[int, int] = {}  # page-rounded size -> live pooled buffers
        # id -> committed pooled buffer, for a fork (weak: a dropped buffer releases)
        self.live: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self.libc: Any = None
        if sys.platform.startswith("linux") and hasattr(os, "memfd_create"):
            try:
                import ctypes  # lazy: only where a memfd can be mapped at a fixed address

                libc = ctypes.CDLL(None, use_errno=True)
                libc.mmap.restype = ctypes.c_void_p
                libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                      ctypes.c_int, ctypes.c_int, ctypes.c_long]
                libc.mremap.restype = ctypes.c_void_p
                libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                                        ctypes.c_int, ctypes.c_void_p]
                self.libc = libc
                self.ctypes = ctypes
            except (OSError, AttributeError):
                self.libc = None

    def _map(self, address: int, length: int, flags: int, fd: int) -> None:
        got = self.libc.mmap(address, length, mmap.PROT_READ | mmap.PROT_WRITE,
                             flags | _MAP_FIXED, fd, 0)
        if got != address:
            err = self.ctypes.get_errno()
            raise OSError(err, f"ReleasableBuffer: cannot map {length} bytes at {address:#x}: "
                               f"{os.strerror(err)}")

    def attach(self, address: int, length: int) -> tuple[int, bool]:
        """Map pages of ``length`` bytes at ``address`` (a waiting memfd's, else a new
        one's); returns (the memfd, whether it is new)."""
        with self.lock:
            waiting = self.free.get(length)
            fd = waiting.pop() if waiting else -1
        fresh = fd < 0
        if fresh:
            fd = os.memfd_create("dtensor-gather", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, length)
            except BaseException:
                os.close(fd)
                raise
        try:
            self._map(address, length, mmap.MAP_SHARED | _MAP_POPULATE, fd)
        except BaseException:
            if fresh:
                os.close(fd)
            else:
                self.put(length, fd)
            raise
        return fd, fresh

    def detach(self, address: int, length: int, fd: int) -> None:
        """Put fresh anonymous memory (reads give zeros, no pages) back at ``address`` and
        let the memfd wait for the next buffer of its size."""
        self._map(address, length, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1)
        self.put(length, fd)

    def put(self, length: int, fd: int) -> None:
        with self.lock:
            if self.users.get(length, 0) > 0:
                self.free.setdefault(length, []).append(fd)
                return
        os.close(fd)
        _adjust(0, reserved=-length)

    def use(self, length: int, delta: int) -> None:
        """Count a pooled buffer of ``length`` bytes made (+1) or gone (-1); the waiting
        pages of a size that no buffer uses any more go back."""
        with self.lock:
            n = self.users[length] = self.users.get(length, 0) + delta
            drop = self.free.pop(length, []) if n <= 0 else []
            if n <= 0:
                del self.users[length]
        self._close(length, drop)

    def empty(self) -> None:
        """Give every waiting memfd's pages back. **Local**."""
        with self.lock:
            drop, self.free = self.free, {}
        for length, fds in drop.items():
            self._close(length, fds)

    def waiting_bytes(self) -> int:
        with self.lock:
            return sum(length * len(fds) for length, fds in self.free.items())

    @staticmethod
    def _close(length: int, fds: list[int]) -> None:
        for fd in fds:
            os.close(fd)
        if fds:
            _adjust(0, reserved=-length * len(fds))

    def after_fork_in_child(self) -> None:
        """A forked process gets private copies of the committed buffers (their memfds are
        shared with the parent) and no waiting pages."""
        self.lock = threading.Lock()
        free, self.free = self.free, {}
        for fds in free.values():
            for fd in fds:
                os.close(fd)
        if self.libc is None:
            return
        ctypes = self.ctypes
        failed = ctypes.c_void_p(-1).value
        for buf in list(self.live.values()):
            length, address = buf._length, buf._address
            tmp = self.libc.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE,
                                 mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
            if tmp in (None, failed):
                raise OSError(ctypes.get_errno(), "ReleasableBuffer: cannot copy after fork")
            ctypes.memmove(tmp, address, length)
            moved = self.libc.mremap(tmp, length, length, 3, address)  # MAYMOVE | FIXED
            if moved != address:
                raise OSError(ctypes.get_errno(), "ReleasableBuffer: cannot remap after fork")
            os.close(buf._fd)
            buf._fd = -2  # private memory now: released by madvise, not pooled
        self.live.clear()


_MAP_FIXED = 0x10
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)
_PAGES = _PagePool()
if _PAGES.libc is not None:
    os.register_at_fork(after_in_child=_PAGES.after_fork_in_child)


class ReleasableBuffer:
    """A host buffer whose memory can be given back and taken again at the same address:
    what PyTorch does with ``storage.resize_(0)`` and ``resize_(n)``, so that every view of
    the buffer (and every tensor a backward node saved) stays valid while the memory is
    away. **Local**.

    The buffer is a private anonymous mapping: :meth:`release` drops its pages
    (``madvise(MADV_DONTNEED)``; reading it then gives zeros), the next write brings fresh
    pages. :meth:`memory_stats` counts its bytes while it is committed. Used for the
    unsharded parameters of ``fully_shard``; on a GPU (cupy) the memory stays allocated.

    With ``pooled=True`` (Linux with ``memfd``; elsewhere it is ignored) the pages do not go
    back to the system at :meth:`release`: they wait in a pool per page-rounded size, and
    the next pooled buffer of that size to :meth:`commit` gets them mapped at its own
    address (``mmap(MAP_FIXED | MAP_POPULATE)`` of the pool's memfd, one system call
    instead of a page fault per 4 KiB page, and no zeroing). ``release`` maps fresh
    anonymous memory back (reads give zeros, as without the pool). Buffers of one size that
    take turns (the layers of a model under ``fully_shard``) then hold no more pages than
    the most of them committed at once. After ``commit`` a pooled buffer's contents are
    undefined (an earlier buffer's): write all of it before reading. Waiting pages count
    in ``reserved_bytes``, not ``allocated_bytes``; they go back to the system when the
    last pooled buffer of their size dies, and at :func:`empty_cache`.

    Attributes
    ----------
    array : ndarray
        The whole buffer, ``nbytes`` uint8 (take typed views of it).
    committed : bool
        Whether the memory is counted as held (after :meth:`commit`, until :meth:`release`).
    pooled : bool
        Whether its pages come from (and go back to) the pool.
    """

    __slots__ = ("__weakref__", "_address", "_fd", "_length", "_map", "array", "committed",
                 "nbytes", "pooled")

    def __init__(self, nbytes: int, pooled: bool = False) -> None:
        self.nbytes = int(nbytes)
        self._map = mmap.mmap(-1, max(self.nbytes, 1),
                              flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.array = np.frombuffer(self._map, np.uint8, self.nbytes)
        self.committed = False
        self.pooled = bool(pooled) and self.nbytes > 0 and _PAGES.libc is not None
        self._fd = -1  # the pool's memfd mapped here while committed
        self._length = -(-max(self.nbytes, 1) // mmap.PAGESIZE) * mmap.PAGESIZE
        self._address = self.array.ctypes.data if self.nbytes else 0
        if self.pooled:
            _PAGES.use(self._length, +1)

    def commit(self) -> None:
        """Count the buffer's memory as held (before writing it); a pooled buffer maps its
        pages here. **Local**."""
        if self.committed:
            return
        if self.pooled and self._fd == -1:
            self._fd, fresh = _PAGES.attach(self._address, self._length)
            _PAGES.live[id(self)] = self
            self.committed = True
            _adjust(self.nbytes, reserved=self._length if fresh else 0)
            return
        self.committed = True
        _adjust(self.nbytes)

    def release(self) -> None:
        """Give the buffer's pages back (to the system, or to the pool when pooled); its
        contents become zeros. **Local**."""
        if not self.committed:
            return
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            _PAGES.live.pop(id(self), None)
            _PAGES.detach(self._address, self._length, fd)
            self.committed = False
            _adjust(-self.nbytes, reserved=0)
            return
        if self.nbytes:
            self._map.madvise(mmap.MADV_DONTNEED)
        self.committed = False
        _adjust(-self.nbytes)

    def __del__(self) -> None:
        if getattr(self, "_fd", -1) >= 0:
            try:  # views that outlive the buffer must not see the next user's pages
                self.release()
            except OSError:
                pass
        elif getattr(self, "committed", False):
            _adjust(-self.nbytes)
        if getattr(self, "pooled", False):
            _PAGES.use(self._length, -1)


def _adjust(delta: int, reserved: int | None = None) -> None:
    _CPU.adjust(delta, reserved)
    if _CACHE is not None and delta:
        _CACHE.adjust(delta)


def memory_stats(device: Any = "cpu") -> dict[str, int]:
    """Allocator statistics of ``device`` as a flat dict. **Local**.

    Parameters
    ----------
    device : str
        ``"cpu"`` (the caching allocator) or ``"cuda"`` (cupy's default memory pool).

    Returns
    -------
    dict
        ``allocated_bytes`` (live blocks, rounded sizes), ``requested_bytes`` (live
        blocks, as asked), ``reserved_bytes`` (all segments), ``peak_allocated_bytes``,
        ``peak_reserved_bytes``, ``active_blocks``, ``free_blocks`` (cached),
        ``num_allocs``, ``num_frees``, ``cache_hits``, ``cache_misses`` (a new segment was
        needed), ``num_splits``, ``num_merges``, ``num_segments``, ``num_segment_allocs``,
        ``num_segment_frees``. Pool-bypassing small requests (below
        :data:`POOL_MIN_BYTES`) are not counted.

        On CUDA: ``allocated_bytes`` is cupy's ``used_bytes``, ``reserved_bytes`` its
        ``total_bytes``, ``free_blocks`` its ``n_free_blocks``, and the peaks are the
        largest values seen by dtensor's allocations and stats calls; counters cupy does
        not keep are 0.
    """
    if _cuda_index(device) is None:
        stats = _CPU.stats()
        if _CACHE is not None:
            # every pooled array comes through the cache: its counters are the arrays',
            # the pool's are the blocks' (a block waiting in the cache is allocated there)
            c = _CACHE.counters()
            for key in (
                "allocated_bytes",
                "requested_bytes",
                "peak_allocated_bytes",
                "active_blocks",
                "num_allocs",
                "num_frees",
            ):
                stats[key] = c[key]
            stats["free_blocks"] += c["cached_blocks"]
            stats["cache_hits"] += c["cache_hits"]
        return stats
    global _cuda_peak
    pool = _cupy().get_default_memory_pool()
    used, total = pool.used_bytes(), pool.total_bytes()
    _cuda_peak = max(_cuda_peak, used)
    stats = dict.fromkeys(_CPU.stats(), 0)
    stats.update(
        allocated_bytes=used,
        requested_bytes=used,
        reserved_bytes=total,
        peak_allocated_bytes=_cuda_peak,
        peak_reserved_bytes=max(total, _cuda_peak),
        free_blocks=pool.n_free_blocks(),
    )
    return stats


def memory_snapshot(device: Any = "cpu") -> list[dict[str, Any]]:
    """The allocator's segments and blocks, to diagnose fragmentation. **Local**.

    Parameters
    ----------
    device : str
        ``"cpu"`` or ``"cuda"``.

    Returns
    -------
    list of dict
        One dict per segment, by address: ``address``, ``size``, ``pool`` (``"small"``,
        ``"large"`` or ``"nocache"``), ``shared`` (whether the segment is node-shared memory
        that peer ranks can read, see :mod:`redistribute.shm`) and ``blocks``, a list of
        dicts with ``address``, ``size``, ``requested_size`` and ``state``
        (``"allocated"`` or ``"free"``).
        On CUDA the list is empty: cupy's pool does not expose its blocks.
    """
    if _cuda_index(device) is None:
        snapshot = _CPU.snapshot()
        waiting = _CACHE.cached_addresses() if _CACHE is not None else ()
        for segment in snapshot:
            for block in segment["blocks"]:
                if block["address"] in waiting:  # kept by the compiled cache: free
                    block.update(state="free", requested_size=0)
        return snapshot
    return []


def empty_cache(device: Any = "cpu") -> None:
    """Release cached memory that no live block uses. **Local**.

    On CPU, every segment whose memory is entirely free goes back to the system, and the
    mappings of peer ranks' shared segments that this rank keeps are dropped (each keeps
    the peer's memory alive), and so are the pages that pooled
    :class:`ReleasableBuffer` s left waiting; on CUDA, cupy's ``free_all_blocks`` is called.
    """
    if _cuda_index(device) is None:
        if _CACHE is not None:
            _CACHE.drain()
        _CPU.empty_cache()
        _PAGES.empty()  # pooled ReleasableBuffers' waiting pages
        _shm.clear_peer_maps()  # mappings of peers' segments keep those alive
    else:
        _cupy().get_default_memory_pool().free_all_blocks()


def reset_peak_memory_stats(device: Any = "cpu") -> None:
    """Set ``peak_allocated_bytes`` and ``peak_reserved_bytes`` to the current values. **Local**."""
    global _cuda_peak
    if _cuda_index(device) is None:
        _CPU.reset_peak_stats()
        if _CACHE is not None:
            _CACHE.reset_peak()
    else:
        _cuda_peak = _cupy().get_default_memory_pool().used_bytes()
