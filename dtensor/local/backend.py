"""Array-module abstraction of the local tensor: devices, numpy/cupy, raw memory.

This module owns everything that differs between host (numpy) and GPU (cupy) arrays:
the :class:`Device` value and its parsing (``"cpu"``, ``"cuda"``, ``"cuda:1"``), the
choice of array module for a device, and the few memory-level helpers the tensor core
needs (data pointer, owner of an array's memory, the flat byte buffer over it, building
a strided view of such a buffer, host copies). cupy is imported lazily, only when a
CUDA device is used; numpy is always available.
"""

from __future__ import annotations

import numpy as np

from placements.errors import ArgumentError, DTypeError

__all__ = [
    "CPU",
    "HOST_ALLOCATOR",
    "Device",
    "array_module",
    "array_module_of",
    "as_device",
    "data_ptr",
    "device_of",
    "is_array",
    "memory_owner",
    "restrided",
    "storage_buffer",
    "strided_view",
    "to_device",
    "to_host",
]


class Device:
    """A device: ``type`` (``"cpu"`` or ``"cuda"``) and an optional ``index``.

    Immutable and hashable. It compares equal to its string form (``"cpu"``,
    ``"cuda:0"``) and to strings that parse to it.
    """

    __slots__ = ("_str", "index", "type")

    def __init__(self, type: str, index: int | None = None) -> None:
        if type not in ("cpu", "cuda"):
            raise ArgumentError(f"Expected one of cpu, cuda device type at start of device: {type}")
        if index is not None and (type == "cpu" or index < 0):
            raise ArgumentError(f"invalid device index {index} for device type {type!r}")
        object.__setattr__(self, "type", type)
        object.__setattr__(self, "index", index)
        object.__setattr__(self, "_str", type if index is None else f"{type}:{index}")

    def __setattr__(self, name, value):
        raise AttributeError("Device is immutable")

    def __str__(self) -> str:
        return self._str

    def __repr__(self) -> str:
        if self.index is None:
            return f"device(type='{self.type}')"
        return f"device(type='{self.type}', index={self.index})"

    def __eq__(self, other) -> bool:
        if isinstance(other, Device):
            return self._str == other._str
        if isinstance(other, str):
            try:
                return self._str == as_device(other)._str
            except ValueError:
                return False
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._str)

    def __reduce__(self):
        return (Device, (self.type, self.index))


CPU = Device("cpu")
_PARSED: dict = {"cpu": CPU}


def as_device(device) -> Device:
    """Parse a device argument.

    **Local.**

    Parameters
    ----------
    device : Device, str, int or None
        ``None`` means the CPU; an int means ``cuda:<int>``.

    Returns
    -------
    Device

    Raises
    ------
    ArgumentError
        For an unknown device string (a ValueError).
    DTypeError
        For what is not a device (a TypeError).
    """
    if device is None:
        return CPU
    if isinstance(device, Device):
        return device
    if isinstance(device, str):
        dev = _PARSED.get(device)
        if dev is None:
            kind, sep, idx = device.strip().partition(":")
            if sep and not idx.isdigit():
                raise ArgumentError(f"Invalid device string: '{device}'")
            dev = Device(kind, int(idx) if sep else None)
            _PARSED[device] = dev
        return dev
    if isinstance(device, int) and not isinstance(device, bool):
        return Device("cuda", device)
    raise DTypeError(
        f"expected a device (str, dt.Device or int), got {type(device).__name__} ({device!r})"
    )


def _cupy():
    try:
        import cupy
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise ImportError(
            "CUDA devices need cupy; install it (for example `pip install cupy-cuda12x`, "
            "or the package's [gpu] extra)"
        ) from exc
    return cupy


def array_module(device):
    """Array module (``numpy`` or ``cupy``) that holds arrays of ``device``.

    **Local.** Importing cupy happens here, on first use of a CUDA device.
    """
    if as_device(device).type == "cpu":
        return np
    return _cupy()


def array_module_of(arr):
    """Array module of an array (``numpy`` for numpy arrays, else ``cupy``). **Local.**"""
    if isinstance(arr, np.ndarray):
        return np
    return _cupy()


def is_array(x) -> bool:
    """True for a numpy or cupy ndarray (cupy is not imported to answer). **Local.**"""
    if isinstance(x, np.ndarray):
        return True
    return type(x).__module__.startswith("cupy") and type(x).__name__ == "ndarray"


def device_of(arr) -> Device:
    """Device of an array. **Local.**"""
    if isinstance(arr, np.ndarray):
        return CPU
    return as_device(f"cuda:{arr.device.id}")


def data_ptr(arr) -> int:
    """Address of the first element of ``arr`` (element ``[0, ..., 0]``). **Local.**"""
    if isinstance(arr, np.ndarray):
        return arr.__array_interface__["data"][0]
    return arr.data.ptr


def _byte_bounds(arr: np.ndarray) -> tuple[int, int]:
    """Lowest address and one-past-highest address touched by ``arr``."""
    lo = hi = data_ptr(arr)
    if arr.size == 0:
        return lo, lo
    for size, stride in zip(arr.shape, arr.strides):
        if stride < 0:
            lo += (size - 1) * stride
        else:
            hi += (size - 1) * stride
    return lo, hi + arr.itemsize


def memory_owner(arr):
    """The array that owns ``arr``'s memory, and what lies at the end of the base chain.

    **Local.** For numpy, ``arr.base`` is followed while it is an ndarray; the last
    ndarray is the owner and the object after it (``None`` for memory numpy allocated,
    an allocator block exposing ``__array_interface__``, ``bytes``...) is the end.
    For cupy, the owner is the array itself and the end is its ``Memory`` object.

    Returns
    -------
    tuple
        ``(owner_array, end_object)``.
    """
    if not isinstance(arr, np.ndarray):
        return arr, arr.data.mem
    base = arr.base
    while isinstance(base, np.ndarray):
        arr = base
        base = arr.base
    return arr, base


class _Span:
    """A byte range of a strided owner, as an ``__array_interface__`` exporter."""

    __slots__ = ("__array_interface__", "allocator", "owner")

    def __init__(self, lo: int, nbytes: int, owner: np.ndarray, allocator) -> None:
        self.__array_interface__ = {
            "data": (lo, not owner.flags.writeable),
            "shape": (nbytes,),
            "typestr": "|u1",
            "version": 3,
        }
        self.owner = owner
        self.allocator = allocator


def storage_buffer(arr):
    """Flat 1-D uint8 array over the whole memory that ``arr`` lives in.

    **Local.** Two arrays with the same memory owner get buffers with the same address
    and size. The buffer keeps the owner (and so the allocator block) alive.

    Returns
    -------
    tuple
        ``(buffer, allocator)``: the allocator is the ``allocator`` attribute of the
        object at the end of the base chain (an allocator block) when it has one, the
        cupy memory pool for GPU arrays, else :data:`HOST_ALLOCATOR`.
    """
    owner, end = memory_owner(arr)
    if not isinstance(arr, np.ndarray):
        cp = _cupy()
        buf = cp.ndarray((end.size,), cp.uint8, memptr=cp.cuda.MemoryPointer(end, 0))
        return buf, cp.get_default_memory_pool()
    allocator = getattr(end, "allocator", HOST_ALLOCATOR)
    if owner.flags.c_contiguous or owner.flags.f_contiguous:
        return owner.reshape(-1, order="A").view(np.uint8), allocator
    lo, hi = _byte_bounds(owner)
    return np.asarray(_Span(lo, hi - lo, owner, allocator)), allocator


def restrided(arr, shape: tuple, byte_strides: tuple):
    """View of ``arr``'s memory with new shape/strides and the same first element.

    **Local.** The caller guarantees that every element of the result lies inside the
    memory that ``arr``'s elements span. Returns ``None`` when this cannot be done
    without the storage buffer (a non-contiguous numpy array); use
    :func:`strided_view` then.
    """
    if isinstance(arr, np.ndarray):
        if arr.flags.c_contiguous:
            return np.ndarray(shape, arr.dtype, arr, 0, byte_strides)
        return None
    return _cupy().ndarray(shape, arr.dtype, memptr=arr.data, strides=byte_strides)


def strided_view(buf, shape: tuple, dtype, byte_offset: int, byte_strides: tuple):
    """Array of ``shape``/``dtype`` over the flat byte buffer ``buf`` (no copy).

    **Local.** Strides and offset are in bytes; negative and zero strides are allowed
    as long as every element lies inside ``buf``.
    """
    if isinstance(buf, np.ndarray):
        return np.ndarray(shape, dtype, buf, byte_offset, byte_strides)
    cp = _cupy()
    return cp.ndarray(shape, dtype, memptr=buf.data + byte_offset, strides=byte_strides)


def to_host(arr) -> np.ndarray:
    """``arr`` as a numpy array: itself on the CPU, a host copy of a GPU array. **Local.**"""
    if isinstance(arr, np.ndarray):
        return arr
    return arr.get()


def to_device(arr, device: Device):
    """``arr`` on ``device``: itself when already there, else a copy. **Local.**"""
    if device.type == "cpu":
        return to_host(arr)
    cp = _cupy()
    with cp.cuda.Device(device.index):
        return cp.asarray(arr)


class _HostAllocator:
    """The plain numpy host allocator (memory numpy or a foreign buffer provides)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<numpy host allocator>"


HOST_ALLOCATOR = _HostAllocator()
