"""Ops on DTensors: the DTensor methods and operators, and the public dispatching functions.

At import this module (the one place allowed to add methods to :class:`DTensor`) installs,
for every op of the table (:data:`dtensor.ops.table.OPS`):

- a DTensor method of the same name when the local :class:`Tensor` has that method
  (``x.relu()``, ``x.sum(dim=1)``, ``x.view(-1)``, ``x.add_(y)``...), the Python operators
  (``+ - * / // % ** @ & | ^ ~``, unary ``-`` and ``abs``, comparisons, reflected and
  in-place forms, ``x[...]``) and the ``T``/``mT`` properties;
- a public function for every op that ``dtensor`` exports as a local function
  (``dt.add``, ``dt.sum``, ``dt.matmul``...): with no DTensor among its arguments it calls
  the local function unchanged; otherwise it dispatches (:func:`dtensor.dispatch.dispatcher.dispatch`).
  ``dtensor/__init__.py`` re-exports these functions over the local ones.

Comparisons return DTensors, so ``__hash__`` stays the identity hash (as in PyTorch).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

import fastpath as _fp
from placements.errors import UnavailableError

from ..distributed.dtensor import DTensor
from ..local import kernels as _kernels
from ..local.tensor import Tensor
from ..ops import registry as _ops_registry  # noqa: F401  (fills the op table)
from ..ops.table import OPS, OpInfo
from .dispatcher import dispatch, fast_op, plug_fastpath

# operator -> op name; the reflected form swaps the operands
_BINARY = {
    "add": "add",
    "sub": "sub",
    "mul": "mul",
    "truediv": "div",
    "floordiv": "floor_divide",
    "mod": "remainder",
    "pow": "pow",
    "matmul": "matmul",
    "and": "bitwise_and",
    "or": "bitwise_or",
    "xor": "bitwise_xor",
}
_INPLACE = {
    "iadd": "add_",
    "isub": "sub_",
    "imul": "mul_",
    "itruediv": "div_",
    "ifloordiv": "floor_divide_",
    "imod": "remainder_",
    "ipow": "pow_",
    "iand": "bitwise_and_",
    "ior": "bitwise_or_",
    "ixor": "bitwise_xor_",
}
_COMPARE = {"eq": "eq", "ne": "ne", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge"}
_UNARY = {"neg": "neg", "abs": "abs", "invert": "bitwise_not", "pos": "positive"}
_ITEM = {"__getitem__": ("__getitem__", "getitem"), "__setitem__": ("__setitem__", "setitem")}
_TENSOR_LIKE = (DTensor, Tensor, bool, int, float, complex)


def _has_dtensor(args: tuple, kwargs: Mapping[str, object]) -> bool:
    """Whether a DTensor is among the arguments (also inside list/tuple arguments)."""
    for a in args:
        if isinstance(a, DTensor):
            return True
        if type(a) is list or type(a) is tuple:
            for e in a:
                if isinstance(e, DTensor):
                    return True
    if kwargs:
        return _has_dtensor(tuple(kwargs.values()), None)
    return False


_FUNCTION_DOC = (
    "\n\nAccepts DTensors too (**Collective** when an input must be redistributed for "
    "the chosen sharding strategy, **Local** otherwise)."
)
_METHOD_DOC = (
    "``{}`` on a DTensor; placements are inferred by its sharding rule. "
    "**Collective** when an input must be redistributed, **Local** otherwise."
)


def _function(info: OpInfo, local: Callable) -> Callable:
    if _FAST:
        fn = _front.make_function(fast_op(info), local)
    else:

        def fn(*args: object, **kwargs: object) -> object:
            if _has_dtensor(args, kwargs):
                return dispatch(info, args, kwargs)
            return local(*args, **kwargs)

    functools.update_wrapper(fn, local)
    fn.__doc__ = (local.__doc__ or "") + _FUNCTION_DOC
    return fn


def _name(fn: Callable, name: str, doc: str) -> Callable:
    fn.__name__ = name
    fn.__qualname__ = f"DTensor.{name}"
    fn.__doc__ = doc
    return fn


def _method(info: OpInfo) -> Callable:
    doc = _METHOD_DOC.format(info.name)
    if _FAST:
        return _front.make_method(fast_op(info), info.name, doc)

    def method(self: DTensor, *args: object, **kwargs: object) -> object:
        return dispatch(info, (self, *args), kwargs)

    return _name(method, info.name, doc)


def _operator(info: OpInfo, dunder: str, form: str, doc: str) -> Callable:
    """A DTensor operator of ``form``: binary, reflected, compare, unary or where."""
    if _FAST:
        return _front.make_operator(fast_op(info), dunder, doc, form)
    return _name(_PY_OPERATORS[form](info), dunder, doc)


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


def _where(info: OpInfo) -> Callable:
    # Tensor.where(condition, other) is where(condition, self, other)
    def where(self: DTensor, condition: object, other: object) -> object:
        return dispatch(info, (condition, self, other), {})

    return where


_PY_OPERATORS = {
    "binary": _binary,
    "reflected": _reflected,
    "compare": _compare,
    "unary": _unary,
    "where": _where,
}


def _T(self: DTensor) -> DTensor:
    """The tensor with its dims reversed (``t()`` for 2-D). **Local** (a view per shard)."""
    return self.permute(*range(self.ndim - 1, -1, -1))


def _mT(self: DTensor) -> DTensor:
    """The last two dims swapped. **Local** (a view per shard)."""
    return self.transpose(-2, -1)


def _install_methods() -> None:
    for name, info in OPS.items():
        if name in _OWN or not hasattr(Tensor, name):
            continue
        if name == "where":
            doc = "``where(condition, self, other)`` (PyTorch's method form)."
            setattr(DTensor, name, _operator(info, "where", "where", doc))
        else:
            setattr(DTensor, name, _method(info))
    for dunder, names in _ITEM.items():
        for name in names:
            if name in OPS:
                setattr(DTensor, dunder, _method(OPS[name]))
                break
    slots = _slot_ops()
    for tag, name in _BINARY.items():
        if name in OPS:
            info = OPS[name]
            d, r = f"__{tag}__", f"__r{tag}__"
            if tag in slots:
                continue
            doc = f"``self {d}`` other: :func:`{name}`."
            setattr(DTensor, d, _operator(info, d, "binary", doc))
            doc = f"``other {r}`` self: :func:`{name}` (other, self)."
            setattr(DTensor, r, _operator(info, r, "reflected", doc))
    for tag, name in _INPLACE.items():
        if name in OPS:
            d = f"__{tag}__"
            doc = f"``self {d}`` other: :func:`{name}`."
            setattr(DTensor, d, _operator(OPS[name], d, "binary", doc))
    for tag, name in _COMPARE.items():
        if name in OPS:
            d = f"__{tag}__"
            doc = f"Elementwise :func:`{name}`, a bool DTensor."
            setattr(DTensor, d, _operator(OPS[name], d, "compare", doc))
    for tag, name in _UNARY.items():
        if name in OPS:
            d = f"__{tag}__"
            if tag in slots:
                continue
            doc = f":func:`{name}` of a DTensor."
            setattr(DTensor, d, _operator(OPS[name], d, "unary", doc))
    DTensor.__hash__ = object.__hash__
    if "permute" in OPS:
        DTensor.T = property(_T)
    if "transpose" in OPS:
        DTensor.mT = property(_mT)


def _slot_ops() -> dict[str, object]:
    """With the compiled base, register what runs behind its operator slots.

    The slots (``+ - * / @`` and unary ``-``) stay on DTensor in both modes, so that
    switching paths never replaces them by CPython's generic slot dispatch: on the fast path
    they run a FastOp; on the Python path a function that dispatches the operands in
    expression order. Returns ``{operator tag: op}`` (empty without the compiled base, where
    DTensor gets Python operator functions)."""
    if _front is None:
        return {}
    ops = {**_BINARY, **_UNARY}
    slots = {}
    for tag in _front.SLOT_TAGS:
        name = ops.get(tag)
        if name in OPS:
            info = OPS[name]
            slots[tag] = fast_op(info) if _FAST else _python_slot(info, tag in _UNARY)
    _front.set_slot_ops(slots)
    return slots


def _python_slot(info: OpInfo, unary: bool) -> Callable:
    """The Python path behind an operator slot (operands in expression order)."""
    if unary:
        return lambda a: dispatch(info, (a,), {})
    return lambda a, b: dispatch(info, (a, b), {})


def _public_functions() -> dict[str, Callable]:
    """Dispatching twins of the local functions ``dtensor`` exports under op names."""
    out = {}
    for name, info in OPS.items():
        local = _LOCALS.get(name)
        if callable(local) and not isinstance(local, type):
            out[name] = _function(info, local)
    return out


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
    _install_methods()
    old = _FUNCTIONS
    _FUNCTIONS = _public_functions()
    for namespace in _EXPORTED:
        for name, fn in _FUNCTIONS.items():
            if namespace.get(name) is old.get(name):
                namespace[name] = fn
    return _FAST


def export(namespace: dict) -> None:
    """Put the public dispatching functions into ``namespace`` (a module's globals, e.g.
    ``dtensor``'s) and keep them current when :func:`set_fastpath` switches paths.
    **Local**."""
    namespace.update(_FUNCTIONS)
    _EXPORTED.append(namespace)


def fastpath_active() -> bool:
    """Whether DTensor ops are served from the compiled front now. **Local**."""
    return _FAST


_front = plug_fastpath()
_FAST = _front is not None
_OWN = frozenset(vars(DTensor))
# the local functions ``dtensor`` exports under op names (their dispatching twins replace them)
_LOCALS = {name: getattr(_kernels, name) for name in _kernels.__all__ if name in OPS}
_EXPORTED: list[dict] = []
_install_methods()
_FUNCTIONS = _public_functions()
__all__ = ["export", "fastpath_active", "set_fastpath"]
