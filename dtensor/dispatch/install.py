"""Installation from the op table: Tensor and DTensor methods, python operators, and the
public dispatching functions.

At import this module (the one place that adds methods to :class:`Tensor` and
:class:`DTensor`) reads every record of :data:`dtensor.ops.OPS` and installs:

- on Tensor, the record's local method form (unless the Tensor class defines the method
  itself: ``view``, ``clone``, ``to``...), its aliases, and the local side of its python
  operators (``+``, ``-``, comparisons, reflected and in-place forms, ``~``, ``@``);
- on DTensor, a dispatching method of the same name and the dispatching operators
  (``x[...]`` included) and the ``T``/``mT`` properties;
- ``nonzero`` and ``masked_select`` (:mod:`dtensor.dispatch.gathering`: data-dependent
  shapes, no rule) on both classes;
- for every record with a public function, a dispatching twin of it (``dt.add``,
  ``dt.sum``...): with no DTensor among its arguments it calls the local function unchanged;
  otherwise it dispatches (:func:`dtensor.dispatch.dispatcher.dispatch`). ``dtensor``
  exports these (:func:`export`).

The local variants of an op that computes run with numpy's floating-point errors ignored
(:attr:`dtensor.ops.table.OpInfo.quiet`): those that do not see to it themselves are
installed wrapped (:func:`dtensor.local.kernels.base.quiet_function`).

The class docstrings of Tensor and DTensor end with the list of what was installed.
Comparisons return tensors, so ``__hash__`` stays the identity hash (as in PyTorch).

Autograd: once a tensor requires grad (:func:`dtensor.local.autograd.activate`), Tensor's
methods and operators (``T``, ``mT`` and ``__setitem__`` included) and, on the Python
path, DTensor's are installed again in their recording form
(:func:`dtensor.dispatch.record.recording`; out-of-place ops marked not differentiable stay
as they are), ``DTensor.redistribute`` records, and the compiled front (its FastOps and
the public functions) asks :func:`dtensor.dispatch.record.call` (its hook) for the calls
that may record: until then nothing of autograd runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

import fastpath as _fp
from placements.errors import UnavailableError

from ..distributed.dtensor import DTensor
from ..distributed.factory import FACTORIES
from ..local import autograd as _ag
from ..local.kernels.base import quiet_function
from ..local.tensor import Tensor
from ..ops import NOT_DIFFERENTIABLE, OPS, Operator, OpInfo
from . import record as _record
from .dispatcher import dispatch, use_compiled_moves
from .front import PY_REDISTRIBUTE, fast_op, plug_fastpath
from .gathering import GATHERING

__all__ = ["export", "fastpath_active", "has_dtensor", "installed", "set_fastpath"]

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
}


# -- public functions --------------------------------------------------------------------------
def _quiet(info: OpInfo, fn: Callable) -> Callable:
    """``fn`` (a local variant of ``info``), made to run with numpy's floating-point errors
    ignored when the op computes (:attr:`OpInfo.quiet`) and ``fn`` does not see to it."""
    return quiet_function(fn) if info.quiet else fn


def _function(info: OpInfo) -> Callable:
    local = _quiet(info, info.function)
    if _FAST:
        fn = _front.make_function(fast_op(info), local)
    else:

        def plain(*args: object, **kwargs: object) -> object:
            if has_dtensor(args, kwargs):
                return dispatch(info, args, kwargs)
            return local(*args, **kwargs)

        def fn(*args: object, **kwargs: object) -> object:
            if _AUTOGRAD:
                return _record.call(info, plain, args, kwargs)
            if has_dtensor(args, kwargs):
                return dispatch(info, args, kwargs)
            return local(*args, **kwargs)

    functools.update_wrapper(fn, info.function)
    fn.__doc__ = (info.function.__doc__ or "") + _FUNCTION_DOC
    return fn


def _public_functions() -> dict[str, Callable]:
    """Dispatching twins of every record's public function, by op name."""
    return {name: _function(info) for name, info in OPS.items() if info.function is not None}


# -- DTensor methods and operators ----------------------------------------------------------------
def _name(fn: Callable, name: str, doc: str) -> Callable:
    fn.__name__ = name
    fn.__qualname__ = f"DTensor.{name}"
    fn.__doc__ = doc
    return fn


def _reorder(order: tuple[int, ...], args: tuple) -> tuple:
    return tuple(args[i] for i in order)


def _records(info: OpInfo) -> bool:
    """Whether the Tensor variants of ``info`` take their recording form now (autograd is
    active and the op is differentiable or in-place)."""
    return _AUTOGRAD and (info.inplace or info.backward is not NOT_DIFFERENTIABLE)


def _records_dtensor(info: OpInfo) -> bool:
    """Whether the DTensor variants of ``info`` take their recording form now: as Tensor's
    on the Python path (on the fast path the compiled front asks the recorder itself)."""
    return not _FAST and _records(info)


def _method(info: OpInfo, name: str) -> Callable:
    """The DTensor method ``name`` running ``info`` (``self`` first, or per method_args), in
    its recording form when it records."""
    fn = _plain_method(info, name)
    if _records_dtensor(info):
        return _record.recording(info, fn, info.method_args, compiled=False)
    return fn


def _plain_method(info: OpInfo, name: str) -> Callable:
    doc = _METHOD_DOC.format(info.name)
    order = info.method_args
    if order is not None:
        if _FAST and order == (1, 0, 2):  # ``x.where(cond, y)``: the compiled front's form
            return _front.make_operator(fast_op(info), name, doc, "where")

        def reordered(self: DTensor, *args: object) -> object:
            return dispatch(info, _reorder(order, (self, *args)), {})

        return _name(reordered, name, doc)
    if _FAST:
        return _front.make_method(fast_op(info), name, doc)

    def method(self: DTensor, *args: object, **kwargs: object) -> object:
        return dispatch(info, (self, *args), kwargs)

    return _name(method, name, doc)


#: Where the op's arguments are in an operator's ``(self, other)``, by form (None: in order).
_OPERATOR_ORDER = {"reflected": (1, 0)}


def _operator(info: OpInfo, op: Operator) -> Callable:
    """A DTensor operator: binary, reflected, compare, unary or method (in its recording
    form when autograd is active)."""
    doc = _OPERATOR_DOC[op.form].format(d=op.dunder, op=info.name)
    if op.form == "method":
        return _name(_method(info, op.dunder), op.dunder, doc)
    if _FAST:
        fn = _front.make_operator(fast_op(info), op.dunder, doc, op.form)
    else:
        fn = _name(_PY_OPERATORS[op.form](info), op.dunder, doc)
    if _records_dtensor(info):
        return _record.recording(info, fn, _OPERATOR_ORDER.get(op.form), compiled=False)
    return fn


def _binary(info: OpInfo) -> Callable:
    def op(self: DTensor, other: object) -> object:
        return dispatch(info, (self, other), {})

    return op


def _reflected(info: OpInfo) -> Callable:
    def op(self: DTensor, other: object) -> object:
        return dispatch(info, (other, self), {})

    return op


def _compare(info: OpInfo) -> Callable:
    def op(self: DTensor, other: object) -> object:
        if not isinstance(other, _TENSOR_LIKE):
            return NotImplemented
        return dispatch(info, (self, other), {})

    return op


def _unary(info: OpInfo) -> Callable:
    def op(self: DTensor) -> object:
        return dispatch(info, (self,), {})

    return op


_PY_OPERATORS = {"binary": _binary, "reflected": _reflected, "compare": _compare, "unary": _unary}


def _T(self: DTensor) -> DTensor:
    """The tensor with its dims reversed (``t()`` for 2-D). **Local** (a view per shard)."""
    return self.permute(*range(self.ndim - 1, -1, -1))


def _mT(self: DTensor) -> DTensor:
    """The last two dims swapped. **Local** (a view per shard)."""
    return self.transpose(-2, -1)


def _slot_ops() -> dict[str, object]:
    """With the compiled base, register what runs behind its operator slots.

    The slots (``+ - * / @`` and unary ``-``) stay on DTensor in both modes, so that
    switching paths never replaces them by CPython's generic slot dispatch: on the fast path
    they run a FastOp; on the Python path a function that dispatches the operands in
    expression order. Returns the dunders the slots serve (``__add__`` and ``__radd__``...;
    empty without the compiled base, where DTensor gets Python operator functions)."""
    if _front is None:
        return {}
    slots, served = {}, {}
    for info in OPS.values():
        for op in info.operators:
            tag = op.dunder.strip("_")
            if tag in _front.SLOT_TAGS and op.form in ("binary", "unary"):
                unary = op.form == "unary"
                slots[tag] = _slot_op(info, unary)
                served[op.dunder] = tag
                if not unary:
                    served[f"__r{tag}__"] = tag
    _front.set_slot_ops(slots)
    return served


def _python_slot(info: OpInfo, unary: bool) -> Callable:
    """The Python path behind an operator slot (operands in expression order)."""
    if unary:
        return lambda a: dispatch(info, (a,), {})
    return lambda a, b: dispatch(info, (a, b), {})


def _slot_op(info: OpInfo, unary: bool) -> object:
    """What runs behind an operator slot: the FastOp (fast path) or the Python path (in its
    recording form when it records; operands in expression order)."""
    if _FAST:
        return fast_op(info)
    fn = _python_slot(info, unary)
    return _record.recording(info, fn, compiled=False) if _records(info) else fn


def _install_dtensor() -> list[str]:
    """Install DTensor's methods and operators; returns their names."""
    names = []
    slots = _slot_ops()
    for info in OPS.values():
        if info.method is not None:
            for name in (info.name, *info.aliases):
                if name not in _OWN_DTENSOR:
                    setattr(DTensor, name, _method(info, name))
                    names.append(name)
        for op in info.operators:
            if op.dunder not in slots:
                setattr(DTensor, op.dunder, _operator(info, op))
            names.append(op.dunder)
    DTensor.__hash__ = object.__hash__
    # a one-step plan runs from compiled code (see front.redistribute_form)
    redistribute = _front.redistribute if _FAST else PY_REDISTRIBUTE
    # and so does an op's one-step move of an input
    use_compiled_moves(_front.move_local if _FAST else None)
    if _AUTOGRAD:
        redistribute = _record.recording_redistribute(redistribute)
    DTensor.redistribute = redistribute
    DTensor.T = property(_T)
    DTensor.mT = property(_mT)
    return names


# -- Tensor methods and operators -------------------------------------------------------------------
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


def _tensor_mT(self: Tensor) -> Tensor:
    # Tensor's own property raises PyTorch's error below 2-D
    return self.transpose(-2, -1) if self.ndim >= 2 else _OWN_TENSOR["mT"].fget(self)


def _install_tensor() -> list[str]:
    """Install Tensor's methods and operators from the table; returns their names. When
    autograd is active, the recording forms (of the class's own methods too)."""
    names = []
    for info in OPS.values():
        rec = _records(info)
        if info.method is not None:
            for name in (info.name, *info.aliases):
                if name not in _OWN_TENSOR:
                    fn = _tensor_method(info)
                    setattr(Tensor, name, _record.recording(info, fn, info.method_args)
                            if rec else fn)
                    names.append(name)
                elif rec:
                    setattr(Tensor, name, _record.recording(info, _OWN_TENSOR[name]))
        for op in info.operators:
            if op.dunder not in _OWN_TENSOR:
                fn = _quiet(info, op.local)
                order = _OPERATOR_ORDER.get(op.form)
                setattr(Tensor, op.dunder, _record.recording(info, fn, order) if rec else fn)
                names.append(op.dunder)
            elif rec:
                setattr(Tensor, op.dunder, _record.recording(info, _OWN_TENSOR[op.dunder]))
    if _AUTOGRAD:  # the views T and mT through the recorded permute and transpose
        Tensor.T = _record.recording_view_property(_OWN_TENSOR["T"], _T)
        Tensor.mT = _record.recording_view_property(_OWN_TENSOR["mT"], _tensor_mT)
        Tensor.__setitem__ = _record.recording_setitem(_OWN_TENSOR["__setitem__"])
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


# -- switching paths ------------------------------------------------------------------------------
def set_fastpath(enabled: bool) -> bool:
    """Serve DTensor ops from the compiled front (True) or the Python dispatcher (False).

    **Local.** Reinstalls the DTensor methods and operators and the ``dtensor.<op>``
    functions; results and cache behaviour are the same either way. Call it on every rank
    (the paths differ in speed only). Turning it on needs the extension built and
    ``DTENSOR_FASTPATH`` not ``0`` at import.

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
    global _FAST, _FUNCTIONS
    if enabled and _front is None:
        raise UnavailableError(
            "set_fastpath(True): the compiled fast path is not available "
            f"(extension built: {_fp.AVAILABLE}; DTENSOR_FASTPATH=0 at import: "
            f"{_fp.AVAILABLE and not _fp.ENABLED})"
        )
    _FAST = bool(enabled)
    _install_dtensor()
    old = _FUNCTIONS
    _FUNCTIONS = _public_functions()
    _record.use_functions(_FUNCTIONS)
    for namespace in _EXPORTED:
        for name, fn in _FUNCTIONS.items():
            if namespace.get(name) is old.get(name):
                namespace[name] = fn
    return _FAST


def _activate_autograd() -> None:
    """Install the recording forms (called once, when the first tensor requires grad)."""
    global _AUTOGRAD
    _AUTOGRAD = True
    if _front is not None:  # first: the compiled guards below read its grad mode
        _front.set_call_hook(_record.call, _ag.MODE)
    _install_tensor()
    _install_dtensor()


def fastpath_active() -> bool:
    """Whether DTensor ops are served from the compiled front now. **Local**."""
    return _FAST


def export(namespace: dict) -> None:
    """Put the public dispatching functions into ``namespace`` (a module's globals, e.g.
    ``dtensor``'s) and keep them current when :func:`set_fastpath` switches paths.
    **Local**."""
    namespace.update(_FUNCTIONS)
    _EXPORTED.append(namespace)


def installed() -> dict[str, tuple[str, ...]]:
    """What this module installed: ``{"Tensor": names, "DTensor": names, "functions":
    names}``, sorted. **Local**."""
    return {
        "Tensor": tuple(sorted(set(_TENSOR_NAMES))),
        "DTensor": tuple(sorted(set(_DTENSOR_NAMES))),
        "functions": tuple(sorted(_FUNCTIONS)),
    }


_front = plug_fastpath()
_FAST = _front is not None
_AUTOGRAD = False
_OWN_TENSOR = dict(vars(Tensor))
_OWN_DTENSOR = frozenset(vars(DTensor))
_TENSOR_DOC, _DTENSOR_DOC = Tensor.__doc__, DTensor.__doc__
_TENSOR_NAMES = _install_tensor()
_DTENSOR_NAMES = _install_dtensor()
for _gname, _gfn in GATHERING.items():  # data-dependent shapes, outside the table
    setattr(Tensor, _gname, _gfn)
    setattr(DTensor, _gname, _gfn)
_TENSOR_NAMES += list(GATHERING)
_DTENSOR_NAMES += list(GATHERING)
_document(Tensor, _TENSOR_DOC, _TENSOR_NAMES)
_document(DTensor, _DTENSOR_DOC, _DTENSOR_NAMES)
_FUNCTIONS = _public_functions()
_EXPORTED: list[dict] = []
_record.use_functions(_FUNCTIONS)
_record.use_functions(FACTORIES)
_ag.on_activate(_activate_autograd)
