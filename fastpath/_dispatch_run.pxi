# The runners of a front entry: its raw form on the local arrays, else its kernel on the
# local tensors, else the Python entry runner (_raw_pair, _run).

cdef inline object _local_arr(object v):
    cdef DTensorBase d = <DTensorBase>v
    if d._loc is None:
        return d._larr
    return (<TensorBase?>d._loc)._arr


cdef bint _outside(FrontEntry fe, object b) except -1:
    """Whether the python int ``b`` is outside ``[fe.lo, fe.hi]`` (or beyond 64 bits)."""
    cdef int overflow = 0
    cdef long long v = PyLong_AsLongLongAndOverflow(b, &overflow)
    return overflow != 0 or v < fe.lo or v > fe.hi


cdef object _raw_pair(FrontEntry fe, object a, object b):
    """A binary or scalar raw form on operands ``a`` (a DTensor) and ``b``; None when the
    kernel must decide (an int the dtype cannot hold: numpy raises, or compares exactly
    where the kernel wraps it)."""
    x = _local_arr(a)
    if fe.raw == RAW_BINARY:
        y = _local_arr(b)
    elif fe.bounded and _outside(fe, b):
        return None
    else:
        y = b
    try:
        if not fe.quiet_raw:
            out = _call_pair(fe, x, y)
        elif _quiet_enter():
            try:
                out = _call_pair(fe, x, y)
            finally:
                PyContext_Exit(_quiet_ctx)
        else:
            out = _quiet_call(_call_pair_py, fe, x, y)
    except OverflowError:
        if fe.raw == RAW_BINARY:
            raise
        return None
    return _new_dtensor_arr(out, fe.out_spec0)


cdef inline object _call_pair(FrontEntry fe, object x, object y):
    """``ufunc(x, y)``, into the entry's pooled output (``out=``) when it has one."""
    if fe.rawout is None:
        return fe.rawfn(x, y)
    return fe.rawfn(x, y, out=fe.rawout())


def _call_pair_py(FrontEntry fe, object x, object y):
    """:func:`_call_pair` as a Python callable, for ``_quiet_call``."""
    return _call_pair(fe, x, y)


cdef object _raw_compute(FrontEntry fe, int raw, object a):
    """The unary or reduce raw form on the local array ``a`` (quietly: see _run), into the
    entry's pooled output when it has one."""
    o = None if fe.rawout is None else fe.rawout()
    if raw == RAW_UNARY:
        f = fe.rawfn
        if type(f) is Unary:  # a compiled kernel: its C entry, no Python call
            return (<Unary>f).apply(a, o)
        return f(a, o)
    axes, dtype, keepdim, scale = <tuple>fe.rawarg
    out = fe.rawfn(a, axes, dtype, o, keepdim)
    if type(out) is not _ndarray:  # a numpy scalar of a full reduction: 0-d array
        if scale is not None:
            out = out * scale
        return _asarray(out)
    if scale is not None:
        out *= scale
    return out


def _raw_compute_py(FrontEntry fe, int raw, object a):
    """:func:`_raw_compute` as a Python callable, for ``_quiet_call``."""
    return _raw_compute(fe, raw, a)


cdef Py_ssize_t COPY_NOGIL_MIN = 1 << 20   # bytes from which a copy releases the GIL


cdef void _copy_bytes(cnp.ndarray out, cnp.ndarray a) noexcept:
    """Copy the C-contiguous array ``a`` into ``out``, C-contiguous, of its size and dtype."""
    cdef void* dst = cnp.PyArray_DATA(out)
    cdef const void* src = cnp.PyArray_DATA(a)
    cdef Py_ssize_t n = cnp.PyArray_NBYTES(a)
    if n >= COPY_NOGIL_MIN:
        with nogil:
            memcpy(dst, src, n)
    else:
        memcpy(dst, src, n)


cdef object _run(FrontEntry fe, list values):
    """Run a front entry on bound values (DTensors are replaced by local tensors)."""
    cdef int raw = fe.raw
    cdef Py_ssize_t i, j
    cdef tuple extra_idx = fe.extra_idx
    if raw != RAW_NONE:
        for j in range(len(extra_idx)):
            i = <Py_ssize_t>(<object>PyTuple_GET_ITEM(extra_idx, j))
            if values[i] is not <object>PyTuple_GET_ITEM(fe.extra_val, j):
                raw = RAW_NONE
                break
    if raw == RAW_BINARY or raw == RAW_SCALAR:
        out = _raw_pair(fe, values[0], values[1])
        if out is not None:
            return out
    if raw == RAW_UNARY or raw == RAW_REDUCE:
        a = _local_arr(values[0])
        if not fe.quiet_raw:
            out = _raw_compute(fe, raw, a)
        elif _quiet_enter():
            try:
                out = _raw_compute(fe, raw, a)
            finally:
                PyContext_Exit(_quiet_ctx)
        else:
            out = _quiet_call(_raw_compute_py, fe, raw, a)
        return _new_dtensor_arr(out, fe.out_spec0)
    if raw == RAW_COPY or raw == RAW_CONTIG:
        # Tensor.clone of a C-contiguous array (its copy keeps those strides) and
        # Tensor.contiguous of one that is not (a C-order copy); otherwise the kernel
        arr = _local_arr(values[0])
        if type(arr) is cnp.ndarray and (
                cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>arr) == (raw == RAW_COPY)):
            out = None if fe.rawout is None else fe.rawout()
            if raw == RAW_CONTIG:  # a tiled transpose for x.mT layouts
                out = copy_c_order(arr, out)
            elif out is None:
                out = cnp.PyArray_NewCopy(<cnp.ndarray>arr, cnp.NPY_CORDER)
            elif (cnp.PyArray_NBYTES(<cnp.ndarray>out) == cnp.PyArray_NBYTES(<cnp.ndarray>arr)
                    and cnp.PyArray_TYPE(<cnp.ndarray>out) == cnp.PyArray_TYPE(<cnp.ndarray>arr)):
                # both C-contiguous, of one shape and dtype (the entry's pooled output): the
                # bytes as they are, without numpy's assignment machinery
                _copy_bytes(<cnp.ndarray>out, <cnp.ndarray>arr)
            else:
                cnp.PyArray_CopyInto(<cnp.ndarray>out, <cnp.ndarray>arr)
            return _new_dtensor_arr(out, fe.out_spec0)
    cdef TensorBase t, nt
    if raw == RAW_VIEW:
        # Tensor.view's own short path: a standard (row-major) array reshapes to PyTorch's
        # strides; the result shares the Storage and is standard again.
        t = <TensorBase?>_get_local(<DTensorBase>values[0])
        if t._std is True:
            arr = t._arr
            if type(arr) is cnp.ndarray:  # numpy's C reshape (no method lookup)
                arr = cnp.PyArray_Reshape(<cnp.ndarray>arr, fe.rawfn)
            else:
                arr = arr.reshape(fe.rawfn)
            nt = <TensorBase>_new_tensor(arr, t._storage)
            nt._std = True
            return _new_dtensor(nt, fe.out_spec0)
    elif raw == RAW_T:
        t = <TensorBase?>_get_local(<DTensorBase>values[0])
        arr = t._arr
        if type(arr) is cnp.ndarray:  # numpy's C transpose (no attribute lookup)
            arr = cnp.PyArray_Transpose(<cnp.ndarray>arr, NULL)
        else:
            arr = arr.T
        return _new_dtensor(_new_tensor(arr, t._storage), fe.out_spec0)
    elif raw == RAW_GETITEM:
        # Tensor.__getitem__'s result for a basic index: numpy's view, when not empty
        t = <TensorBase?>_get_local(<DTensorBase>values[0])
        out = t._arr[fe.rawfn]
        if out.size:
            return _new_dtensor(_new_tensor(out, t._storage), fe.out_spec0)
    cdef tuple direct = fe.direct
    if direct is None:
        if fe.moves is None or not _run_moves(fe.moves, values, fe.mesh):
            return _run_entry(fe.entry, values, fe.mesh)
        direct = ()
    cdef Py_ssize_t pi
    for pi in direct:
        v = values[pi]
        if type(v) is _DTensor:
            values[pi] = _get_local(<DTensorBase>v)
    # a kernel that computes and does not see to it itself runs through quiet_call (the
    # kernels' context: the kernel's short paths enter the shared one of the short paths)
    out = _quiet_call(fe.kernel, *values) if fe.quiet_kernel else fe.kernel(*values)
    if type(out) is _Tensor:
        return _new_dtensor(out, fe.out_spec0)
    return _wrap_outputs(out, fe.out_specs)
