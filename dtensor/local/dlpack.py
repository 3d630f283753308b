"""DLPack interop of the local tensor: :func:`from_dlpack` and :func:`to_dlpack`, zero-copy
on both devices (host memory becomes a numpy-backed tensor, CUDA memory a cupy-backed one).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from placements.errors import ArgumentError, DTypeError

from . import backend as _backend
from .factory import _from_array
from .tensor import Tensor

__all__ = ["from_dlpack", "to_dlpack"]

# DLPack device types (dlpack.h, DLDeviceType)
_KDL_CPU, _KDL_CUDA, _KDL_CUDA_HOST, _KDL_CUDA_MANAGED = 1, 2, 3, 13
_HOST_KINDS = (_KDL_CPU, _KDL_CUDA_HOST)
_CUDA_KINDS = (_KDL_CUDA, _KDL_CUDA_MANAGED)


def from_dlpack(ext: Any) -> Tensor:
    """A tensor sharing memory with a DLPack producer (cupy/numpy array, torch tensor...).

    **Local.** Host data (DLPack CPU or CUDA-host memory) becomes a numpy-backed tensor,
    device data a cupy-backed one; no copy either way. A :class:`Tensor` is accepted too
    (the result shares its memory).

    Raises
    ------
    DTypeError
        When ``ext`` does not implement the DLPack protocol.
    ArgumentError
        For memory on a device kind other than CPU or CUDA (a ValueError).
    """
    arr = ext._arr if isinstance(ext, Tensor) else ext
    if not (hasattr(arr, "__dlpack__") and hasattr(arr, "__dlpack_device__")):
        raise DTypeError(
            f"from_dlpack: expected an object with __dlpack__ and __dlpack_device__, got "
            f"{type(ext).__name__}"
        )
    kind, index = arr.__dlpack_device__()
    if kind in _HOST_KINDS:
        out = np.from_dlpack(arr)
    elif kind in _CUDA_KINDS:
        out = _backend._cupy().from_dlpack(arr)
    else:
        raise ArgumentError(
            f"from_dlpack: memory on DLPack device type {int(kind)} (index {index}) is not "
            f"supported; dtensor holds CPU (1) and CUDA (2) memory"
        )
    return _from_array(out, "from_dlpack")


def to_dlpack(tensor: Tensor, stream: Any = None) -> Any:
    """A DLPack capsule of ``tensor``'s data (no copy). **Local.**

    ``stream`` is passed to the array's ``__dlpack__`` (the consumer's CUDA stream, or None).
    """
    if not isinstance(tensor, Tensor):
        raise DTypeError(f"to_dlpack: expected a dt.Tensor, got {type(tensor).__name__}")
    return tensor._arr.__dlpack__(stream=stream)
