"""The entry points of the op table, built once at import: Tensor and DTensor methods,
python operators, and the public dispatching functions.

At import this module (the one place that adds methods to :class:`Tensor` and
:class:`DTensor`) reads every record of :data:`dtensor.ops.OPS` and installs, through one
composition (a record's variant, then the dispatcher or the local call):

- on Tensor, the record's local method form (unless the Tensor class defines the method
  itself: ``view``, ``clone``, ``to``...; then that one), its aliases, and the local side of
  its python operators (``+``, ``-``, comparisons, reflected and in-place forms, ``~``,
  ``@``), each in its *recording form* when the op records (differentiable or in place):
  a guard that runs the variant itself until autograd is active;
- on DTensor, a dispatching method of the same name and the dispatching operators
  (``x[...]`` included) and the ``T``/``mT`` properties;
- ``nonzero`` and ``masked_select`` (:mod:`dtensor.dispatch.data_dependent`: data-dependent
  shapes, no rule) on both classes;
- for every record with a public function, a dispatching twin of it (``dt.add``,
  ``dt.sum``...): with no DTensor among its arguments it calls the local function unchanged;
  otherwise it dispatches (:func:`dtensor.dispatch.dispatcher.dispatch`). ``dtensor``
  exports these (:func:`export`).

Nothing is installed again at run time. Every entry point reads two flags per call, as
the compiled front's do: whether autograd is active (the first tensor that requires grad
turns it on, :func:`dtensor.local.grad_engine.activate`; until then nothing of autograd runs)
and whether DTensor ops take the compiled front or the Python dispatcher
(:func:`set_fastpath`). With the compiled front (:mod:`dtensor.dispatch.compiled`) the
DTensor entry points and the public functions are its compiled ones (a FastOp runs the
Python path while that flag says so), and the Tensor guards are compiled; without it they
are the Python twins below. So a function taken early (``add = dt.add``) stays current.

The local variants of an op that computes run with numpy's floating-point errors ignored
(:attr:`dtensor.ops.table.OpInfo.quiet`): those that do not see to it themselves are
installed wrapped (:func:`dtensor.local.kernels.base.quiet_function`).

The class docstrings of Tensor and DTensor end with the list of what was installed.
Comparisons return tensors, so ``__hash__`` stays the identity hash (as in PyTorch).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

from placements.errors import UnavailableError

from ..distributed.dtensor import DTensor
from ..distributed.factory import FACTORIES
from ..local import grad_engine as _ag
from ..local.kernels.base import quiet_function
from ..local.tensor import Tensor
from ..ops import NOT_DIFFERENTIABLE, OPS, OpInfo
from . import compiled as _compiled
from . import tape as _tape
from .data_dependent import DATA_DEPENDENT
from .dispatcher import dispatch, use_compiled_moves

__all__ = [
    "FUNCTIONS",
    "export",
    "fastpath_active",
    "function",
    "has_dtensor",
    "installed",
    "set_fastpath",
]

_TENSOR_LIKE = (DTensor, Tensor, bool, int, float, complex)


def has_dtensor(args: tuple, kwargs: Mapping[str, object] | None) -> bool:
    """Whether a DTensor is among the arguments (also inside list/tuple arguments). **Local**."""
    for a in args:
        if isinstance(a, DTensor):
            return True
        if type(a) is list or type(a) is tuple:
            for e in a:
                if isinstance(e, DTensor):
                    return True
    if kwargs:
        return has_dtensor(tuple(kwargs.values()), None)
    return False


_FUNCTION_DOC = (
    "\n\nAccepts DTensors too (**Collective** when an input must be redistributed for "
    "the chosen sharding strategy, **Local** otherwise)."
)
_METHOD_DOC = (
    "``{}`` on a DTensor; placements are inferred by its sharding rule. "
    "**Collective** when an input must be redistributed, **Local** otherwise."
)
_OPERATOR_DOC = {
    "binary": "``self {d} other``: :func:`{op}`.",
    "reflected": "``other {d} self``: :func:`{op}` (other, self).",
    "compare": "Elementwise :func:`{op}`, a bool tensor.",
    "unary": ":func:`{op}` of the tensor.",
    "method": ":func:`{op}` (``{d}``).",
    "where": ":func:`{op}` (``{d}``).",
}

#: Where the op's arguments are in an operator's ``(self, other)``, by form (None: in order).
_OPERATOR_ORDER = {"reflected": (1, 0)}

_FRONT = _compiled.FRONT
_MODE = _ag.MODE


# -- the one composition: a record's variant -> dispatcher or local call ---------------------------
def _quiet(info: OpInfo, fn: Callable) -> Callable:
    """``fn`` (a local variant of ``info``), made to run with numpy's floating-point errors
    ignored when the op computes (:attr:`OpInfo.quiet`) and ``fn`` does not see to it."""
    return quiet_function(fn) if info.quiet else fn


def _records(info: OpInfo) -> bool:
    """Whether the variants of ``info`` take their recording form (the op is
    differentiable or in place)."""
    return info.inplace or info.backward is not NOT_DIFFERENTIABLE


def _py_call(info: OpInfo) -> Callable:
    """``call(args, kwargs)``: the op on arguments in its own order with at least one
    DTensor, on the Python dispatcher, through the recorder once autograd is active (the
    Python twin of a FastOp's call)."""

    def plain(*args: object, **kwargs: object) -> object:
        return dispatch(info, args, kwargs)

    inplace = info.inplace

    def call(args: tuple, kwargs: Mapping[str, object]) -> object:
        if _tape._ACTIVE and (inplace or (_MODE.enabled and _tape._wants_grad(args, kwargs))):
            return _tape.call(info, plain, args, kwargs)
        return dispatch(info, args, kwargs)

    return call


def _entry(info: OpInfo, form: str, name: str) -> Callable:
    """The DTensor entry point ``name`` of ``info``: ``form`` says how its arguments map to
    the op's (``method``: ``self`` first; ``where``: ``x.where(cond, y)`` is ``where(cond,
    x, y)``; ``reordered``: per ``method_args``; ``binary``, ``reflected``, ``compare``,
    ``unary``: the operators). The compiled front's when it is there, else the Python twin.
    """
    if form == "where" and _FRONT is None:
        form = "reordered"
    if form in ("method", "reordered"):
        doc = _METHOD_DOC.format(info.name)
    else:
        doc = _OPERATOR_DOC[form].format(d=name, op=info.name)
    if _FRONT is not None and form != "reordered":
        if form == "method":
            return _compiled.make_method(info, name, doc)
        return _compiled.make_operator(info, name, doc, form)
    call = _py_call(info)
    order = info.method_args
    if form == "method":
        def fn(self: DTensor, *args: object, **kwargs: object) -> object:
            return call((self, *args), kwargs)
    elif form == "reordered":
        def fn(self: DTensor, *args: object) -> object:
            return call(_reorder(order, (self, *args)), {})
    elif form == "binary":
        def fn(self: DTensor, other: object) -> object:
            return call((self, other), {})
    elif form == "reflected":
        def fn(self: DTensor, other: object) -> object:
            return call((other, self), {})
    elif form == "compare":
        def fn(self: DTensor, other: object) -> object:
            if not isinstance(other, _TENSOR_LIKE):
                return NotImplemented
            return call((self, other), {})
    else:  # unary
        def fn(self: DTensor) -> object:
            return call((self,), {})
    fn.__name__ = name
    fn.__qualname__ = f"DTensor.{name}"
    fn.__doc__ = doc
    return fn


def function(info: OpInfo, local: Callable | None = None) -> Callable:
    """The public dispatching function of ``info``: ``local`` (default: the record's
    public local function) on local tensors, the dispatcher with a DTensor among the
    arguments, through the recorder when the call records. **Local** to build."""
    src = info.function if local is None else local
    local = _quiet(info, src)
    if _FRONT is not None:
        fn = _compiled.make_function(info, local)
    else:
        call = _py_call(info)

        def fn(*args: object, **kwargs: object) -> object:
            if has_dtensor(args, kwargs):
                return call(args, kwargs)
            if _tape._ACTIVE:
                return _tape.call(info, local, args, kwargs)
            return local(*args, **kwargs)

    functools.update_wrapper(fn, src)
    fn.__doc__ = (src.__doc__ or "") + _FUNCTION_DOC
    return fn


def _local(info: OpInfo, fn: Callable, order: tuple[int, ...] | None = None) -> Callable:
    """The Tensor variant ``fn`` of ``info`` (its arguments the op's, reordered by
    ``order``), in its recording form when the op records."""
    if not _records(info):
        return fn
    make = _compiled.make_recording if _FRONT is not None else None
    return _tape.recording(info, fn, order, make)


def _reorder(order: tuple[int, ...], args: tuple) -> tuple:
    return tuple(args[i] for i in order)


def _tensor_method(info: OpInfo) -> Callable:
    """The local Tensor method of ``info`` (its method form, reordered per method_args)."""
    fn, order = info.method, info.method_args
    if order is None:
        return _quiet(info, fn)

    def method(self: Tensor, *args: object) -> object:
        return fn(*_reorder(order, (self, *args)))

    method.__name__ = method.__qualname__ = info.name
    method.__doc__ = fn.__doc__
    return _quiet(info, method)


# -- installing ---------------------------------------------------------------------------------
def _T(self: DTensor) -> DTensor:
    """The tensor with its dims reversed (``t()`` for 2-D). **Local** (a view per shard)."""
    return self.permute(*range(self.ndim - 1, -1, -1))


def _mT(self: DTensor) -> DTensor:
    """The last two dims swapped. **Local** (a view per shard)."""
    return self.transpose(-2, -1)


def _install_dtensor() -> list[str]:
    """Install DTensor's methods and operators; returns their names."""
    names = []
    slots = _compiled.slot_served()
    for info in OPS.values():
        if info.method is not None:
            if info.method_args is None:
                form = "method"
            elif info.method_args == (1, 0, 2):
                form = "where"
            else:
                form = "reordered"
            for name in (info.name, *info.aliases):
                if name not in _OWN_DTENSOR:
                    setattr(DTensor, name, _entry(info, form, name))
                    names.append(name)
        for op in info.operators:
            if op.dunder not in slots:
                setattr(DTensor, op.dunder, _entry(info, op.form, op.dunder))
            names.append(op.dunder)
    DTensor.__hash__ = object.__hash__
    # a one-step plan runs from compiled code (the compiled front's redistribute, which
    # runs the Python method itself on the Python path and for a tensor that records)
    if _compiled.COMPILED_REDISTRIBUTE is not None:
        DTensor.redistribute = _compiled.COMPILED_REDISTRIBUTE
    DTensor.T = property(_T)
    DTensor.mT = property(_mT)
    return names


def _tensor_mT(self: Tensor) -> Tensor:
    # Tensor's own property raises PyTorch's error below 2-D
    return self.transpose(-2, -1) if self.ndim >= 2 else _OWN_TENSOR["mT"].fget(self)


def _install_tensor() -> list[str]:
    """Install Tensor's methods and operators from the table (the class's own methods of
    ops that record in their recording form); returns their names."""
    names = []
    for info in OPS.values():
        if info.method is not None:
            for name in (info.name, *info.aliases):
                if name not in _OWN_TENSOR:
                    setattr(Tensor, name, _local(info, _tensor_method(info), info.method_args))
                    names.append(name)
                elif _records(info):
                    setattr(Tensor, name, _local(info, _OWN_TENSOR[name]))
        for op in info.operators:
            if op.dunder not in _OWN_TENSOR:
                order = _OPERATOR_ORDER.get(op.form)
                setattr(Tensor, op.dunder, _local(info, _quiet(info, op.local), order))
                names.append(op.dunder)
            elif _records(info):
                setattr(Tensor, op.dunder, _local(info, _OWN_TENSOR[op.dunder]))
    # the views T and mT through the recorded permute and transpose, once they record
    Tensor.T = _tape.recording_view_property(_OWN_TENSOR["T"], _T)
    Tensor.mT = _tape.recording_view_property(_OWN_TENSOR["mT"], _tensor_mT)
    Tensor.__setitem__ = _tape.recording_setitem(_OWN_TENSOR["__setitem__"])
    # ``==`` returns a Tensor, so hashing is by identity (as in PyTorch).
    Tensor.__hash__ = object.__hash__
    return names


def _document(cls: type, base_doc: str | None, names: list[str]) -> None:
    methods = sorted(n for n in set(names) if not n.startswith("__"))
    operators = sorted(n for n in set(names) if n.startswith("__"))
    cls.__doc__ = (
        (base_doc or "").rstrip()
        + "\n\n    Installed from the op table (:mod:`dtensor.ops`) at import:\n\n"
        + "    Methods: " + ", ".join(methods) + ".\n\n"
        + "    Operators: " + ", ".join(operators) + ".\n"
    )


# -- the flags ----------------------------------------------------------------------------------
def set_fastpath(enabled: bool) -> bool:
    """Serve DTensor ops from the compiled front (True) or the Python dispatcher (False).

    **Local.** Sets the flag every DTensor entry point and public function reads per call
    (nothing is installed again: a function taken earlier follows too); results and cache
    behaviour are the same either way. Call it on every rank (the paths differ in speed
    only). Turning it on needs the extension built and ``DTENSOR_FASTPATH`` not ``0`` at
    import.

    Returns
    -------
    bool
        Whether the compiled front is now active.

    Raises
    ------
    UnavailableError
        When asked to enable a fast path that is not available (a ConfigError and a
        RuntimeError).
    """
    global _FAST
    if enabled and _FRONT is None:
        raise UnavailableError(
            f"set_fastpath(True): the compiled fast path is not available ({_compiled.why_off()})"
        )
    _FAST = bool(enabled)
    _compiled.set_flags(python_path=not _FAST)
    # an op's one-step move of an input runs from compiled code on the fast path
    use_compiled_moves(_compiled.MOVE_LOCAL if _FAST else None)
    return _FAST


def _activate_autograd() -> None:
    """Turn the recording forms on (called once, when the first tensor requires grad)."""
    _tape.set_active()
    _compiled.set_flags(autograd=True)


def fastpath_active() -> bool:
    """Whether DTensor ops are served from the compiled front now. **Local**."""
    return _FAST


def export(namespace: dict) -> None:
    """Put the public dispatching functions into ``namespace`` (a module's globals, e.g.
    ``dtensor``'s). **Local**."""
    namespace.update(FUNCTIONS)


def installed() -> dict[str, tuple[str, ...]]:
    """What this module installed: ``{"Tensor": names, "DTensor": names, "functions":
    names}``, sorted. **Local**."""
    return {
        "Tensor": tuple(sorted(set(_TENSOR_NAMES))),
        "DTensor": tuple(sorted(set(_DTENSOR_NAMES))),
        "functions": tuple(sorted(FUNCTIONS)),
    }


_compiled.plug()
_FAST = False
_OWN_TENSOR = dict(vars(Tensor))
_OWN_DTENSOR = frozenset(vars(DTensor))
_TENSOR_DOC, _DTENSOR_DOC = Tensor.__doc__, DTensor.__doc__
_TENSOR_NAMES = _install_tensor()
_DTENSOR_NAMES = _install_dtensor()
for _gname, _gfn in DATA_DEPENDENT.items():  # data-dependent shapes, outside the table
    setattr(Tensor, _gname, _gfn)
    setattr(DTensor, _gname, _gfn)
_TENSOR_NAMES += list(DATA_DEPENDENT)
_DTENSOR_NAMES += list(DATA_DEPENDENT)
_document(Tensor, _TENSOR_DOC, _TENSOR_NAMES)
_document(DTensor, _DTENSOR_DOC, _DTENSOR_NAMES)
#: The public dispatching functions, by op name (built once; ``dtensor`` exports them).
FUNCTIONS: dict[str, Callable] = {
    name: function(info) for name, info in OPS.items() if info.function is not None
}
_tape.use_functions(FUNCTIONS)  # the backward formulas' ``fns``
_tape.use_functions(FACTORIES)
set_fastpath(_FRONT is not None)
_ag.on_activate(_activate_autograd)
