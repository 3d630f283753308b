# The compiled bases of Tensor and DTensor and DTensor's operator slots: the table of
# what runs behind each slot (set_slot_ops) and the slot function that calls it; dtensor's
# grad mode and the autograd hook every compiled entry point asks (set_call_hook).

# Note: the bases are not tracked by the cycle collector (they hold only a fixed set of
# references that never lead back to the object), which makes creating them cheaper.
@cython.no_gc
cdef class TensorBase:
    """Compiled slots of the local Tensor: its ndarray, its cached layout flag, its Storage,
    its autograd state (None for a tensor without one)."""

    cdef public object _arr
    cdef public object _std
    cdef public object _storage
    cdef public object _ag
    cdef object __weakref__


@cython.no_gc
cdef class DTensorBase:
    """Compiled slots of DTensor: its local Tensor, its spec and its autograd state.

    Its arithmetic operators are C slots that run the ops registered by
    :func:`set_slot_ops` (``x + y`` then enters compiled code directly); a subclass that
    defines the operator itself (the Python path) overrides them.
    """

    cdef object _loc        # the local Tensor, or None while only its array exists
    cdef object _larr       # the local ndarray of an output whose Tensor is not made yet
    cdef public object _spec
    cdef public object _ag      # the autograd state (None for a DTensor without one)
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


cdef class GradMode:
    """Whether ops record for autograd (dtensor's grad mode; compiled code reads it)."""

    cdef public bint enabled

    def __init__(self):
        self.enabled = True


# dtensor's autograd recorder ``hook(info, plain, args, kwargs)`` and grad mode (plugged in
# at import), and the two flags every entry point reads per call: whether autograd is active
# (the first tensor that requires grad turns it on; before, the entry points never look
# further) and whether the Python path serves DTensor ops (``set_fastpath(False)``).
cdef object _call_hook = None
cdef GradMode _grad_mode = None
cdef bint _autograd_on = False
cdef bint _python_path = False


def set_flags(autograd=None, python_path=None):
    """Set the flags the entry points read per call (None: unchanged). ``autograd``: calls
    that may record go through the recorder (every public function made by
    :func:`make_function`, and every FastOp call with a DTensor argument that has autograd
    state while grad mode is on, or of an in-place op, whose writes the hook counts).
    ``python_path``: FastOps, the public functions and the compiled ``redistribute`` run the
    Python dispatcher instead of the compiled front. Returns ``(autograd, python_path)``.
    **Local**."""
    global _autograd_on, _python_path
    if autograd is not None:
        if autograd and _call_hook is None:
            raise RuntimeError("fastpath.set_flags: the autograd hook is not plugged in")
        _autograd_on = bool(autograd)
    if python_path is not None:
        _python_path = bool(python_path)
    return _autograd_on, _python_path
