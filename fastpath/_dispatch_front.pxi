# The front of the propagation cache: FrontEntry (one cached entry as compiled code runs
# it) and FastOp (one op: binding its arguments, the front table, lookup and fill).

cdef enum:
    TABLE_SIZE = 64              # front table slots per op (a power of two)
    TABLE_MASK = TABLE_SIZE - 1

cdef object _DECLINE = object()      # _serve's answer when the Python dispatcher must run


cdef inline bint _has_ag(object a):
    """Whether ``a`` is a DTensor (a pending one of an async redistribute included) with
    autograd state (the hook decides the rest)."""
    return isinstance(a, DTensorBase) and (<DTensorBase>a)._ag is not None


cdef bint _any_ag(tuple args, dict kwargs):
    for a in args:
        if _has_ag(a):
            return True
        t = type(a)
        if t is list or t is tuple:
            for e in a:
                if _has_ag(e):
                    return True
    if kwargs:
        for a in kwargs.values():
            if _has_ag(a):
                return True
    return False


cdef class FrontEntry:
    """One propagation-cache entry as the compiled path runs it."""

    cdef tuple markers
    cdef tuple statics
    cdef object dflt
    cdef long generation
    cdef object entry
    cdef object key
    cdef object mesh
    cdef object kernel
    cdef tuple direct
    cdef tuple moves        # (index, move or None) per input of an entry whose moves the
                            # compiled path runs (see _entry_moves), or None
    cdef object out_spec0
    cdef tuple out_specs
    cdef int raw
    cdef object rawfn
    cdef object rawarg
    cdef object rawout      # None (numpy allocates) or a callable returning the output array
    cdef tuple extra_idx    # bound values the raw form needs unchanged: their indices
    cdef tuple extra_val    # ... and values
    cdef bint quiet_raw     # run the raw form quietly (numpy may report FP errors there)
    cdef bint quiet_kernel  # run the kernel quietly (it computes and does not itself)
    cdef bint bounded       # a scalar form that runs with python ints in [lo, hi] only
    cdef long long lo
    cdef long long hi
    cdef unsigned long long tick
    cdef bint pending


cdef class FastOp:
    """One op of the table served from compiled code (see the module docstring)."""

    cdef readonly object info
    cdef readonly str name
    cdef Py_ssize_t nparams
    cdef Py_ssize_t pack_idx
    cdef list fill
    cdef dict index
    cdef tuple tensor_idx
    cdef tuple static_idx
    cdef list table
    cdef FrontEntry last    # the entry of the previous hit or fill (checked first)
    cdef bint pair          # (a, b) calls key on two tensor-likes only: see call2
    cdef bint inplace       # the op writes its first argument
    cdef readonly object plain  # plain(*args, **kwargs): the call without the autograd hook
    cdef readonly object py_plain  # the same on the Python path: the Python dispatcher

    def __init__(self, info, binder):
        self.info = info
        self.name = info.name
        self.inplace = bool(info.inplace)
        self.plain = _plain_of(self)
        self.py_plain = _py_plain_of(info)
        self.nparams = binder.nparams
        self.pack_idx = binder.pack_idx
        self.fill = list(binder.fill)
        self.index = dict(binder.index)
        self.tensor_idx = tuple(binder.tensor_idx)
        self.static_idx = tuple(binder.static_idx)
        self.table = [None] * TABLE_SIZE
        self.pair = (
            self.tensor_idx == (0, 1) and not self.static_idx and self.nparams >= 2
            and self.pack_idx != 1 and all(v is not _MISSING for v in self.fill[2:])
        )

    cdef list _bind(self, tuple args, dict kwargs):
        """The bound values (the Python binder's result), or None for the Python path."""
        cdef Py_ssize_t n = len(args), i
        cdef Py_ssize_t nparams = self.nparams
        cdef list values
        cdef object v
        if not kwargs and n <= nparams and n - 1 != self.pack_idx:
            # positional call, nothing to fold: the arguments, then the defaults
            values = PyList_New(nparams)
            for i in range(nparams):
                if i < n:
                    v = <object>PyTuple_GET_ITEM(args, i)
                else:
                    v = self.fill[i]
                    if v is _MISSING:
                        return None
                Py_INCREF(v)
                PyList_SET_ITEM(values, i, v)
            return values
        if n > nparams or n - 1 == self.pack_idx:
            if self.pack_idx < 0:
                return None
            tail = args[self.pack_idx:]
            if not (len(tail) == 1 and isinstance(tail[0], (list, tuple))):
                args = args[:self.pack_idx] + (tail,)
                n = len(args)
        if n > nparams:
            return None
        values = list(args)
        if n < nparams:
            values.extend(self.fill[n:])
        if kwargs:
            for k, v in kwargs.items():
                idx = self.index.get(k)
                if idx is None:
                    return None
                i = idx
                if i < n:
                    return None
                values[i] = v
        if n < nparams:
            for i in range(n, nparams):
                if values[i] is _MISSING:
                    return None
        return values

    cdef list _bind_n(self, object a, object b, Py_ssize_t n):
        """The bound values of a positional call ``(a,)`` or ``(a, b)``, or None."""
        cdef Py_ssize_t nparams = self.nparams, i
        if n > nparams:
            return None
        if n - 1 == self.pack_idx:
            # the binder folds a trailing size into a tuple: ``x.view(-1)`` is view(x, (-1,))
            if n != 2:
                return None
            if not isinstance(b, (list, tuple)):
                b = (b,)
        cdef list values = PyList_New(nparams)
        cdef object v
        for i in range(nparams):
            if i == 0:
                v = a
            elif i == 1 and n == 2:
                v = b
            else:
                v = self.fill[i]
                if v is _MISSING:
                    return None
            Py_INCREF(v)
            PyList_SET_ITEM(values, i, v)
        return values

    cdef object call1(self, object a):
        """``call((a,), None)`` without building the tuple on the common path."""
        if _python_path:
            return self.call_python((a,), None)
        if _autograd_on and (self.inplace or (_grad_mode.enabled and _has_ag(a))):
            return _hooked(self.info, self.plain, (a,), {})
        cdef list values = self._bind_n(a, None, 1)
        if values is None:
            return self.call((a,), None)
        out = self._serve(values)
        if out is _DECLINE:
            return _dispatch_py(self.info, (a,), {})
        return out

    cdef object call2(self, object a, object b):
        """``call((a, b), None)`` without building the tuple on the common path.

        For a binary op whose key is just its two operands (and the default float dtype),
        a front hit of a raw pointwise form runs without binding the other parameters (they
        hold their defaults, which the raw form requires anyway)."""
        cdef FrontEntry fe
        cdef uintptr_t h
        if _python_path:
            return self.call_python((a, b), None)
        if _autograd_on and (self.inplace or (_grad_mode.enabled and (
                _has_ag(a) or _has_ag(b)))):
            return _hooked(self.info, self.plain, (a, b), {})
        if self.pair:
            ma = _marker(a)
            mb = _marker(b)
            if ma is not _UNSUP and mb is not _UNSUP:
                dflt = <object>PyDict_GetItem(_dtypes_ns, "_default_float")
                h = (_addr(dflt) ^ (_addr(ma) >> 4)) * <uintptr_t>0x9E3779B1
                h = (h ^ (_addr(mb) >> 4)) * <uintptr_t>0x9E3779B1
                h ^= h >> 17
                found = self.table[<Py_ssize_t>(h & TABLE_MASK)]
                if found is not None:
                    fe = <FrontEntry>found
                    if (fe.generation == _generation and fe.dflt is dflt
                            and fe.markers[0] is ma and fe.markers[1] is mb
                            and (fe.raw == RAW_BINARY or fe.raw == RAW_SCALAR)):
                        out = _raw_pair(fe, a, b)
                        if out is not None:
                            _touch(fe)
                            return out
        cdef list values = self._bind_n(a, b, 2)
        if values is None:
            return self.call((a, b), None)
        out = self._serve(values)
        if out is _DECLINE:
            return _dispatch_py(self.info, (a, b), {})
        return out

    cdef object call_sizes(self, object a, tuple sizes):
        """``call((a,) + sizes, None)`` for an op whose second parameter packs the trailing
        positionals (``x.view(2, -1)``, ``x.view((2, -1))``; ``pack_idx == 1``), without
        re-packing them."""
        if not sizes:
            return self.call((a,), None)
        if _python_path:
            return self.call_python((a,) + sizes, None)
        if _autograd_on and (self.inplace or (_grad_mode.enabled and _has_ag(a))):
            return _hooked(self.info, self.plain, (a,) + sizes, {})
        b = sizes[0] if len(sizes) == 1 and isinstance(sizes[0], (list, tuple)) else sizes
        cdef list values = self._bind_n(a, b, 2)
        if values is None:
            return self.call((a,) + sizes, None)
        out = self._serve(values)
        if out is _DECLINE:
            return _dispatch_py(self.info, (a,) + sizes, {})
        return out

    cdef object call(self, tuple args, dict kwargs):
        """Run the op on ``args``/``kwargs`` (at least one DTensor among them); through the
        autograd hook when a DTensor argument has autograd state and grad mode is on, or
        the op is in-place."""
        if _python_path:
            return self.call_python(args, kwargs)
        if _autograd_on and (self.inplace or (_grad_mode.enabled and _any_ag(
                args, kwargs))):
            return _hooked(self.info, self.plain, args, kwargs or {})
        return self.call_unhooked(args, kwargs)

    cdef object call_python(self, tuple args, dict kwargs):
        """:meth:`call` on the Python path (``set_flags(python_path=True)``): the Python
        dispatcher, through the autograd hook when the call may record."""
        if kwargs is None:
            kwargs = {}
        if _autograd_on and (self.inplace or (_grad_mode.enabled and _any_ag(args, kwargs))):
            return _call_hook(self.info, self.py_plain, args, kwargs)
        return _dispatch_py(self.info, args, kwargs)

    cdef object call_unhooked(self, tuple args, dict kwargs):
        """:meth:`call` without the autograd hook (what the hook's ``plain`` runs)."""
        cdef list values = self._bind(args, kwargs)
        if values is None:
            return _dispatch_py(self.info, args, kwargs or {})
        out = self._serve(values)
        if out is _DECLINE:
            return _dispatch_py(self.info, args, kwargs or {})
        return out

    cdef object _serve(self, list values):
        """Key, front lookup and run of bound ``values``; ``_DECLINE`` when the call needs
        the Python dispatcher (a tensor-like or static value the front does not key).

        The entry of the previous hit is tried first: a call site that repeats one
        signature (the common case) skips hashing the key. ``_matches`` alone decides a hit
        (a value equal, type for type, to a stored static value is itself simple)."""
        dflt = <object>PyDict_GetItem(_dtypes_ns, "_default_float")
        cdef FrontEntry fe = self.last
        if fe is not None and self._matches(fe, values, dflt):
            return _run(_touch(fe), values)
        cdef uintptr_t h = _addr(dflt)
        cdef Py_ssize_t pi
        for pi in self.tensor_idx:
            m = _marker(values[pi])
            if m is _UNSUP:
                return _DECLINE
            h = (h ^ (_addr(m) >> 4)) * <uintptr_t>0x9E3779B1
        for pi in self.static_idx:
            s = values[pi]
            if not _simple(s):
                return _DECLINE
            h = (h ^ _shash(s)) * <uintptr_t>0x9E3779B1
        h ^= h >> 17
        cdef Py_ssize_t slot = <Py_ssize_t>(h & TABLE_MASK)
        cdef object found = self.table[slot]
        if found is not None and self._matches(<FrontEntry>found, values, dflt):
            fe = <FrontEntry>found
            self.last = fe
            return _run(_touch(fe), values)
        res = _lookup(self.info, values)
        fe = self._fill(res, values, dflt)
        if fe is None:
            return _run_entry(res[0], values, res[2])
        self.table[slot] = fe
        self.last = fe
        return _run(fe, values)

    cdef bint _matches(self, FrontEntry fe, list values, object dflt) except -1:
        if fe.generation != _generation or fe.dflt is not dflt:
            return False
        cdef Py_ssize_t j = 0, pi
        cdef tuple markers = fe.markers
        for pi in self.tensor_idx:
            if _marker(values[pi]) is not markers[j]:
                return False
            j += 1
        j = 0
        cdef tuple statics = fe.statics
        for pi in self.static_idx:
            if not _same(values[pi], statics[j]):
                return False
            j += 1
        return True

    cdef FrontEntry _fill(self, tuple res, list values, object dflt):
        """A front entry for the Python dispatcher's answer, or None when uncacheable."""
        global _fills
        entry, key, mesh = res
        if key is None:
            return None
        cdef FrontEntry fe = FrontEntry.__new__(FrontEntry)
        fe.markers = tuple([_marker(values[pi]) for pi in self.tensor_idx])
        fe.statics = tuple([_frozen(values[pi]) for pi in self.static_idx])
        fe.dflt = dflt
        fe.generation = _generation
        fe.entry = entry
        fe.key = key
        fe.mesh = mesh
        fe.kernel = entry.kernel
        fe.quiet_kernel = entry.quiet
        fe.direct = entry.direct
        fe.moves = _entry_moves(entry) if entry.direct is None else None
        fe.out_specs = tuple(entry.out_specs)
        fe.out_spec0 = fe.out_specs[0] if fe.out_specs else None
        raw = _raw_form(self.info, entry, values)
        fe.extra_idx = fe.extra_val = ()
        if raw is None:
            fe.raw = RAW_NONE
        else:
            fe.raw, fe.rawfn, extra, fe.rawarg, fe.quiet_raw, fe.rawout = raw
            if fe.raw == RAW_SCALAR and fe.rawarg is not None:
                fe.bounded = True
                fe.lo, fe.hi = fe.rawarg
            fe.extra_idx = tuple([i for i, _ in extra])
            fe.extra_val = tuple([v for _, v in extra])
        fe.tick = 0
        fe.pending = False
        _fills += 1
        return fe


cdef tuple _entry_moves(object entry):
    """``(index, move or None)`` per input of an entry that redistributes inputs, when every
    input is a top-level argument, every move a plan of at most one step, and the op is not
    in-place (the compiled path then runs the entry: see ``_run_moves``); else None."""
    if not entry.comm or entry.inplace or entry.abstract is not None:
        return None
    out = []
    for (pi, ei), move in zip(entry.slots, entry.moves):
        if ei >= 0:
            return None
        if move is None:
            out.append((pi, None))
            continue
        steps = getattr(move, "steps", None)
        if steps is None or len(steps) > 1:
            return None
        out.append((pi, move if steps else None))
    return tuple(out)


def _plain_of(FastOp op):
    """The call of ``op`` without the autograd hook, as a Python callable."""
    def plain(*args, **kwargs):
        return op.call_unhooked(args, kwargs)

    return plain


def _py_plain_of(info):
    """The call of op ``info`` on the Python path without the autograd hook: the Python
    dispatcher, as a Python callable."""
    def py_plain(*args, **kwargs):
        return _dispatch_py(info, args, kwargs)

    return py_plain
