# Cache keys: the marker of a tensor-like argument, which static values the front keys,
# their hashes (slot choice only) and the frozen form and equality of stored statics.

cdef object _UNSUP = object()        # a tensor-like argument the front does not key
cdef tuple _SIMPLE = (int, float, bool, str, type(None), type(Ellipsis), type)


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


class _FrozenList(tuple):
    """A static list as the front stores it: a tuple that remembers it was a list."""

    __slots__ = ()


cdef object _frozen(object v):
    """A static value as the front stores it: lists and tuples become tuples (a caller may
    mutate a list after the call; the stored value must not change with it), a top-level
    list a _FrozenList (``x[[0, 2]]`` indexes differently from ``x[0, 2]``)."""
    t = type(v)
    if t is list:
        return _FrozenList([_frozen_inner(e) for e in v])
    return _frozen_inner(v)


cdef object _frozen_inner(object v):
    t = type(v)
    if t is tuple or t is list:
        return tuple([_frozen_inner(e) for e in v])
    return v


cdef bint _same(object v, object stored) except -1:
    """Whether a static value equals a stored (frozen) one: a top-level list matches only a
    stored list and a tuple only a tuple; inside them a list matches the tuple it freezes
    to; otherwise the types must agree all the way down and the values be equal."""
    if v is stored:
        return True
    t = type(v)
    if t is list and type(stored) is not _FrozenList:
        return False
    if t is tuple and type(stored) is not tuple:
        return False
    return _same_inner(v, stored)


cdef bint _same_inner(object v, object stored) except -1:
    if v is stored:
        return True
    t = type(v)
    ts = type(stored)
    if t is list or t is tuple:
        if not isinstance(stored, tuple) or len(v) != len(<tuple>stored):
            return False
        for x, y in zip(v, <tuple>stored):
            if not _same_inner(x, y):
                return False
        return True
    if t is not ts:
        return False
    if t is slice:
        return (_same_inner(v.start, stored.start) and _same_inner(v.stop, stored.stop)
                and _same_inner(v.step, stored.step))
    return bool(v == stored)
