"""Ops on DTensors: the DTensor methods and operators, and the public dispatching functions.

At import this module (the one place allowed to add methods to :class:`DTensor`) installs,
for every op of the table (:data:`dtensor._optable.OPS`):

- a DTensor method of the same name when the local :class:`Tensor` has that method
  (``x.relu()``, ``x.sum(dim=1)``, ``x.view(-1)``, ``x.add_(y)``...), the Python operators
  (``+ - * / // % ** @ & | ^ ~``, unary ``-`` and ``abs``, comparisons, reflected and
  in-place forms, ``x[...]``) and the ``T``/``mT`` properties;
- a public function for every op that ``dtensor`` exports as a local function
  (``dt.add``, ``dt.sum``, ``dt.matmul``...): with no DTensor among its arguments it calls
  the local function unchanged; otherwise it dispatches (:func:`dtensor._dispatch.dispatch`).
  ``dtensor/__init__.py`` re-exports these functions over the local ones.

Comparisons return DTensors, so ``__hash__`` stays the identity hash (as in PyTorch).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Mapping

from . import _ops_registry  # noqa: F401  (fills the op table)
from ._dispatch import dispatch
from ._dtensor import DTensor
from ._optable import OPS, OpInfo
from ._tensor import Tensor

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


def _function(info: OpInfo, local: Callable) -> Callable:
    def fn(*args: object, **kwargs: object) -> object:
        if _has_dtensor(args, kwargs):
            return dispatch(info, args, kwargs)
        return local(*args, **kwargs)

    functools.update_wrapper(fn, local)
    fn.__doc__ = (local.__doc__ or "") + (
        "\n\nAccepts DTensors too (**Collective** when an input must be redistributed for "
        "the chosen sharding strategy, **Local** otherwise)."
    )
    return fn


def _name(fn: Callable, name: str, doc: str) -> Callable:
    fn.__name__ = name
    fn.__qualname__ = f"DTensor.{name}"
    fn.__doc__ = doc
    return fn


def _method(info: OpInfo) -> Callable:
    def method(self: DTensor, *args: object, **kwargs: object) -> object:
        return dispatch(info, (self, *args), kwargs)

    return _name(
        method,
        info.name,
        f"``{info.name}`` on a DTensor; placements are inferred by its sharding rule. "
        "**Collective** when an input must be redistributed, **Local** otherwise.",
    )


def _binary(info: OpInfo, dunder: str) -> Callable:
    def op(self: DTensor, other: object) -> object:
        return dispatch(info, (self, other), {})

    return _name(op, dunder, f"``self {dunder}`` other: :func:`{info.name}`.")


def _reflected(info: OpInfo, dunder: str) -> Callable:
    def op(self: DTensor, other: object) -> object:
        return dispatch(info, (other, self), {})

    return _name(op, dunder, f"``other {dunder}`` self: :func:`{info.name}` (other, self).")


def _compare(info: OpInfo, dunder: str) -> Callable:
    def op(self: DTensor, other: object) -> object:
        if not isinstance(other, _TENSOR_LIKE):
            return NotImplemented
        return dispatch(info, (self, other), {})

    return _name(op, dunder, f"Elementwise :func:`{info.name}`, a bool DTensor.")


def _unary(info: OpInfo, dunder: str) -> Callable:
    def op(self: DTensor) -> object:
        return dispatch(info, (self,), {})

    return _name(op, dunder, f":func:`{info.name}` of a DTensor.")


def _where_method(info: OpInfo) -> Callable:
    # Tensor.where(condition, other) is where(condition, self, other)
    def where(self: DTensor, condition: object, other: object) -> object:
        return dispatch(info, (condition, self, other), {})

    return _name(where, "where", "``where(condition, self, other)`` (PyTorch's method form).")


def _T(self: DTensor) -> DTensor:
    """The tensor with its dims reversed (``t()`` for 2-D). **Local** (a view per shard)."""
    return self.permute(*range(self.ndim - 1, -1, -1))


def _mT(self: DTensor) -> DTensor:
    """The last two dims swapped. **Local** (a view per shard)."""
    return self.transpose(-2, -1)


def _install_methods() -> None:
    own = set(vars(DTensor))
    for name, info in OPS.items():
        if name in own or not hasattr(Tensor, name):
            continue
        setattr(DTensor, name, _where_method(info) if name == "where" else _method(info))
    for dunder, names in _ITEM.items():
        for name in names:
            if name in OPS:
                setattr(DTensor, dunder, _method(OPS[name]))
                break
    for tag, name in _BINARY.items():
        if name in OPS:
            setattr(DTensor, f"__{tag}__", _binary(OPS[name], f"__{tag}__"))
            setattr(DTensor, f"__r{tag}__", _reflected(OPS[name], f"__r{tag}__"))
    for tag, name in _INPLACE.items():
        if name in OPS:
            setattr(DTensor, f"__{tag}__", _binary(OPS[name], f"__{tag}__"))
    for tag, name in _COMPARE.items():
        if name in OPS:
            setattr(DTensor, f"__{tag}__", _compare(OPS[name], f"__{tag}__"))
    for tag, name in _UNARY.items():
        if name in OPS:
            setattr(DTensor, f"__{tag}__", _unary(OPS[name], f"__{tag}__"))
    DTensor.__hash__ = object.__hash__
    if "permute" in OPS:
        DTensor.T = property(_T)
    if "transpose" in OPS:
        DTensor.mT = property(_mT)


def _public_functions() -> dict[str, Callable]:
    """Dispatching twins of the local functions ``dtensor`` exports under op names."""
    pkg = sys.modules[__package__]
    out = {}
    for name, info in OPS.items():
        local = getattr(pkg, name, None)
        if callable(local) and not isinstance(local, type):
            out[name] = _function(info, local)
    return out


_install_methods()
_FUNCTIONS = _public_functions()
globals().update(_FUNCTIONS)
__all__: list[str] = []
__all__.extend(sorted(_FUNCTIONS))
