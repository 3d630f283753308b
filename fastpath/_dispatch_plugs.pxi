# What dtensor plugs in (install, install_tensor: its classes, the Python dispatcher's
# hooks) and the constructors of its Tensor and DTensor objects (wrap, _new_*, _get_local).

cdef object _Tensor = None           # dtensor.Tensor (a TensorBase subclass)
cdef object _DTensor = None          # dtensor.DTensor (a DTensorBase subclass)
cdef dict _dtypes_ns = None          # dtensor.local.dtypes' namespace (``_default_float``)
cdef object _lookup = None           # dispatcher.lookup(info, values) -> (entry, key, mesh)
cdef object _dispatch_py = None      # dispatcher.dispatch(info, args, kwargs)
cdef object _run_entry = None        # dispatcher.run_entry(entry, values, mesh)
cdef object _wrap_outputs = None     # dispatcher._wrap_outputs(out, specs)
cdef object _raw_form = None         # dispatcher.raw_form(info, entry, values) -> tuple|None
cdef object _MISSING = None          # the binder's "no default" marker


def install_tensor(tensor_cls):
    """Plug in dtensor's Tensor class (a :class:`TensorBase` subclass) for :func:`wrap`."""
    global _Tensor
    if not issubclass(tensor_cls, TensorBase):
        raise TypeError("fastpath.install_tensor: the class must derive from TensorBase")
    _Tensor = tensor_cls


def install(dtensor_cls, dtypes_ns, lookup, dispatch, run_entry, wrap_outputs, raw_form,
            missing):
    """Plug DTensor and the Python dispatcher's hooks into the compiled path. **Local**."""
    global _DTensor, _dtypes_ns, _lookup, _dispatch_py, _run_entry
    global _wrap_outputs, _raw_form, _MISSING
    if not issubclass(dtensor_cls, DTensorBase):
        raise TypeError("fastpath.install: the class must derive from DTensorBase")
    _DTensor, _dtypes_ns = dtensor_cls, dtypes_ns
    _lookup, _dispatch_py, _run_entry = lookup, dispatch, run_entry
    _wrap_outputs, _raw_form, _MISSING = wrap_outputs, raw_form, missing


cdef tuple _NO_ARGS = ()


cdef inline object _alloc(type base, object cls):
    """``base.__new__(cls)`` through ``base``'s C slot: the object ``tp_new_wrapper`` would
    make, without looking ``__new__`` up and calling it as a Python method (about 800
    instructions per object). ``cls`` is a subclass of ``base`` (install checks it)."""
    if cls is None:
        raise TypeError("fastpath._dispatch: dtensor's classes are not installed")
    return (<PyTypeObject*>base).tp_new(<type>cls, <PyObject*>_NO_ARGS, NULL)


cdef inline object _new_tensor(object arr, object storage):
    cdef TensorBase t = <TensorBase>_alloc(TensorBase, _Tensor)
    t._arr = arr
    t._storage = storage
    t._std = None
    return t


cdef inline object _new_dtensor(object local, object spec):
    cdef DTensorBase d = <DTensorBase>_alloc(DTensorBase, _DTensor)
    d._loc = local
    d._spec = spec
    return d


cdef inline object _new_dtensor_arr(object arr, object spec):
    """A DTensor whose local Tensor (over ``arr``, Storage derived on use) is made lazily."""
    cdef DTensorBase d = <DTensorBase>_alloc(DTensorBase, _DTensor)
    d._larr = arr
    d._spec = spec
    return d


cdef inline object _get_local(DTensorBase d):
    if d._loc is None and d._larr is not None:
        d._loc = _new_tensor(d._larr, None)
        d._larr = None
    return d._loc


def wrap(arr, storage=None):
    """Wrap an ndarray as a Tensor without copying or validating (compiled ``_wrap``). **Local**."""
    return _new_tensor(arr, storage)
