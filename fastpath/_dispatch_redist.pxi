# DTensor.redistribute from compiled code: a plan that is one MPI all-gather of whole
# shards (the common small S -> R) runs as that call on the local array, the output from
# the allocator (with persistent all-gathers on, as the start of the communicator's
# persistent request: the shard copied into its send buffer, its receive buffer copied into
# the output, as the Python path's ``Comm.allgather_persistent``); every other plan, every
# call while a communication observer or check is on, an asynchronous call and a pending
# DTensor (a subclass) go to the Python method.

cdef object _redist_form = None      # front.redistribute_form(dtensor, placements) -> tuple|None
cdef object _redist_py = None        # DTensor's Python redistribute method
cdef object _comm_mod = None         # redistribute.comm (its _observers and _checks)
cdef object _mpi_byte = None         # MPI.BYTE
cdef dict _redist = {}               # id(source spec) -> list of RedistEntry
cdef Py_ssize_t REDIST_MAX = 4096    # source specs kept at most (then all are forgotten)

cdef enum:
    REDIST_PY = 0                    # the Python method runs
    REDIST_GATHER = 1                # Allgather / Allgatherv into a new output


def install_redistribute(form, py_method, comm_module, mpi_byte):
    """Plug in what the compiled ``redistribute`` needs: the dispatcher's
    ``redistribute_form``, DTensor's Python method, ``redistribute.comm`` and ``MPI.BYTE``.
    **Local**."""
    global _redist_form, _redist_py, _comm_mod, _mpi_byte
    _redist_form, _redist_py, _comm_mod, _mpi_byte = form, py_method, comm_module, mpi_byte
    _redist.clear()


@cython.final
cdef class RedistEntry:
    """One (source spec, target placements) pair as the compiled path runs it."""

    cdef object spec
    cdef tuple targets
    cdef long generation
    cdef int kind
    cdef object dst
    cdef object mpi
    cdef object make                 # None (numpy allocates) or a callable returning the output
    cdef tuple shape
    cdef int typenum
    cdef Py_ssize_t mine
    cdef object counts               # byte counts per rank (Allgatherv) or None (Allgather)
    cdef object displs
    cdef object comm                 # the redistribute.comm.Comm of the gather
    cdef tuple key                   # byte counts per rank: the key of its persistent gather
    cdef object pers                 # that PersistentGather, or None until first use


cdef inline bint _same_targets(tuple targets, object placements):
    """Whether ``placements`` (a list or tuple) holds exactly the interned ``targets``."""
    cdef Py_ssize_t n = len(targets), i
    if len(placements) != n:
        return False
    for i in range(n):
        if <object>PyTuple_GET_ITEM(targets, i) is not placements[i]:
            return False
    return True


cdef RedistEntry _redist_entry(object d, object spec, object placements):
    """The entry of ``(spec, placements)``, filled from the dispatcher on first use."""
    key = id(spec)
    cdef object chain = _redist.get(key)
    cdef RedistEntry e
    if chain is not None:
        for e in <list>chain:
            if e.spec is spec and e.generation == _generation and _same_targets(e.targets, placements):
                return e
    form = _redist_form(d, placements)
    e = RedistEntry.__new__(RedistEntry)
    e.spec = spec
    e.generation = _generation
    if form is None:
        e.kind = REDIST_PY
        e.targets = tuple(placements)
    else:
        e.kind = REDIST_GATHER
        (e.targets, e.dst, e.mpi, e.make, e.shape, dtype, e.mine, e.counts, e.displs,
         e.comm, e.key) = form
        e.typenum = dtype.num
    if chain is None or (<RedistEntry>(<list>chain)[0]).spec is not spec:
        if len(_redist) >= REDIST_MAX:
            _redist.clear()
        chain = []
        _redist[key] = chain
    else:  # entries of an older generation are never used again
        chain[:] = [x for x in <list>chain if (<RedistEntry>x).generation == _generation]
    (<list>chain).append(e)
    return e


def redistribute(self, device_mesh=None, placements=None, *, async_op=False):
    """``DTensor.redistribute`` (same signature and result) served from compiled code when
    the plan is one all-gather of whole shards; else the Python method. **Collective**."""
    cdef DTensorBase d = <DTensorBase>self
    spec = d._spec
    if (type(placements) is not list and type(placements) is not tuple) or (
            device_mesh is not None and device_mesh is not spec.mesh) or async_op or (
            type(self) is not _DTensor):
        return _redist_py(self, device_mesh, placements, async_op=async_op)
    if _comm_mod._observers or _comm_mod._checks:
        return _redist_py(self, device_mesh, placements, async_op=async_op)
    cdef RedistEntry e = _redist_entry(self, spec, placements)
    if e.kind == REDIST_PY:
        return _redist_py(self, device_mesh, placements, async_op=async_op)
    x = _local_arr(self)
    if type(x) is not cnp.ndarray or not cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>x):
        return _redist_py(self, device_mesh, placements, async_op=async_op)
    cdef cnp.npy_intp dims[32]
    cdef Py_ssize_t i, nd = len(e.shape)
    if e.make is None:
        for i in range(nd):
            dims[i] = <cnp.npy_intp>(<object>PyTuple_GET_ITEM(e.shape, i))
        out = cnp.PyArray_EMPTY(<int>nd, dims, e.typenum, 0)
    else:
        out = e.make()
    global _redist_hits
    _redist_hits += 1
    if _comm_mod._persistent:
        # the pool changes only when a gather is made, so skipping the lookup while the
        # entry's gather is alive keeps it in step with the ranks that look it up
        p = e.pers
        if p is None or p.request is None:
            p = e.pers = e.comm.persistent_gather(e.key)
        req = p.request
        memcpy(cnp.PyArray_DATA(<cnp.ndarray>p.send), cnp.PyArray_DATA(<cnp.ndarray>x), e.mine)
        req.Start()
        req.Wait()
        recv = <cnp.ndarray>p.recv
        memcpy(cnp.PyArray_DATA(<cnp.ndarray>out), cnp.PyArray_DATA(recv), cnp.PyArray_NBYTES(recv))
    elif e.counts is None:
        e.mpi.Allgather([x, e.mine, _mpi_byte], [out, e.mine, _mpi_byte])
    else:
        e.mpi.Allgatherv([x, e.mine, _mpi_byte], [out, e.counts, e.displs, _mpi_byte])
    return _new_dtensor_arr(out, e.dst)
