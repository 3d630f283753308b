# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# cython: initializedcheck=False, nonecheck=False, binding=True, embedsignature=True
"""The compiled redistribute executor: one-step plans run from compiled code.

This module owns :class:`RedistEntry` (one redistribute as compiled code runs it, made from
a form of ``redistribute.execute.compiled_form``: a small all-gather, an all-reduce, a
reduce-scatter, an all-to-all, a local chunk) and its run on a local array: the MPI call
the Python executor issues for it, the output from the allocator, the executor's packs and
unpacks as byte copies (``_copy_blocks``). With persistent all-gathers on, a gather runs as
the start of the communicator's persistent request (the shard copied into its send buffer,
its receive buffer copied or unpacked into the output, as the Python path's
``Comm.allgather_persistent``), through the MPI library's ``MPI_Start``/``MPI_Wait`` when
their addresses are known.

Which hooks are on comes from the one hook state of ``redistribute.comm`` (``HOOKS``),
plugged in with ``MPI.BYTE`` and the MPI library's C functions by
``redistribute.execute.compiled`` (:func:`install`); while an observer or a debug check is
on (``HOOKS.traced``), callers leave every call to the Python executor (:func:`traced`).
It counts the runs by kind (:func:`redistribute_kinds`).

The dispatch front (``fastpath._dispatch``) makes and runs the entries (``cimport``: see
``_redist.pxd``) for ``DTensor.redistribute`` and for an op's input moves. This module
imports nothing of dtensor nor of redistribute. Every function here is **Local** unless it
runs a step that communicates (then **Collective**).
"""

cimport cython
cimport numpy as cnp
from numpy import divide as _np_divide
from cpython.pycapsule cimport PyCapsule_GetName, PyCapsule_GetPointer
from cpython.tuple cimport PyTuple_GET_ITEM
from libc.stdint cimport int64_t, uintptr_t
from libc.string cimport memcpy

cnp.import_array()

__all__ = ["RedistEntry", "install", "redistribute_kinds"]

cdef object _hooks = None            # redistribute.comm.HOOKS (active, traced, persistent)
cdef object _mpi_byte = None         # MPI.BYTE

cdef enum:
    REDIST_PY = 0                    # the Python method runs
    REDIST_GATHER = 1                # Allgather(v) into the output, or staged and unpacked
    REDIST_ALL_REDUCE = 2            # Allreduce into a new output
    REDIST_REDUCE_SCATTER = 3        # Reduce_scatter(_block) of the input or of a pack
    REDIST_ALL_TO_ALL = 4            # own block copied, Alltoallw of bytes, unpacked
    REDIST_LOCAL = 5                 # the input or a view of it (no communication)

cdef dict _REDIST_KINDS = {"gather": REDIST_GATHER, "all_reduce": REDIST_ALL_REDUCE,
                           "reduce_scatter": REDIST_REDUCE_SCATTER,
                           "all_to_all": REDIST_ALL_TO_ALL, "local": REDIST_LOCAL}

cdef unsigned long long _kind_runs[6]   # runs by kind since the last reset_counts


cdef void _copy_blocks(const char* src, char* dst, object blocks) noexcept:
    """Run the copies of ``blocks`` (an int64 array of rows ``(source offset, runs, run
    bytes, stride, target offset, runs, run bytes, stride)``, both sides the same bytes in
    the same order) from buffer ``src`` to buffer ``dst``."""
    cdef const int64_t* b = <const int64_t*>cnp.PyArray_DATA(<cnp.ndarray>blocks)
    cdef Py_ssize_t n = cnp.PyArray_DIM(<cnp.ndarray>blocks, 0), i
    cdef const char* s
    cdef const char* sp
    cdef char* d
    cdef char* dp
    cdef int64_t left, s_left, d_left, c, s_run, d_run
    for i in range(n):
        s_run, d_run = b[2], b[6]
        left = b[1] * s_run
        s = src + b[0]
        d = dst + b[4]
        if s_run == d_run:
            while left > 0:
                memcpy(d, s, s_run)
                s += b[3]
                d += b[7]
                left -= s_run
        else:
            sp, dp, s_left, d_left = s, d, s_run, d_run
            while left > 0:
                c = s_left if s_left < d_left else d_left
                memcpy(dp, sp, c)
                left -= c
                s_left -= c
                d_left -= c
                sp += c
                dp += c
                if s_left == 0:
                    s += b[3]
                    sp, s_left = s, s_run
                if d_left == 0:
                    d += b[7]
                    dp, d_left = d, d_run
        b += 8


cdef bint traced() except -1:
    """Whether a communication observer or debug check is on (``HOOKS.traced``), or nothing
    is plugged in yet: the Python executor must then run every call, so that the hooks see
    its collectives."""
    return _hooks is None or (_hooks.active and _hooks.traced)


cdef inline char* _data(object a):
    return <char*>cnp.PyArray_DATA(<cnp.ndarray>a)


cdef inline object _bytes_buffer(Py_ssize_t n):
    """A fresh uint8 buffer of ``n`` bytes (staging, packing)."""
    cdef cnp.npy_intp dims[1]
    dims[0] = n
    return cnp.PyArray_EMPTY(1, dims, cnp.NPY_UINT8, 0)


# MPI_Start and MPI_Wait of the MPI library, and mpi4py's PyMPIRequest_Get (plugged in by
# install; NULL: the request's Python methods are called instead)
ctypedef int (*_mpi_start_t)(void* request) noexcept nogil
ctypedef int (*_mpi_wait_t)(void* request, void* status) noexcept nogil
ctypedef void* (*_request_get_t)(object request) except NULL
cdef _mpi_start_t _mpi_start = NULL
cdef _mpi_wait_t _mpi_wait = NULL
cdef _request_get_t _request_get = NULL
cdef object _mpi_exception = None    # MPI.Exception: raised with the error code of a call


def install(hooks, mpi_byte, c_api=None):
    """Plug in what the compiled executor needs: ``redistribute.comm.HOOKS`` (the one hook
    state), ``MPI.BYTE`` and ``redistribute.comm.request_c_api()`` (or None). **Local**."""
    global _hooks, _mpi_byte, _mpi_start, _mpi_wait, _request_get, _mpi_exception
    _hooks, _mpi_byte = hooks, mpi_byte
    _mpi_start, _mpi_wait, _request_get = NULL, NULL, NULL
    if c_api is not None:
        start, wait, get, _mpi_exception = c_api
        _mpi_start = <_mpi_start_t><uintptr_t>start
        _mpi_wait = <_mpi_wait_t><uintptr_t>wait
        _request_get = <_request_get_t>PyCapsule_GetPointer(get, PyCapsule_GetName(get))


@cython.final
cdef class RedistEntry:
    """One (source spec, target placements) pair as the compiled path runs it."""

    cdef int fill(self, str kind, tuple f) except -1:
        self.kind = _REDIST_KINDS[kind]
        if self.kind == REDIST_GATHER:
            self.mine, self.counts, self.displs, self.stage, self.unstage, self.key = f
        elif self.kind == REDIST_ALL_REDUCE:
            self.mpi_type, self.mpi_op, self.total, self.avg = f
        elif self.kind == REDIST_REDUCE_SCATTER:
            (self.mpi_type, self.mpi_op, self.mine, self.counts, self.total, self.pack,
             self.pack_len, self.avg) = f
        elif self.kind == REDIST_ALL_TO_ALL:
            (self.own, self.pack, self.pack_len, self.scounts, self.sdispls, self.stage,
             self.rcounts, self.rdispls, self.types, self.unstage) = f
        else:
            (self.index,) = f
        return 0


cdef RedistEntry new_entry(object spec, object placements, object form, long generation):
    """The entry of ``spec`` to ``placements`` made from ``form``, a tuple ``(targets, target
    spec, kind, Comm, out callable or None, out shape, dtype, fields)`` (dtensor's
    ``redistribute_form``, ``kind`` and ``fields`` as ``compiled_form`` gives them), or None:
    an entry that the Python method (or the executor, for a move) runs. ``generation`` is the
    caller's, for its own invalidation."""
    cdef RedistEntry e = RedistEntry.__new__(RedistEntry)
    e.spec = spec
    e.mesh = spec.mesh
    e.generation = generation
    if form is None:
        e.kind = REDIST_PY
        e.targets = tuple(placements)
    else:
        e.targets, e.dst, kind, e.comm, e.make, e.shape, dtype, fields = form
        e.mpi = e.comm.mpi
        e.size = e.comm.size
        e.typenum = dtype.num
        e.fill(kind, fields)
    return e


cdef object _persistent_request(RedistEntry e):
    """The entry's persistent all-gather (looked up in the communicator's pool when it has
    none or the one it had was freed), with its bound Start and Wait and its buffers."""
    # the pool changes only when a gather is made, so skipping the lookup while the
    # entry's gather is alive keeps it in step with the ranks that look it up
    p = e.pers
    if p is None or p.request is not e.pers_req:
        p = e.pers = e.comm.persistent_gather(e.key)
        req = e.pers_req = p.request
        e.pers_start, e.pers_wait = req.Start, req.Wait
        e.pers_handle = _request_get(req) if _request_get != NULL else NULL
        e.pers_send, e.pers_recv = _data(p.send), _data(p.recv)
        e.pers_recv_len = cnp.PyArray_NBYTES(<cnp.ndarray>p.recv)
    return p


cdef int _start_wait(RedistEntry e) except -1:
    """Start the entry's persistent request and wait for it: by the MPI library's functions
    (the GIL released, as mpi4py's calls release it), else by the request's methods."""
    cdef int rc
    cdef char status[64]             # an MPI_Status of any MPI library (MPICH's has 20 bytes)
    cdef void* handle = e.pers_handle
    if handle == NULL or _mpi_start == NULL:
        e.pers_start()
        e.pers_wait()
        return 0
    with nogil:
        rc = _mpi_start(handle)
        if rc == 0:
            rc = _mpi_wait(handle, status)
    if rc != 0:
        raise _mpi_exception(rc)
    return 0


cdef int _gather(RedistEntry e, object x, object out) except -1:
    if _hooks.active and _hooks.persistent:
        _persistent_request(e)
        memcpy(e.pers_send, _data(x), e.mine)
        _start_wait(e)
        if e.unstage is None:
            memcpy(_data(out), e.pers_recv, e.pers_recv_len)
        else:
            _copy_blocks(e.pers_recv, _data(out), e.unstage)
        return 0
    rbuf = out if e.unstage is None else _bytes_buffer(e.stage)
    if e.counts is None:
        e.mpi.Allgather([x, e.mine, _mpi_byte], [rbuf, e.mine, _mpi_byte])
    else:
        e.mpi.Allgatherv([x, e.mine, _mpi_byte], [rbuf, e.counts, e.displs, _mpi_byte])
    if e.unstage is not None:
        _copy_blocks(_data(rbuf), _data(out), e.unstage)
    return 0


cdef int _reduce_scatter(RedistEntry e, object x, object out) except -1:
    sbuf = x
    if e.pack is not None:
        sbuf = _bytes_buffer(e.pack_len)
        _copy_blocks(_data(x), _data(sbuf), e.pack)
    if e.counts is None:
        e.mpi.Reduce_scatter_block([sbuf, e.mine, e.mpi_type], [out, e.mine, e.mpi_type],
                                   e.mpi_op)
    else:
        e.mpi.Reduce_scatter([sbuf, e.total, e.mpi_type], [out, e.mine, e.mpi_type], e.counts,
                             e.mpi_op)
    return 0


cdef int _all_to_all(RedistEntry e, object x, object out) except -1:
    _copy_blocks(_data(x), _data(out), e.own)
    sbuf = x
    if e.pack is not None:
        sbuf = _bytes_buffer(e.pack_len)
        _copy_blocks(_data(x), _data(sbuf), e.pack)
    rbuf = out if e.unstage is None else _bytes_buffer(e.stage)
    e.mpi.Alltoallw([sbuf, e.scounts, e.sdispls, e.types],
                    [rbuf, e.rcounts, e.rdispls, e.types])
    if e.unstage is not None:
        _copy_blocks(_data(rbuf), _data(out), e.unstage)
    return 0


cdef object run(RedistEntry e, object x):
    """Run entry ``e`` on the local array ``x``: the output's local array (``e.dst`` is its
    spec), or None when the compiled path declines (nothing ran): an entry of the Python
    method, an ``x`` that is not a host numpy array, or one that is not C-contiguous where
    the step communicates. **Collective** when the step communicates."""
    cdef int kind = e.kind
    if kind == REDIST_PY:
        return None
    if type(x) is not cnp.ndarray:
        return None
    if kind == REDIST_LOCAL:
        _kind_runs[kind] += 1
        return x if e.index is None else x[e.index]
    if not cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>x):
        return None
    cdef cnp.npy_intp dims[32]
    cdef Py_ssize_t i, nd = len(e.shape)
    if e.make is None:
        for i in range(nd):
            dims[i] = <cnp.npy_intp>(<object>PyTuple_GET_ITEM(e.shape, i))
        out = cnp.PyArray_EMPTY(<int>nd, dims, e.typenum, 0)
    else:
        out = e.make()
    _kind_runs[kind] += 1
    if kind == REDIST_GATHER:
        _gather(e, x, out)
    elif kind == REDIST_ALL_REDUCE:
        e.mpi.Allreduce([x, e.total, e.mpi_type], [out, e.total, e.mpi_type], e.mpi_op)
    elif kind == REDIST_REDUCE_SCATTER:
        _reduce_scatter(e, x, out)
    else:
        _all_to_all(e, x, out)
    if e.avg:
        _np_divide(out, e.size, out=out)
    return out


def redistribute_kinds():
    """Redistributes the compiled path ran since the last reset of the dispatch front's
    counters, by kind: ``{"gather": n, "all_reduce": n, "reduce_scatter": n, "all_to_all":
    n, "local": n}``. **Local**."""
    return {k: _kind_runs[v] for k, v in _REDIST_KINDS.items()}


cdef unsigned long long run_count() noexcept:
    """Redistributes run since the last :func:`reset_counts`, all kinds together."""
    cdef unsigned long long n = 0
    cdef int i
    for i in range(6):
        n += _kind_runs[i]
    return n


cdef void reset_counts() noexcept:
    """Zero the counts of :func:`redistribute_kinds`."""
    cdef int i
    for i in range(6):
        _kind_runs[i] = 0
