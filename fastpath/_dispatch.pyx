# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# cython: initializedcheck=False, nonecheck=False, binding=True, embedsignature=True
# cython: c_api_binop_methods=True
"""Compiled dispatch of ops on DTensors: the front of the propagation cache.

This module owns

* the compiled base classes of dtensor's local ``Tensor`` (:class:`TensorBase`: the slots
  ``_arr``, ``_std``, ``_storage``) and of ``DTensor`` (:class:`DTensorBase`: ``_local``,
  ``_spec``), so that compiled code creates and reads them at C speed;
* :class:`FastOp`: one op served from compiled code. A call binds its arguments (the twin
  of the Python binder), builds the cache key from metadata (the identity of each DTensor
  input's spec, each python scalar's type, the decision-relevant static values and the
  default float dtype), looks it up in a small identity-keyed front table and, on a hit,
  runs the stored entry: the local kernel (or, where the entry says so, the raw ndarray
  ufunc the kernel would call) on the local arrays, wrapped into the output Tensor and
  DTensor. Entries that redistribute inputs run their cached plan through the entry runner.
  A front miss goes to the Python dispatcher, whose propagation cache decides (and counts)
  the hit or miss; the front then remembers the entry.

The front only ever holds entries that are live in the Python cache: every eviction or
clear of that cache bumps a generation that invalidates the front. Hits served here touch
their entry for the LRU lazily (``flush`` replays the touches in order before the Python
cache is next used), so eviction order is exactly that of the Python path.

dtensor plugs this module in at import (:func:`install`); it never imports dtensor itself.
Every function here is **Local** unless the op it runs redistributes (then **Collective**).
"""

cimport cython
from numpy import asarray as _asarray
from numpy import ndarray as _ndarray
from cpython.dict cimport PyDict_GetItem
from cpython.list cimport PyList_New, PyList_SET_ITEM
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_GET_ITEM
from cpython.object cimport PyObject
from libc.stdint cimport uintptr_t
cimport numpy as cnp
from fastpath._kernels cimport Unary

cnp.import_array()

__all__ = [
    "DTensorBase",
    "FastOp",
    "TensorBase",
    "flush",
    "install",
    "install_tensor",
    "invalidate",
    "make_function",
    "make_method",
    "make_operator",
    "RAW_FORMS",
    "SLOT_TAGS",
    "set_slot_ops",
    "stats",
    "reset_stats",
    "wrap",
]

cdef enum:
    TABLE_SIZE = 64              # front table slots per op (a power of two)
    TABLE_MASK = TABLE_SIZE - 1
    # raw forms of an entry (chosen by the Python dispatcher's ``raw_form``)
    RAW_NONE = 0
    RAW_BINARY = 1               # ufunc(local_a, local_b)
    RAW_SCALAR = 2               # ufunc(local_a, python scalar); OverflowError -> the kernel
    RAW_UNARY = 3                # fn(local_a, None)
    RAW_VIEW = 4                 # local_a.reshape(local out shape) of a standard local_a
    RAW_T = 5                    # local_a.T (2-D)
    RAW_GETITEM = 6              # local_a[basic index] when it has elements
    RAW_REDUCE = 7               # ufunc.reduce(local_a, axes, dtype, None, keepdim) [* scale]

# The raw forms as Python values, for the dispatcher that chooses them.
RAW_FORMS = {
    "binary": RAW_BINARY, "scalar": RAW_SCALAR, "unary": RAW_UNARY, "view": RAW_VIEW,
    "t": RAW_T, "getitem": RAW_GETITEM, "reduce": RAW_REDUCE,
}


# Note: the bases are not tracked by the cycle collector (they hold only a fixed set of
# references that never lead back to the object), which makes creating them cheaper.
@cython.no_gc
cdef class TensorBase:
    """Compiled slots of the local Tensor: its ndarray, its cached layout flag, its Storage."""

    cdef public object _arr
    cdef public object _std
    cdef public object _storage
    cdef object __weakref__


@cython.no_gc
cdef class DTensorBase:
    """Compiled slots of DTensor: its local Tensor and its spec.

    Its arithmetic operators are C slots that run the ops registered by
    :func:`set_slot_ops` (``x + y`` then enters compiled code directly); a subclass that
    defines the operator itself (the Python path) overrides them.
    """

    cdef object _loc        # the local Tensor, or None while only its array exists
    cdef object _larr       # the local ndarray of an output whose Tensor is not made yet
    cdef public object _spec
    cdef object __weakref__

    @property
    def _local(self):
        """The local Tensor (made on first use for outputs of the compiled path)."""
        return _get_local(self)

    @_local.setter
    def _local(self, value):
        self._loc = value
        self._larr = None

    # C-API binary slots: called with the operands in expression order (``1.5 + x`` gives
    # ``(1.5, x)``), so one function serves ``__add__`` and ``__radd__``.
    def __add__(a, b):
        return _slot2(SLOT_ADD, a, b)

    def __sub__(a, b):
        return _slot2(SLOT_SUB, a, b)

    def __mul__(a, b):
        return _slot2(SLOT_MUL, a, b)

    def __truediv__(a, b):
        return _slot2(SLOT_TRUEDIV, a, b)

    def __matmul__(a, b):
        return _slot2(SLOT_MATMUL, a, b)

    def __neg__(self):
        op = _SLOT_OPS[SLOT_NEG]
        if type(op) is FastOp:
            return (<FastOp>op).call1(self)
        if op is None:
            raise TypeError("DTensor: unary - is not available (no op 'neg' registered)")
        return op(self)


cdef enum:
    SLOT_ADD = 0
    SLOT_SUB = 1
    SLOT_MUL = 2
    SLOT_TRUEDIV = 3
    SLOT_MATMUL = 4
    SLOT_NEG = 5

# Operator tag (as in ``__add__``) -> index into _SLOT_OPS.
SLOT_TAGS = {"add": SLOT_ADD, "sub": SLOT_SUB, "mul": SLOT_MUL, "truediv": SLOT_TRUEDIV,
             "matmul": SLOT_MATMUL, "neg": SLOT_NEG}
cdef list _SLOT_OPS = [None] * 6


def set_slot_ops(dict ops):
    """Register what runs behind each operator slot of :class:`DTensorBase` (``{tag: op}``,
    tags as in :data:`SLOT_TAGS`): a :class:`FastOp`, or a Python callable taking the
    operands in expression order (the Python path); missing tags make the operator
    unsupported. **Local**."""
    for tag, k in SLOT_TAGS.items():
        _SLOT_OPS[k] = ops.get(tag)


cdef inline object _slot2(int k, object a, object b):
    op = _SLOT_OPS[k]
    if type(op) is FastOp:
        return (<FastOp>op).call2(a, b)
    if op is None:
        return NotImplemented
    return op(a, b)


# -- what dtensor plugs in ------------------------------------------------------------------
cdef object _Tensor = None           # dtensor.Tensor (a TensorBase subclass)
cdef object _DTensor = None          # dtensor.DTensor (a DTensorBase subclass)
cdef dict _dtypes_ns = None          # dtensor._dtypes' namespace (``_default_float``)
cdef object _lookup = None           # _dispatch.lookup(info, values) -> (entry, key, mesh)
cdef object _dispatch_py = None      # _dispatch.dispatch(info, args, kwargs)
cdef object _run_entry = None        # _dispatch.run_entry(entry, values, mesh)
cdef object _wrap_outputs = None     # _dispatch._wrap_outputs(out, specs)
cdef object _raw_form = None         # _dispatch.raw_form(info, entry, values) -> tuple|None
cdef object _MISSING = None          # the binder's "no default" marker
cdef object _UNSUP = object()        # a tensor-like argument the front does not key
cdef object _DECLINE = object()      # _serve's answer when the Python dispatcher must run
cdef tuple _SIMPLE = (int, float, bool, str, type(None), type(Ellipsis), type)

# counters and the LRU touches pending for the Python cache
cdef unsigned long long _hits = 0
cdef unsigned long long _fills = 0
cdef unsigned long long _tick = 0
cdef long _generation = 0
cdef list _pending = []


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


cdef inline object _new_tensor(object arr, object storage):
    cdef TensorBase t = TensorBase.__new__(_Tensor)
    t._arr = arr
    t._storage = storage
    t._std = None
    return t


cdef inline object _new_dtensor(object local, object spec):
    cdef DTensorBase d = DTensorBase.__new__(_DTensor)
    d._loc = local
    d._spec = spec
    return d


cdef inline object _new_dtensor_arr(object arr, object spec):
    """A DTensor whose local Tensor (over ``arr``, Storage derived on use) is made lazily."""
    cdef DTensorBase d = DTensorBase.__new__(_DTensor)
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


# -- LRU bookkeeping and counters -----------------------------------------------------------
def invalidate():
    """Forget every front entry (the Python cache evicted or dropped entries). **Local**."""
    global _generation
    _generation += 1


def _tick_of(fe):
    return (<FrontEntry>fe).tick


def flush(data):
    """Replay the pending LRU touches of front hits on the Python cache ``data`` (an
    OrderedDict), oldest first. **Local**."""
    global _pending
    if not _pending:
        return
    pending = _pending
    _pending = []
    pending.sort(key=_tick_of)
    cdef FrontEntry fe
    for fe in pending:
        fe.pending = False
        if data.get(fe.key) is fe.entry:
            data.move_to_end(fe.key)


def stats():
    """``{"hits": front hits, "fills": front entries made}`` since the last reset. **Local**."""
    return {"hits": _hits, "fills": _fills}


def reset_stats():
    """Zero the counters of :func:`stats` (the Python cache was cleared). **Local**."""
    global _hits, _fills
    _hits = 0
    _fills = 0


# -- keys -----------------------------------------------------------------------------------
cdef inline object _marker(object v):
    """The key marker of a tensor-like argument, or _UNSUP (the Python path handles it)."""
    t = type(v)
    if t is _DTensor:
        return (<DTensorBase>v)._spec
    if t is float or t is int or t is bool or t is complex:
        return t
    if v is None:
        return None
    return _UNSUP


cdef bint _simple(object v):
    """Whether a static value can be compared without surprises (no arrays, no tensors)."""
    t = type(v)
    if t is tuple or t is list:
        for e in v:
            if not _simple(e):
                return False
        return True
    if t is slice:
        return _simple(v.start) and _simple(v.stop) and _simple(v.step)
    return isinstance(v, _SIMPLE) or type(t).__name__ == "_DTypeMeta" or t.__name__ == "dtype"


cdef inline uintptr_t _addr(object v):
    return <uintptr_t><PyObject*>v


cdef inline uintptr_t _hash(object v) except? 0:
    cdef Py_hash_t h = hash(v)
    return <uintptr_t>h


cdef uintptr_t _shash(object v) except? 0:
    """A hash of a simple static value (slot choice only; equality decides)."""
    cdef uintptr_t h
    t = type(v)
    if t is int or t is bool:
        return _hash(v)
    if t is tuple or t is list:
        h = 0x345678
        for e in v:
            h = (h ^ _shash(e)) * <uintptr_t>1000003
        return h
    if t is slice:
        return (_shash(v.start) * 31 + _shash(v.stop)) * 31 + _shash(v.step)
    if v is None or t is type:
        return _addr(v)
    return _hash(v)


cdef object _frozen(object v):
    """A static value as the front stores it: lists become tuples (a caller may mutate a
    list after the call; the stored value must not change with it)."""
    t = type(v)
    if t is tuple or t is list:
        return tuple([_frozen(e) for e in v])
    return v


cdef bint _same(object v, object stored) except -1:
    """Whether a static value equals a stored (frozen) one: a list matches the tuple it
    freezes to, otherwise the types must agree all the way down and the values be equal."""
    if v is stored:
        return True
    t = type(v)
    ts = type(stored)
    if t is list or t is tuple:
        if ts is not tuple or len(v) != len(<tuple>stored):
            return False
        for x, y in zip(v, <tuple>stored):
            if not _same(x, y):
                return False
        return True
    if t is not ts:
        return False
    if t is slice:
        return (_same(v.start, stored.start) and _same(v.stop, stored.stop)
                and _same(v.step, stored.step))
    return bool(v == stored)


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
    cdef object out_spec0
    cdef tuple out_specs
    cdef int raw
    cdef object rawfn
    cdef object rawarg
    cdef tuple extra_idx    # bound values the raw form needs unchanged: their indices
    cdef tuple extra_val    # ... and values
    cdef unsigned long long tick
    cdef bint pending


cdef inline FrontEntry _touch(FrontEntry fe):
    """Count a front hit of ``fe`` and queue its LRU touch for the Python cache."""
    global _hits, _tick
    _hits += 1
    _tick += 1
    fe.tick = _tick
    if not fe.pending:
        fe.pending = True
        _pending.append(fe)
    return fe


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

    def __init__(self, info, binder):
        self.info = info
        self.name = info.name
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
        b = sizes[0] if len(sizes) == 1 and isinstance(sizes[0], (list, tuple)) else sizes
        cdef list values = self._bind_n(a, b, 2)
        if values is None:
            return self.call((a,) + sizes, None)
        out = self._serve(values)
        if out is _DECLINE:
            return _dispatch_py(self.info, (a,) + sizes, {})
        return out

    cdef object call(self, tuple args, dict kwargs):
        """Run the op on ``args``/``kwargs`` (at least one DTensor among them)."""
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
        fe.direct = entry.direct
        fe.out_specs = tuple(entry.out_specs)
        fe.out_spec0 = fe.out_specs[0] if fe.out_specs else None
        raw = _raw_form(self.info, entry, values)
        fe.extra_idx = fe.extra_val = ()
        if raw is None:
            fe.raw = RAW_NONE
        else:
            fe.raw, fe.rawfn, extra = raw[:3]
            fe.rawarg = raw[3] if len(raw) > 3 else None
            fe.extra_idx = tuple([i for i, _ in extra])
            fe.extra_val = tuple([v for _, v in extra])
        fe.tick = 0
        fe.pending = False
        _fills += 1
        return fe


cdef inline object _local_arr(object v):
    cdef DTensorBase d = <DTensorBase>v
    if d._loc is None:
        return d._larr
    return (<TensorBase?>d._loc)._arr


cdef object _raw_pair(FrontEntry fe, object a, object b):
    """A binary or scalar raw form on operands ``a`` (a DTensor) and ``b``; None when the
    kernel must decide (an int the dtype cannot hold)."""
    if fe.raw == RAW_BINARY:
        out = fe.rawfn(_local_arr(a), _local_arr(b))
    else:
        try:
            out = fe.rawfn(_local_arr(a), b)
        except OverflowError:
            return None
    return _new_dtensor_arr(out, fe.out_spec0)


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
    if raw == RAW_UNARY:
        f = fe.rawfn
        if type(f) is Unary:  # a compiled kernel: its C entry, no Python call
            return _new_dtensor_arr((<Unary>f).apply(_local_arr(values[0]), None), fe.out_spec0)
        return _new_dtensor_arr(f(_local_arr(values[0]), None), fe.out_spec0)
    if raw == RAW_REDUCE:
        axes, dtype, keepdim, scale = <tuple>fe.rawarg
        out = fe.rawfn(_local_arr(values[0]), axes, dtype, None, keepdim)
        if type(out) is not _ndarray:  # a numpy scalar of a full reduction: 0-d array
            if scale is not None:
                out = out * scale
            out = _asarray(out)
        elif scale is not None:
            out *= scale
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
        return _new_dtensor(_new_tensor(t._arr.T, t._storage), fe.out_spec0)
    elif raw == RAW_GETITEM:
        # Tensor.__getitem__'s result for a basic index: numpy's view, when not empty
        t = <TensorBase?>_get_local(<DTensorBase>values[0])
        out = t._arr[fe.rawfn]
        if out.size:
            return _new_dtensor(_new_tensor(out, t._storage), fe.out_spec0)
    cdef tuple direct = fe.direct
    if direct is None:
        return _run_entry(fe.entry, values, fe.mesh)
    cdef Py_ssize_t pi
    for pi in direct:
        v = values[pi]
        if type(v) is _DTensor:
            values[pi] = _get_local(<DTensorBase>v)
    out = fe.kernel(*values)
    if type(out) is _Tensor:
        return _new_dtensor(out, fe.out_spec0)
    return _wrap_outputs(out, fe.out_specs)


# -- entry points installed on DTensor and in dtensor's namespace ----------------------------
cdef bint _has_dtensor(tuple args, dict kwargs):
    for a in args:
        if isinstance(a, _DTensor):
            return True
        t = type(a)
        if t is list or t is tuple:
            for e in a:
                if isinstance(e, _DTensor):
                    return True
    if kwargs:
        return _has_dtensor(tuple(kwargs.values()), None)
    return False


def make_method(FastOp op, str name, str doc):
    """A DTensor method running ``op`` with ``self`` first. **Local** to build."""
    if op.pack_idx == 1:  # view(*shape)-style: the positionals are the packed value
        def method(self, *args, **kwargs):
            if not kwargs:
                return op.call_sizes(self, args)
            return op.call((self,) + args, kwargs)
    else:
        def method(self, *args, **kwargs):
            if not kwargs:
                if not args:
                    return op.call1(self)
                if len(args) == 1:
                    return op.call2(self, args[0])
            return op.call((self,) + args, kwargs)

    method.__name__ = name
    method.__qualname__ = f"DTensor.{name}"
    method.__doc__ = doc
    return method


def make_operator(FastOp op, str name, str doc, str form):
    """A DTensor operator: ``form`` is 'binary', 'reflected', 'compare', 'unary' or 'where'."""
    if form == "binary":
        def fn(self, other):
            return op.call2(self, other)
    elif form == "reflected":
        def fn(self, other):
            return op.call2(other, self)
    elif form == "compare":
        def fn(self, other):
            t = type(other)
            if not (t is _DTensor or t is float or t is int or t is bool or t is complex
                    or isinstance(other, (_DTensor, _Tensor, bool, int, float, complex))):
                return NotImplemented
            return op.call2(self, other)
    elif form == "unary":
        def fn(self):
            return op.call1(self)
    elif form == "where":
        def fn(self, condition, other):
            return op.call((condition, self, other), None)
    else:
        raise ValueError(f"make_operator: unknown form {form!r}")
    fn.__name__ = name
    fn.__qualname__ = f"DTensor.{name}"
    fn.__doc__ = doc
    return fn


def make_function(FastOp op, local):
    """A public function: ``op`` when a DTensor is among the arguments, else ``local``."""
    def fn(*args, **kwargs):
        if _has_dtensor(args, kwargs):
            return op.call(args, kwargs)
        return local(*args, **kwargs)

    return fn
