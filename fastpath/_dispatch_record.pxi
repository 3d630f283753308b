# The compiled recorder: the common case of dtensor's autograd recorder
# (dtensor.dispatch.tape.record) run from compiled code, which every recording entry
# point tries first (the compiled guards of make_recording, the FastOps' hook, the public
# functions). A call it does not serve runs nothing here and goes to dtensor's recorder.
# Also the compiled bases of dtensor's autograd state and backward nodes, which it makes
# without running Python code.

cdef class AutogradMeta:
    """The autograd state of one tensor (dtensor.local.grad_engine's ``AutogradMeta`` on the
    compiled path: the same attributes and constructor)."""

    cdef public object requires_grad, grad, grad_fn, output_nr, layout, view

    def __init__(self, requires_grad=True, grad_fn=None, output_nr=0, layout=None):
        self.requires_grad = requires_grad
        self.grad = None
        self.grad_fn = grad_fn
        self.output_nr = output_nr
        self.layout = layout
        self.view = None


# Note: not cleared by the cycle collector, so that a node in a garbage cycle still holds
# its saved entries when it goes (the cycle is broken at its other objects).
@cython.no_gc_clear
cdef class NodeBase:
    """The attributes and constructor of a backward node (the base of dtensor.local.
    autograd's ``Node`` on the compiled path, which adds the methods). Going, a node stops
    counting the versions of what it saved (its ``saved`` entries)."""

    cdef public object op, formula, edges, ctx, out, n_outputs, saved, released
    cdef object __weakref__

    def __init__(self, op, formula, edges, ctx, out=None, n_outputs=1, saved=()):
        self.op = op
        self.formula = formula
        self.edges = edges
        self.ctx = ctx
        self.out = out
        self.n_outputs = n_outputs
        self.saved = saved
        self.released = False

    def __dealloc__(self):
        if self.saved and _rec_versions is not None:
            unsave(self.saved)


def set_versions(dict versions):
    """Plug in dtensor's version counters (``id(owner) -> [version, saved count]``). **Local**."""
    global _rec_versions
    _rec_versions = versions


def unsave(saved):
    """Stop counting the saved entries ``saved`` (see :func:`_save`): their node goes or is
    released. **Local**."""
    cdef list e
    versions = _rec_versions
    for s in saved:
        key = (<tuple>s)[0]
        found = versions.get(key)
        if found is not None:
            e = <list>found
            e[1] -= 1
            if e[1] <= 0:
                del versions[key]


cdef object _save(object t, object name):
    """The saved entry of ``t`` for a node that reads it: ``(key, version, name, t,
    owner)``, ``key`` the ``id`` of the array owning ``t``'s memory (which the entry keeps
    alive), counted in the versions dict (dtensor.local.grad_engine's ``save``)."""
    cdef list e
    arr = (<TensorBase>t)._arr if type(t) is _rec_T else (<TensorBase>_get_local(t))._arr
    own = arr.base
    if own is None:
        own = arr
    key = id(own)
    versions = _rec_versions
    found = versions.get(key)
    if found is None:
        e = [0, 0]
        versions[key] = e
    else:
        e = <list>found
    e[1] += 1
    return (key, e[0], name, t, own)


cdef class RecordPlan:
    """What the compiled recorder needs of one op, made by dtensor for an op whose calls
    it may serve (out of place, a formula, no random state, no variadic parameter):
    ``quick`` the fewest positional arguments of a call that binds by filling defaults,
    ``nparams`` the number of parameters, ``fill`` their defaults, ``pack_idx`` the
    parameter that packs trailing positionals (-1: none), ``tensor_idx`` the positions of
    the tensor parameters, ``save`` ``(position, name)`` of those the formula reads,
    ``unread`` the positions of the others, ``view`` whether the op is a view op,
    ``name``, ``backward``, ``out`` (the formula reads the output), ``names`` (parameter
    name -> position, for keyword arguments) and ``needed`` (the positions of the
    parameters without a default)."""

    cdef Py_ssize_t quick, nparams, pack_idx
    cdef list fill
    cdef tuple tensor_idx, save, unread, needed
    cdef bint view, out
    cdef object name, backward
    cdef dict names

    def __init__(self, Py_ssize_t quick, Py_ssize_t nparams, list fill, Py_ssize_t pack_idx,
                 tuple tensor_idx, tuple save, tuple unread, bint view, name, backward,
                 bint out, dict names=None, tuple needed=None):
        self.quick, self.nparams, self.fill, self.pack_idx = quick, nparams, fill, pack_idx
        self.tensor_idx, self.save, self.unread = tensor_idx, save, unread
        self.view, self.name, self.backward, self.out = view, name, backward, out
        self.names = names
        self.needed = needed


cdef object _rec_plan_of = None  # dtensor: plan_of(info) -> RecordPlan, or None (not served)
cdef dict _rec_plans = {}        # info -> RecordPlan or None
cdef type _rec_T = None          # the tensor types of the recorder: Tensor, DTensor,
cdef type _rec_D = None          # a pending DTensor, an abstract DTensor
cdef type _rec_P = None
cdef type _rec_A = None
cdef object _rec_node = None     # autograd.Node (a NodeBase subclass)
cdef object _rec_apply = None    # the nodes' formula: record._apply
cdef dict _rec_versions = None   # autograd's version counters: id(owner) -> [version, count]
cdef object _rec_save = None     # autograd.save(t, name) (a pending or abstract DTensor's)
cdef object _rec_stand_in = None # record._stand_in(v)
cdef dict _rec_stand_ins = None  # its cache: (shape, dtype char) of a Tensor, a DTensor's spec
cdef object _rec_detached = None # record._detached(t)
cdef object _rec_note_views = None  # record._note_views(info, values, x, outputs)
cdef object _rec_view = None     # record._View (a tuple subclass)
cdef long long _rec_served = 0   # calls recorded here (tests)


cdef _install_recorder(plan_of, tuple types, node, apply, save, stand_in, dict stand_ins,
                       detached, note_views, type view):
    """Plug in dtensor's recorder parts (see the module's globals above); forgets the
    plans made so far. **Local**."""
    global _rec_plan_of, _rec_T, _rec_D, _rec_P, _rec_A, _rec_node, _rec_apply
    global _rec_save, _rec_stand_in, _rec_stand_ins, _rec_detached, _rec_note_views, _rec_view
    _rec_T, _rec_D, _rec_P, _rec_A = types
    if not issubclass(node, NodeBase):
        raise TypeError("fastpath.dispatch.plug: the node class must derive from NodeBase")
    _rec_node, _rec_apply, _rec_save = node, apply, save
    _rec_stand_in, _rec_stand_ins = stand_in, stand_ins
    _rec_detached, _rec_note_views, _rec_view = detached, note_views, view
    _rec_plans.clear()
    _rec_plan_of = plan_of


def recorder_served():
    """How many calls the compiled recorder recorded. **Local**."""
    return _rec_served


cdef inline object _meta_of(object v, type t):
    """The autograd state of ``v`` (of type ``t``), or ``_DECLINE`` when ``t`` is not one
    of the recorder's tensor types."""
    if t is _rec_T:
        return (<TensorBase>v)._ag
    if t is _rec_D or t is _rec_P or t is _rec_A:
        return (<DTensorBase>v)._ag
    return _DECLINE


cdef inline object _owner(object t):
    """The array owning the memory of ``t`` (a Tensor or DTensor: autograd's ``owner``)."""
    arr = (<TensorBase>t)._arr if type(t) is _rec_T else (<TensorBase>_get_local(t))._arr
    own = arr.base
    return arr if own is None else own


cdef int _note_views(object info, list values, object x, tuple outputs) except -1:
    """``record._note_views`` for an input ``x`` that is not a view of a recorded view op
    (the recorder declines those): the outputs that share ``x``'s memory become its views."""
    cdef Py_ssize_t nr = 0, n = len(outputs)
    t = type(x)
    if not (t is _rec_T or t is _rec_D):
        _rec_note_views(info, values, x, outputs)
        return 0
    for o in outputs:
        t = type(o)
        if not (t is _rec_T or t is _rec_D):
            _rec_note_views(info, values, x, outputs)
            return 0
    own = _owner(x)
    xm = _meta_of(x, type(x))
    base = None
    for o in outputs:
        m = _meta_of(o, type(o))
        if type(m) is AutogradMeta and _owner(o) is own:  # (the state made just before)
            if base is None:
                base = PyWeakref_NewRef(x, None)
            (<AutogradMeta>m).view = tuple.__new__(_rec_view,
                                                   (base, xm, info, values, nr, n, None))
        nr += 1
    return 0


cdef inline bint _floating(object o) except -1:
    """Whether output ``o`` has a floating or complex dtype (it gets autograd state);
    ml_dtypes' bfloat16 (numpy kind 'V') is floating (:func:`placements.meta.dtype_kind`)."""
    cdef type t = type(o)
    if t is _rec_T:
        arr = (<TensorBase>o)._arr
        if type(arr) is _ndarray and (<cnp.ndarray>arr).descr.kind in b"fc":
            return True
    elif t is _rec_D:
        dtype = (<DTensorBase>o)._spec.dtype  # (DTensor's ``dtype``)
        if isinstance(dtype, cnp.dtype) and (<cnp.dtype>dtype).kind in b"fc":
            return True
    return _dtype_kind(o.dtype) in "fc"


cdef object _detached(object t):
    """``record._detached(t)``: a new handle on ``t``'s data without autograd state."""
    cdef type tt = type(t)
    if tt is _rec_T:
        return _new_tensor((<TensorBase>t)._arr, (<TensorBase>t)._storage)
    if tt is _rec_D:
        return _new_dtensor(_get_local(<DTensorBase>t), (<DTensorBase>t)._spec)
    return _rec_detached(t)


cdef object _stand_in(object v, type t):
    """``record._stand_in(v)`` (``v`` of the recorder's type ``t``), from its cache when
    there."""
    if t is _rec_T:
        arr = (<TensorBase>v)._arr
        if type(arr) is not _ndarray:
            return v
        key = (arr.shape, arr.dtype.char)
    else:
        key = (<DTensorBase>v)._spec
    s = _rec_stand_ins.get(key)
    return _rec_stand_in(v) if s is None else s


cdef list _bind_positional(RecordPlan plan, tuple args, object order):
    """The values of a call of positional arguments, by parameter position (defaults
    filled, trailing sizes packed), or None when the Python recorder binds it."""
    cdef Py_ssize_t n = len(args)
    if order is None:
        values = list(args)
    elif len(<tuple>order) == n:
        values = [args[i] for i in <tuple>order]
    else:
        return None
    if n > plan.nparams or n - 1 == plan.pack_idx:
        if plan.pack_idx < 0 or n <= plan.pack_idx:
            return None
        tail = values[plan.pack_idx:]
        if not (len(tail) == 1 and isinstance(tail[0], (list, tuple))):
            del values[plan.pack_idx:]
            values.append(tuple(tail))
        n = len(values)
    if n < plan.quick or n > plan.nparams:
        return None
    if n < plan.nparams:
        values.extend(plan.fill[n:])
    return values


cdef list _bind_keywords(RecordPlan plan, tuple args, dict kwargs, object order):
    """The values of a call with keyword arguments, by parameter position (defaults
    filled), or None when the Python recorder binds it: a reordered or packing call, an
    unknown keyword or one that a positional argument already gave, a parameter without a
    default left out."""
    cdef Py_ssize_t n = len(args), i
    if order is not None or plan.pack_idx >= 0 or plan.names is None or n > plan.nparams:
        return None
    values = list(args)
    values.extend(plan.fill[n:])
    for k, v in kwargs.items():
        found = plan.names.get(k)
        if found is None:
            return None
        i = <Py_ssize_t>found
        if i < n:
            return None
        values[i] = v
    for i in plan.needed:  # their fill is the binder's marker of a missing value
        if i >= n and values[i] is plan.fill[i]:
            return None
    return values


cdef object _record_fast(object info, object plain, tuple args, object kwargs, object order):
    """Record one call of ``info`` as dtensor's recorder does, for the common case: a
    plan, positional arguments (and keyword arguments naming parameters that no positional
    argument gave, in a call without reordering or packing), a tensor argument that
    requires grad, no input that is a view (whose history may need an update).
    ``_DECLINE`` (nothing ran) otherwise."""
    global _rec_served
    cdef RecordPlan plan
    cdef Py_ssize_t n, pi
    cdef bint wants = False, changed = False
    cdef NodeBase node
    cdef AutogradMeta meta
    if _rec_plan_of is None:
        return _DECLINE
    p = _rec_plans.get(info, _DECLINE)
    if p is _DECLINE:
        p = _rec_plan_of(info)
        _rec_plans[info] = p
    if p is None:
        return _DECLINE
    plan = <RecordPlan>p
    values = (_bind_keywords(plan, args, kwargs, order) if kwargs else
              _bind_positional(plan, args, order))
    if values is None:
        return _DECLINE
    slots = []
    edges = []
    for i in plan.tensor_idx:
        v = values[i]
        slots.append(v)
        m = _meta_of(v, type(v))
        if m is not None and m is not _DECLINE:
            if type(m) is not AutogradMeta or (<AutogradMeta>m).view is not None:
                return _DECLINE
            if (<AutogradMeta>m).requires_grad:
                wants = True
                edges.append(m)
                continue
        edges.append(None)
    if not wants:
        return _DECLINE
    for s in plan.save:  # a saved Partial input: the Python recorder saves it reduced
        v = values[<Py_ssize_t>(<tuple>s)[0]]
        if type(v) is _rec_D or type(v) is _rec_A:
            for pl in (<DTensorBase>v)._spec.placements:
                if pl.kind == "P":
                    return _DECLINE
    _grad_mode.enabled = False
    try:
        out = plain(*args, **kwargs) if kwargs else plain(*args)
    finally:
        _grad_mode.enabled = True
    if _meta_of(out, type(out)) is not _DECLINE:
        for v in slots:
            if v is out:  # the op returned its input (contiguous() of a contiguous tensor)
                return out
        outputs = (out,)
    else:
        outputs = tuple(out)
    saved_out = _detached(outputs[0]) if plan.out else None
    first = slots[0] if slots else None
    for i in plan.unread:
        pi = i
        v = values[pi]
        t = type(v)
        if t is _rec_T or t is _rec_D or t is _rec_P or t is _rec_A:
            m = _meta_of(v, t)
            if m is not None and (<AutogradMeta>m).grad_fn is not None:
                values[pi] = _stand_in(v, t)
                changed = True
    if changed:
        slots = [values[i] for i in plan.tensor_idx]
    # the saves, last (an out-of-place op leaves their versions as they were): nothing that
    # may fail runs between them and the node that holds them
    saved = []
    for s in plan.save:
        v = values[<Py_ssize_t>(<tuple>s)[0]]
        t = type(v)
        if t is _rec_T or t is _rec_D:
            saved.append(_save(v, (<tuple>s)[1]))
        elif t is _rec_P or t is _rec_A:
            saved.append(_rec_save(v, (<tuple>s)[1]))
    if plan.out:
        t = type(saved_out)
        saved.append(_save(saved_out, "result") if t is _rec_T or t is _rec_D
                     else _rec_save(saved_out, "result"))
    node = <NodeBase>_alloc(NodeBase, _rec_node)
    node.op = plan.name
    node.formula = _rec_apply
    node.edges = edges
    layouts = None  # a DTensor output's placements: its Partial gradient is reduced to them
    for o in outputs:
        if type(o) is _rec_D or type(o) is _rec_A:
            layouts = tuple([(<DTensorBase>e)._spec.placements
                             if type(e) is _rec_D or type(e) is _rec_A else None
                             for e in outputs])
            break
    node.ctx = (plan.backward, values, slots, layouts)
    node.out = saved_out
    node.n_outputs = len(outputs)
    node.saved = saved
    node.released = False
    nr = 0
    for o in outputs:
        if o is not None and _floating(o):
            m = _alloc(AutogradMeta, AutogradMeta)
            meta = <AutogradMeta>m
            meta.requires_grad = True
            meta.grad_fn = node
            meta.output_nr = nr
            if type(o) is _rec_T:
                (<TensorBase>o)._ag = m
            else:
                o._ag = m
        nr += 1
    if plan.view:
        _note_views(info, values, first, outputs)
    _rec_served += 1
    return out


cdef inline object _hooked(object info, object plain, tuple args, object kwargs,
                           object order=None, object recorder=None):
    """What a call that may record runs: the compiled recorder, or else ``recorder(info,
    plain, args, kwargs, order)`` (a recording form's) or dtensor's hook (a FastOp's or
    public function's), which also count an in-place op's writes."""
    if _grad_mode.enabled:
        out = _record_fast(info, plain, args, kwargs, order)
        if out is not _DECLINE:
            return out
    if recorder is None:
        return _call_hook(info, plain, args, kwargs)
    return recorder(info, plain, args, kwargs, order)
