# The entry points installed on DTensor and in dtensor's namespace: methods, operators
# and public functions that call a FastOp (make_method, make_operator, make_function).

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
    """A public function: ``op`` when a DTensor is among the arguments, else ``local``;
    through the recorder when it may record (autograd active, an argument with autograd
    state, grad mode on) and through the autograd hook for an in-place op (which counts its
    writes). On the Python path (:func:`set_flags`) the hook gets the Python dispatcher's
    call."""
    def plain(*args, **kwargs):
        if _has_dtensor(args, kwargs):
            return op.call(args, kwargs)
        return local(*args, **kwargs)

    def py_plain(*args, **kwargs):
        if _has_dtensor(args, kwargs):
            return _dispatch_py(op.info, args, kwargs)
        return local(*args, **kwargs)

    def fn(*args, **kwargs):
        if _autograd_on and (op.inplace or (_grad_mode.enabled and _any_tensor_ag(args, kwargs))):
            if _python_path:
                return _call_hook(op.info, py_plain, args, kwargs)
            if op.inplace:
                return _call_hook(op.info, plain, args, kwargs)
            return _hooked(op.info, plain, args, kwargs)
        if _has_dtensor(args, kwargs):
            return op.call(args, kwargs)
        return local(*args, **kwargs)

    return fn


cdef inline bint _tensor_ag(object a):
    """Whether ``a`` is a Tensor or DTensor with autograd state."""
    if isinstance(a, TensorBase):
        return (<TensorBase>a)._ag is not None
    if isinstance(a, DTensorBase):
        return (<DTensorBase>a)._ag is not None
    return False


cdef bint _any_tensor_ag(tuple args, dict kwargs):
    for a in args:
        if _tensor_ag(a):
            return True
        t = type(a)
        if t is list or t is tuple:
            for e in a:
                if _tensor_ag(e):
                    return True
    if kwargs:
        for a in kwargs.values():
            if _tensor_ag(a):
                return True
    return False


def make_recording(info, plain, order, recorder):
    """``plain`` (a method or operator of op ``info``) guarded for autograd (a ``Guard``,
    which calls ``plain`` itself until autograd is active, :func:`set_flags`): when grad mode
    is on and a Tensor or DTensor argument has
    autograd state, the compiled recorder or else ``recorder(info, plain, args, kwargs,
    order)``; always the latter for an in-place op (whose writes the recorder counts); else
    ``plain`` itself. **Local**."""
    cdef bint inplace = bool(info.inplace)

    def variant(*args, **kwargs):
        if inplace:
            return recorder(info, plain, args, kwargs, order)
        if _grad_mode.enabled and _any_tensor_ag(args, kwargs):
            return _hooked(info, plain, args, kwargs, order, recorder)
        return plain(*args, **kwargs)

    return _guard(plain, variant)
