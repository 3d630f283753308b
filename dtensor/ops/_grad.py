"""Pieces of backward formulas that several op families share (the formulas themselves are
in their records, :mod:`dtensor.ops.pointwise`, :mod:`dtensor.ops.index`...).

Formulas are ordinary tensor ops; the public functions they need come as their ``fns``
argument (:class:`dtensor.ops.table.Backward`), which these helpers take too.
"""

from __future__ import annotations

from placements import Replicate

from ..distributed.dtensor import DTensor
from ..local.tensor import Tensor
from .table import Backward

__all__ = ["FIRST", "IDENTITY", "along", "arange", "is_tensor", "scaled", "spread", "zeros"]

#: The gradient goes to the first argument unchanged (a cast, a copy; the recorder casts it
#: back to the input's dtype and sums it down to its shape).
IDENTITY = Backward(lambda g, v, o, n, fns: (g,))
#: As :data:`IDENTITY`, for an op whose second tensor argument gets none (``type_as``...).
FIRST = Backward(lambda g, v, o, n, fns: (g, None))


def is_tensor(v: object) -> bool:
    """Whether ``v`` is a Tensor or a DTensor (not a python scalar). **Local**."""
    return isinstance(v, (Tensor, DTensor))


def scaled(g: object, a: object) -> object:
    """``g * a``, or ``g`` itself when ``a`` is 1 (an ``alpha``/``value`` argument). **Local**."""
    return g if a == 1 else g * a


def arange(n: int, like: object, fns: object) -> object:
    """``arange(n)`` on ``like``'s mesh (Replicate) or as a local tensor. **Local**."""
    if isinstance(like, DTensor):
        mesh = like.device_mesh
        return fns.arange(n, device_mesh=mesh, placements=[Replicate()] * mesh.ndim)
    return fns.arange(n)


def zeros(shape: tuple, like: object, fns: object) -> object:
    """Zeros of ``shape`` in ``like``'s dtype, on ``like``'s mesh (Replicate) or as a local
    tensor. **Local**."""
    if isinstance(like, DTensor):
        mesh = like.device_mesh
        return fns.zeros(shape, dtype=like.dtype, device_mesh=mesh,
                         placements=[Replicate()] * mesh.ndim)
    return fns.zeros(shape, dtype=like.dtype)


def spread(x: object, dim: int, index: object, g: object, fns: object) -> object:
    """The gradient of a gather of ``x`` along ``dim`` at ``index`` (of ``g``'s shape):
    ``g`` added back at the gathered positions, zeros elsewhere. **Collective** when the
    scatter of a DTensor must redistribute."""
    return fns.zeros_like(x).scatter_add(dim, index, g)


def along(index: object, dim: int, shape: tuple) -> object:
    """A 1-D ``index`` along ``dim`` as a full index of ``shape`` (``index_select``'s).
    **Local**."""
    view = [1] * len(shape)
    view[dim] = -1
    return index.reshape(view).expand(shape)
