# What dtensor plugs in (plug, install_tensor: its classes, the Python dispatcher's hooks, the
# recorder's parts) and the constructors of its Tensor and DTensor objects (wrap, _new_*, _get_local).

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


#: The fields of :func:`plug`, in the order it takes them.
PLUG_FIELDS = (
    "dtensor_cls", "dtypes_ns", "lookup", "dispatch", "run_entry", "wrap_outputs", "raw_form",
    "missing", "quiet_ctx", "quiet_call", "call_hook", "grad_mode", "slot_ops",
    "record_plan_of", "record_types", "record_node", "record_apply", "record_save",
    "record_stand_in", "record_stand_ins", "record_detached", "record_note_views",
    "record_view", "redistribute_form", "py_redistribute", "move_form", "move_input",
)
cdef dict _plugged = {}


def plug(**fields):
    """Plug dtensor into the compiled front, every field at once (:data:`PLUG_FIELDS`):
    DTensor and the dtypes' namespace; the Python dispatcher's hooks (``lookup``,
    ``dispatch``, ``run_entry``, ``wrap_outputs``, ``raw_form`` and the binder's
    ``missing`` marker); the quiet context and ``quiet_call`` (see :func:`set_quiet`); the
    autograd hook and grad mode (:func:`set_flags` turns them on); what runs behind the
    operator slots (:func:`set_slot_ops`); and the recorder's parts (``record_*``: its plan
    maker, tensor types, node class, formula, save, stand-ins, detach, view notes and view
    class); and what the compiled ``redistribute`` needs of dtensor
    (:func:`install_redistribute`'s ``redistribute_form``, ``py_redistribute``,
    ``move_form`` and ``move_input``). A missing or unknown field raises TypeError and plugs
    nothing. **Local**."""
    global _DTensor, _dtypes_ns, _lookup, _dispatch_py, _run_entry
    global _wrap_outputs, _raw_form, _MISSING, _call_hook, _grad_mode
    missing = [f for f in PLUG_FIELDS if f not in fields]
    unknown = sorted(set(fields) - set(PLUG_FIELDS))
    if missing or unknown:
        raise TypeError(f"fastpath.dispatch.plug: missing fields {missing}, unknown {unknown}")
    cls = fields["dtensor_cls"]
    if not issubclass(cls, DTensorBase):
        raise TypeError("fastpath.dispatch.plug: the DTensor class must derive from DTensorBase")
    if not isinstance(fields["grad_mode"], GradMode):
        raise TypeError("fastpath.dispatch.plug: grad_mode must be a GradMode")
    _install_recorder(
        fields["record_plan_of"], fields["record_types"], fields["record_node"],
        fields["record_apply"], fields["record_save"], fields["record_stand_in"],
        fields["record_stand_ins"], fields["record_detached"], fields["record_note_views"],
        fields["record_view"],
    )
    _DTensor, _dtypes_ns = cls, fields["dtypes_ns"]
    _lookup, _dispatch_py, _run_entry = fields["lookup"], fields["dispatch"], fields["run_entry"]
    _wrap_outputs, _raw_form, _MISSING = (fields["wrap_outputs"], fields["raw_form"],
                                          fields["missing"])
    set_quiet(fields["quiet_ctx"], fields["quiet_call"])
    _call_hook, _grad_mode = fields["call_hook"], fields["grad_mode"]
    set_slot_ops(fields["slot_ops"])
    install_redistribute(fields["redistribute_form"], fields["py_redistribute"],
                         fields["move_form"], fields["move_input"])
    _plugged.clear()
    _plugged.update(fields)


def plugged():
    """What :func:`plug` was given, by field (empty before it ran). **Local**."""
    return dict(_plugged)


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
    """Wrap an ndarray as a Tensor without copying or validating (the compiled
    ``dtensor.local.tensor.wrap_array``). **Local**."""
    return _new_tensor(arr, storage)
