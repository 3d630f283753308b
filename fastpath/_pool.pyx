# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# cython: initializedcheck=False, nonecheck=False, binding=True, embedsignature=True
"""Compiled front of dtensor's caching host allocator.

This module owns :class:`BlockCache`: a per-size cache of whole blocks in front of a
backing allocator (dtensor's Python ``CPUAllocator``), served from compiled code. A
pooled array costs the backing allocator's Python bookkeeping (block handle, free-list
search, split and merge: several microseconds) only when the cache has no block of its
rounded size; otherwise an allocation pops a cached block and wraps it in a new array, and
the array's death pushes the block back, both without running Python code. The block
keeps its memory (node-shared segments included, so a peer rank's read of it goes on
working) for the whole time the cache holds it.

The arrays handed out are C-contiguous, 64-byte aligned (the backing blocks are); their
``base`` is a :class:`Lease`, whose death returns the block. The cache keeps at most
``max_per_size`` blocks of one size and ``max_bytes`` in all; a block freed beyond that
goes back to the backing allocator (where it can merge with its neighbours).
:meth:`BlockCache.drain` returns every cached block (``empty_cache`` and a failed segment
allocation call it).

Counters (:meth:`BlockCache.counters`) are those of the arrays handed out: the backing
allocator sees the cache's blocks as allocated whether an array uses them or they wait
in the cache, so the caller reports allocated/requested/active/peak figures from here.

This module imports nothing of dtensor. Every function here is **Local**; the cache is
safe to use from several threads (it runs under the GIL and calls no Python code between
reading and updating its state).
"""

cimport cython
cimport numpy as cnp
from cpython.list cimport PyList_GET_SIZE
from cpython.number cimport PyIndex_Check
from cpython.object cimport PyTypeObject
from cpython.ref cimport Py_INCREF

import numpy as np

cnp.import_array()

cdef extern from "numpy/arrayobject.h":
    # steals a reference to ``descr``
    object PyArray_NewFromDescr(PyTypeObject* subtype, cnp.dtype descr, int nd,
                                cnp.npy_intp* dims, cnp.npy_intp* strides, void* data,
                                int flags, object obj)
    bint PyDataType_REFCHK(cnp.dtype descr)

__all__ = ["BlockCache", "Lease"]

cdef Py_ssize_t ROUND = 512            # block sizes are multiples of this (the backing pool's)
cdef object _dtype = np.dtype
cdef PyTypeObject* _ARRAY = <PyTypeObject*>cnp.ndarray


@cython.final
@cython.freelist(64)
cdef class _Held:
    """One block the cache holds (lent to an array or waiting): the backing allocator's
    handle and its address and rounded size."""

    cdef object block
    cdef Py_ssize_t address
    cdef Py_ssize_t size


@cython.final
@cython.freelist(64)
cdef class Lease:
    """The memory owner of one array from a :class:`BlockCache`: its death returns the
    block to the cache."""

    cdef BlockCache cache
    cdef _Held held
    cdef Py_ssize_t _nbytes

    @property
    def block(self):
        """The backing allocator's handle of the block."""
        return self.held.block

    @property
    def address(self):
        """Address of the block's first byte."""
        return self.held.address

    @property
    def nbytes(self):
        """The bytes the array asked for."""
        return self._nbytes

    def __dealloc__(self):
        if self.cache is not None:
            self.cache._put(self.held, self._nbytes)


@cython.final
cdef class BlockCache:
    """Per-size cache of backing blocks that serves ``empty`` from compiled code.

    Parameters
    ----------
    allocate : callable
        ``allocate(nbytes)`` -> a block handle with an ``address`` attribute (the address
        of ``nbytes`` writable bytes, 64-byte aligned), whose memory returns to the backing
        allocator when the handle dies.
    max_per_size : int
        Blocks of one size the cache keeps at most.
    max_bytes : int
        Bytes the cache keeps at most.
    """

    cdef object _allocate
    cdef dict _bins                      # rounded size -> list of waiting _Held
    cdef readonly Py_ssize_t max_per_size
    cdef readonly Py_ssize_t max_bytes
    cdef readonly Py_ssize_t cached_bytes
    cdef readonly Py_ssize_t cached_blocks
    # counters of the arrays handed out
    cdef Py_ssize_t _allocated, _requested, _peak, _active
    cdef Py_ssize_t _allocs, _frees, _hits, _returned

    def __cinit__(self, allocate, Py_ssize_t max_per_size=16, Py_ssize_t max_bytes=1 << 30):
        self._allocate = allocate
        self._bins = {}
        self.max_per_size = max_per_size
        self.max_bytes = max_bytes

    cdef inline void _put(self, _Held held, Py_ssize_t nbytes):
        """An array's block comes back (from :class:`Lease`'s deallocation)."""
        cdef Py_ssize_t size = held.size
        self._allocated -= size
        self._requested -= nbytes
        self._active -= 1
        self._frees += 1
        cdef object bin = self._bins.get(size)
        if bin is None:
            bin = []
            self._bins[size] = bin
        if (PyList_GET_SIZE(bin) < self.max_per_size
                and self.cached_bytes + size <= self.max_bytes):
            (<list>bin).append(held)
            self.cached_bytes += size
            self.cached_blocks += 1
        else:  # beyond the limits: back to the backing allocator (the handle dies here)
            self._returned += 1

    def empty(self, shape, dtype, Py_ssize_t pool_min):
        """An uninitialised C-contiguous array of ``shape`` and ``dtype``.

        Requests below ``pool_min`` bytes get ``numpy.empty`` (numpy's small-block cache is
        faster); larger ones a pooled block. Returns None for what the caller must serve
        itself: object dtypes and negative dimensions (numpy's error then comes from the
        caller's ``numpy.empty``).
        """
        cdef cnp.dtype descr
        if isinstance(dtype, cnp.dtype):
            descr = <cnp.dtype>dtype
        else:
            descr = <cnp.dtype>_dtype(dtype)
        if PyDataType_REFCHK(descr):
            return None
        cdef tuple dims_t
        if type(shape) is tuple:
            dims_t = <tuple>shape
        elif PyIndex_Check(shape):
            dims_t = (shape,)
        else:
            dims_t = tuple(shape)
        cdef int nd = len(dims_t), i
        if nd > cnp.NPY_MAXDIMS:
            return None
        cdef cnp.npy_intp dims[cnp.NPY_MAXDIMS]
        cdef Py_ssize_t count = 1, d
        for i in range(nd):
            d = dims_t[i]  # an index: a float raises TypeError
            if d < 0:
                return None
            dims[i] = d
            if d and count > (<Py_ssize_t>1 << 62) // d:
                return None  # numpy's error ("array is too big") from the caller
            count *= d
        cdef Py_ssize_t nbytes = count * cnp.PyDataType_ELSIZE(descr)
        if nbytes < pool_min:
            Py_INCREF(descr)
            return PyArray_NewFromDescr(_ARRAY, descr, nd, dims, NULL, NULL, 0, None)
        cdef Py_ssize_t size = ((nbytes + ROUND - 1) // ROUND) * ROUND
        if size == 0:
            size = ROUND
        cdef object bin = self._bins.get(size)
        cdef _Held held
        if bin is not None and PyList_GET_SIZE(bin):
            held = <_Held>(<list>bin).pop()
            self.cached_bytes -= size
            self.cached_blocks -= 1
            self._hits += 1
        else:
            block = self._allocate(size)
            held = _Held.__new__(_Held)
            held.block = block
            held.address = block.address
            held.size = size
        cdef Lease lease = Lease.__new__(Lease)
        lease.held = held
        lease._nbytes = nbytes
        Py_INCREF(descr)
        cdef cnp.ndarray arr = PyArray_NewFromDescr(
            _ARRAY, descr, nd, dims, NULL, <void*>held.address, cnp.NPY_ARRAY_CARRAY, None)
        lease.cache = self  # from here the lease returns the block when it dies
        self._allocs += 1
        self._active += 1
        self._allocated += size
        self._requested += nbytes
        if self._allocated > self._peak:
            self._peak = self._allocated
        cnp.set_array_base(arr, lease)
        return arr

    def drain(self):
        """Return every cached block to the backing allocator."""
        cdef list bins = list(self._bins.values())
        self._bins = {}
        self._returned += self.cached_blocks
        self.cached_bytes = 0
        self.cached_blocks = 0
        del bins  # the handles die here: their memory goes back

    def cached_addresses(self):
        """Addresses of the blocks waiting in the cache (a set)."""
        return {(<_Held>h).address for bin in self._bins.values() for h in bin}

    def counters(self):
        """A dict: ``allocated_bytes`` and ``requested_bytes`` of the live arrays,
        ``peak_allocated_bytes``, ``active_blocks``, ``num_allocs``, ``num_frees``,
        ``cache_hits`` (allocations served from the cache), ``returned_blocks`` (blocks
        given back to the backing allocator), ``cached_bytes``, ``cached_blocks``."""
        return {
            "allocated_bytes": self._allocated,
            "requested_bytes": self._requested,
            "peak_allocated_bytes": self._peak,
            "active_blocks": self._active,
            "num_allocs": self._allocs,
            "num_frees": self._frees,
            "cache_hits": self._hits,
            "returned_blocks": self._returned,
            "cached_bytes": self.cached_bytes,
            "cached_blocks": self.cached_blocks,
        }

    def reset_peak(self):
        """Set the peak to the current allocated bytes."""
        self._peak = self._allocated

    def adjust(self, Py_ssize_t delta):
        """Count ``delta`` bytes (negative: given back) of memory held outside the pool in
        the allocated and requested figures (the allocator's releasable buffers)."""
        self._allocated += delta
        self._requested += delta
        if self._allocated > self._peak:
            self._peak = self._allocated
