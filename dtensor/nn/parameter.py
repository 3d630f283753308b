"""``dt.nn.Parameter``: the mark that makes a tensor a module parameter.

Design (PyTorch's ``nn.Parameter`` is a Tensor subclass; here it is a mark): a parameter
must be a local :class:`~dtensor.Tensor` or a :class:`~dtensor.DTensor` alike, and both
classes are served by exact-type checks in the compiled front, so a subclass of either
would leave the fast path (and two subclasses would be needed). So ``Parameter(t)``
returns a new *plain* tensor of ``t``'s class (``t.detach()``: a new leaf sharing
``t``'s memory, as PyTorch's Parameter shares its data's), sets its ``requires_grad`` and
records it as a parameter. ``isinstance(p, dt.nn.Parameter)`` is true exactly for the
tensors so made (the class's ``__instancecheck__`` asks the record); ``type(p)`` stays
``Tensor`` or ``DTensor``, and ``repr(p)`` is the tensor's. The record holds weak
references only. A tensor derived from a parameter (``p * 2``, ``p.to(...)``,
``p.detach()``) is not a parameter, as in PyTorch; ``copy.deepcopy(p)`` is one (a leaf
with ``p``'s ``requires_grad``), as PyTorch's, so a deep-copied module's parameters are
parameters.
"""

from __future__ import annotations

import weakref
from typing import Any

from placements.errors import DTypeError

from ..distributed.dtensor import DTensor
from ..distributed.factory import FACTORIES
from ..local.tensor import DEEPCOPY_HOOKS, Tensor

__all__ = ["Parameter", "is_parameter"]

#: The parameters made so far, by ``id`` (an entry goes when its tensor dies). A weak-value
#: dict, not a WeakSet: a WeakSet compares its members with ``==``, which is elementwise on
#: tensors.
_MARKED: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def _keep_mark(source: object, copied: object) -> None:
    """A deep copy of a parameter is a parameter (``DEEPCOPY_HOOKS``). **Local**."""
    if is_parameter(source):
        _MARKED[id(copied)] = copied


DEEPCOPY_HOOKS.append(_keep_mark)


def is_parameter(obj: object) -> bool:
    """Whether ``obj`` is a tensor made by :class:`Parameter`. **Local**."""
    return _MARKED.get(id(obj)) is obj


class _ParameterMeta(type):
    def __instancecheck__(cls, obj: object) -> bool:
        return is_parameter(obj)


class Parameter(metaclass=_ParameterMeta):
    """A tensor that is a module parameter: ``Parameter(data, requires_grad=True)``.

    **Local** (for a DTensor too: nothing moves). Returns ``data.detach()`` (a new leaf
    of ``data``'s class sharing its memory and, for a DTensor, its mesh and placements)
    with ``requires_grad`` set, marked so that ``isinstance(p, dt.nn.Parameter)`` holds
    and a :class:`~dtensor.nn.Module` registers it as a parameter when it is assigned as
    an attribute. See the module docstring for why it is a mark and not a subclass.

    Parameters
    ----------
    data : Tensor or DTensor, optional
        The values (default: an empty float tensor).
    requires_grad : bool
        Default True.

    Raises
    ------
    DTypeError
        When ``data`` is not a Tensor or DTensor.
    AutogradError
        ``requires_grad=True`` for a tensor that is not floating or complex.
    """

    def __new__(cls, data: Tensor | DTensor | None = None, requires_grad: bool = True) -> Any:
        if data is None:
            data = FACTORIES["empty"](0)
        if not isinstance(data, (Tensor, DTensor)):
            raise DTypeError(
                f"Parameter: data must be a dt.Tensor or dt.DTensor, got {type(data).__name__}"
            )
        p = data.detach().requires_grad_(requires_grad)
        _MARKED[id(p)] = p
        return p
