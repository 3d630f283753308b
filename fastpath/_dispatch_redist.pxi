# DTensor.redistribute from compiled code: a plan that is one step of the kinds
# redistribute.execute.compiled_form describes (a small all-gather, an all-reduce, a
# reduce-scatter, an all-to-all, a local chunk) runs as the MPI call the Python executor
# issues for it, on the local array, the output from the allocator; the executor's packs
# and unpacks are byte copies here (_copy_blocks). With persistent all-gathers on, a gather
# runs as the start of the communicator's persistent request (the shard copied into its
# send buffer, its receive buffer copied or unpacked into the output, as the Python path's
# ``Comm.allgather_persistent``). Every other plan, every call while a communication
# observer or check is on, an asynchronous call and a pending DTensor (a subclass) go to
# the Python method, and so does a call whose local array is not C-contiguous where the
# step communicates.

from numpy import divide as _np_divide
from libc.stdint cimport int64_t
from cpython.pycapsule cimport PyCapsule_GetName, PyCapsule_GetPointer

cdef object _redist_form = None      # front.redistribute_form(dtensor, placements) -> tuple|None
cdef object _redist_py = None        # DTensor's Python redistribute method
cdef object _move_form = None        # front.move_form(move) -> tuple|None (an op's input move)
cdef object _move_input = None       # dispatcher.execute_move(dtensor, move, mesh) -> Tensor
cdef object _hooks = None            # redistribute.comm.HOOKS (traced, persistent)
cdef object _mpi_byte = None         # MPI.BYTE
cdef dict _redist = {}               # id(source spec) -> list of RedistEntry
cdef object _last = None             # the RedistEntry used last (checked before the table)
cdef Py_ssize_t REDIST_MAX = 4096    # source specs kept at most (then all are forgotten)

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


cdef inline bint _traced() except -1:
    """Whether a communication observer or debug check is on (``redistribute.comm.HOOKS``):
    the Python executor must then run every call, so that they see its collectives."""
    return _hooks is None or (_hooks.active and _hooks.traced)


cdef inline char* _data(object a):
    return <char*>cnp.PyArray_DATA(<cnp.ndarray>a)


cdef inline object _bytes_buffer(Py_ssize_t n):
    """A fresh uint8 buffer of ``n`` bytes (staging, packing)."""
    cdef cnp.npy_intp dims[1]
    dims[0] = n
    return cnp.PyArray_EMPTY(1, dims, cnp.NPY_UINT8, 0)


# MPI_Start and MPI_Wait of the MPI library, and mpi4py's PyMPIRequest_Get (plugged in by
# install_redistribute; NULL: the request's Python methods are called instead)
ctypedef int (*_mpi_start_t)(void* request) noexcept nogil
ctypedef int (*_mpi_wait_t)(void* request, void* status) noexcept nogil
ctypedef void* (*_request_get_t)(object request) except NULL
cdef _mpi_start_t _mpi_start = NULL
cdef _mpi_wait_t _mpi_wait = NULL
cdef _request_get_t _request_get = NULL
cdef object _mpi_exception = None    # MPI.Exception: raised with the error code of a call


def install_redistribute(form, py_method, hooks, mpi_byte, c_api=None, move_form=None,
                         move_input=None):
    """Plug in what the compiled ``redistribute`` needs: the dispatcher's
    ``redistribute_form``, DTensor's Python method, ``redistribute.comm.HOOKS``, ``MPI.BYTE``,
    ``redistribute.comm.request_c_api()`` (or None), ``move_form`` (the form of an op's
    input move, for :func:`move_local`) and the dispatcher's ``execute_move`` (an input move
    by the executor, for the moves the compiled path declines). **Local**."""
    global _redist_form, _redist_py, _hooks, _mpi_byte, _last, _move_form, _move_input
    global _mpi_start, _mpi_wait, _request_get, _mpi_exception
    _redist_form, _redist_py, _mpi_byte, _move_form = form, py_method, mpi_byte, move_form
    _move_input = move_input
    _hooks = hooks
    _mpi_start, _mpi_wait, _request_get = NULL, NULL, NULL
    if c_api is not None:
        start, wait, get, _mpi_exception = c_api
        _mpi_start = <_mpi_start_t><uintptr_t>start
        _mpi_wait = <_mpi_wait_t><uintptr_t>wait
        _request_get = <_request_get_t>PyCapsule_GetPointer(get, PyCapsule_GetName(get))
    _redist.clear()
    _last = None


@cython.final
cdef class RedistEntry:
    """One (source spec, target placements) pair as the compiled path runs it."""

    cdef object spec
    cdef object mesh                 # spec.mesh
    cdef tuple targets
    cdef long generation
    cdef int kind
    cdef object dst
    cdef object comm                 # the redistribute.comm.Comm of the step
    cdef object mpi                  # its mpi4py communicator
    cdef object make                 # None (numpy allocates) or a callable returning the output
    cdef tuple shape
    cdef int typenum
    cdef object size                 # the group size (a python int: avg divides by it)
    # gather
    cdef Py_ssize_t mine             # send bytes (gather), elements received (reduce_scatter)
    cdef object counts               # byte counts (Allgatherv), element counts
                                     # (Reduce_scatter) or None (the _block forms)
    cdef object displs
    cdef Py_ssize_t stage            # bytes of the staging buffer (0: straight into the output)
    cdef object unstage              # blocks of the staging buffer into the output, or None
    cdef tuple key                   # byte counts per rank: the key of its persistent gather
    cdef object pers                 # that PersistentGather, or None until first use
    cdef object pers_req             # its request, its Start and Wait (bound), its buffers
    cdef object pers_start
    cdef object pers_wait
    cdef void* pers_handle           # the request's MPI_Request* (with the C functions)
    cdef char* pers_send
    cdef char* pers_recv
    cdef Py_ssize_t pers_recv_len
    # reductions
    cdef object mpi_type
    cdef object mpi_op
    cdef Py_ssize_t total            # elements sent (reduce_scatter) or reduced (all_reduce)
    cdef bint avg
    cdef object pack                 # blocks of the input into the send buffer, or None
    cdef Py_ssize_t pack_len         # bytes of the send buffer
    # all_to_all
    cdef object own                  # the block this rank keeps, input -> output
    cdef object scounts
    cdef object sdispls
    cdef object rcounts
    cdef object rdispls
    cdef object types
    # local
    cdef object index                # None (the input itself) or the index of the view

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


cdef inline bint _same_targets(tuple targets, object placements):
    """Whether ``placements`` (a list or tuple) holds exactly the interned ``targets``."""
    cdef Py_ssize_t n = len(targets), i
    if len(placements) != n:
        return False
    for i in range(n):
        if <object>PyTuple_GET_ITEM(targets, i) is not placements[i]:
            return False
    return True


cdef RedistEntry _new_entry(object spec, object placements, object form):
    """An entry of ``spec`` made from a form of ``front.redistribute_form`` (None: the
    Python method's, or the executor's for a move)."""
    cdef RedistEntry e = RedistEntry.__new__(RedistEntry)
    e.spec = spec
    e.mesh = spec.mesh
    e.generation = _generation
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


cdef RedistEntry _redist_entry(object d, object spec, object placements):
    """The entry of ``(spec, placements)``, filled from the dispatcher on first use."""
    key = id(spec)
    cdef object chain = _redist.get(key)
    cdef RedistEntry e
    if chain is not None:
        for e in <list>chain:
            if e.spec is spec and e.generation == _generation and _same_targets(e.targets, placements):
                return e
    e = _new_entry(spec, placements, _redist_form(d, placements))
    if chain is None or (<RedistEntry>(<list>chain)[0]).spec is not spec:
        if len(_redist) >= REDIST_MAX:
            _redist.clear()
        chain = []
        _redist[key] = chain
    else:  # entries of an older generation are never used again
        chain[:] = [x for x in <list>chain if (<RedistEntry>x).generation == _generation]
    (<list>chain).append(e)
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


def redistribute_kinds():
    """Redistributes the compiled path ran since the last ``reset_stats``, by kind:
    ``{"gather": n, "all_reduce": n, "reduce_scatter": n, "all_to_all": n, "local": n}``.
    **Local**."""
    return {k: _redist_kind_hits[v] for k, v in _REDIST_KINDS.items()}


cdef object _redist_run(object self, object spec, object device_mesh, object placements):
    """The compiled run of ``self.redistribute(device_mesh, placements)``: the output's
    local array (its spec is then ``_last.dst``), or None when the plan is not one the
    compiled path runs (nothing ran). ``self`` is a plain host DTensor and ``placements`` a
    list or tuple; no communication observer or check is on. **Collective** when it runs a
    plan that communicates."""
    global _last
    cdef RedistEntry e = <RedistEntry>_last
    if e is None or e.spec is not spec or e.generation != _generation or not _same_targets(
            e.targets, placements):
        if device_mesh is not None and device_mesh is not spec.mesh:
            return None
        e = _last = _redist_entry(self, spec, placements)
    elif device_mesh is not None and device_mesh is not e.mesh:
        return None
    return _redist_exec(e, self)


cdef object _redist_exec(RedistEntry e, object self):
    """Run entry ``e`` on the local array of ``self`` (as :func:`_redist_run`)."""
    global _redist_hits
    cdef int kind = e.kind
    if kind == REDIST_PY:
        return None
    x = _local_arr(self)
    if type(x) is not cnp.ndarray:
        return None
    if kind == REDIST_LOCAL:
        _redist_hits += 1
        _redist_kind_hits[kind] += 1
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
    _redist_hits += 1
    _redist_kind_hits[kind] += 1
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


def redistribute(self, device_mesh=None, placements=None, *, async_op=False):
    """``DTensor.redistribute`` (same signature and result) served from compiled code when
    the plan is one step of a kind it runs; else the Python method. **Collective**."""
    cdef DTensorBase d = <DTensorBase>self
    if (type(placements) is not list and type(placements) is not tuple) or async_op or (
            type(self) is not _DTensor):
        return _redist_py(self, device_mesh, placements, async_op=async_op)
    if _traced():
        return _redist_py(self, device_mesh, placements, async_op=async_op)
    out = _redist_run(self, d._spec, device_mesh, placements)
    if out is None:
        return _redist_py(self, device_mesh, placements, async_op=async_op)
    return _new_dtensor_arr(out, (<RedistEntry>_last).dst)


cdef inline object _move_entry(object move):
    """The compiled entry of a dispatcher move (made on first use, kept on the move)."""
    e = move.fast
    if e is None or (<RedistEntry>e).generation != _generation:
        e = _new_entry(move.src, move.dst.placements, _move_form(move))
        move.fast = e
    return e


cdef bint _run_moves(tuple moves, list values, object mesh) except -1:
    """Replace the DTensor inputs of a front entry in ``values`` by what its kernel gets on
    this rank (``moves``: see ``_entry_moves``): a one-step move from compiled code, or by
    the dispatcher's ``execute_move`` where the compiled path declines it. False (nothing
    ran, ``values`` unchanged) while a communication observer or check is on (the Python
    dispatcher then names the op of each collective) or when an input is not a plain
    DTensor. **Collective** when a move communicates."""
    if _move_form is None or _move_input is None or _traced():
        return False
    cdef Py_ssize_t pi
    for pi, move in moves:
        if type(values[pi]) is not _DTensor:
            return False
    for pi, move in moves:
        v = values[pi]
        if move is None:
            values[pi] = _get_local(<DTensorBase>v)
            continue
        arr = _redist_exec(<RedistEntry>_move_entry(move), v)
        values[pi] = _move_input(v, move, mesh) if arr is None else _new_tensor(arr, None)
    global _moved_hits
    _moved_hits += 1
    return True


def move_local(self, move):
    """This rank's local array of ``self`` moved as the dispatcher's ``move`` (a
    ``Redist``: one-step ``steps`` from its ``src`` spec, the spec of ``self``, to its
    ``dst``), run from compiled code; None when the compiled path does not run that move
    (nothing ran: the caller runs the executor), also while a communication observer or
    check is on, so that they see the executor's calls. The move keeps its entry in its
    ``fast`` slot. **Collective** when the move communicates."""
    if type(self) is not _DTensor or _move_form is None or _traced():
        return None
    return _redist_exec(<RedistEntry>_move_entry(move), self)
