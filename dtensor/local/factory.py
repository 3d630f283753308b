"""Creation of local tensors: from data, from arrays, and the factory functions.

This module owns ``tensor`` (copies), ``from_numpy`` and ``as_tensor`` (zero-copy when
possible) and the factories (``empty``, ``zeros``, ``ones``, ``full``, ``arange``,
``linspace``, ``eye``, ``rand``, ``randn``, ``randint`` and the ``*_like`` forms).
Options follow PyTorch's TensorOptions: a missing dtype comes from the factory's rule
(python floats -> the default float dtype, ints -> int64, bools -> bool), a missing
device is the CPU, and ``*_like`` inherit both from their input. Every array is
allocated by :func:`dtensor.local.allocator.empty_array` and never zero-filled when it is
fully written.

Every factory also takes ``device_mesh=`` and ``placements=``; with a mesh it returns
``dtensor.distributed.factory.distributed_factory(name, size, dtype=..., device_mesh=...,
placements=..., device=..., **factory_args)`` instead of a local tensor.
"""

from __future__ import annotations

import math
import operator

import numpy as np

from placements.errors import (
    ArgumentError,
    DTypeError,
    PlacementError,
    ShardingError,
    SignatureError,
    ViewError,
)

from . import backend as B
from . import dtypes as _dtypes
from . import rng as _random
from .tensor import Tensor, _alloc, _copy_into, _empty_like_arr, _shape_arg, _wrap

__all__ = [
    "arange",
    "as_tensor",
    "empty",
    "empty_like",
    "eye",
    "from_numpy",
    "full",
    "full_like",
    "linspace",
    "ones",
    "ones_like",
    "rand",
    "rand_like",
    "randint",
    "randn",
    "randn_like",
    "tensor",
    "zeros",
    "zeros_like",
]


# ------------------------------------------------------------------ from data


def _from_array(arr, op: str) -> Tensor:
    """Wrap a numpy/cupy array zero-copy after checking that a tensor can view it."""
    _dtypes.to_dtype(arr.dtype)
    isz = arr.itemsize
    if any(s % isz for s in arr.strides):
        raise ViewError(
            f"{op}: the array's strides {arr.strides} are not a multiple of the element "
            f"size ({isz} bytes); copy it with dt.tensor(a) instead"
        )
    t = _wrap(arr)
    if (t.data_ptr() - t.untyped_storage().data_ptr()) % isz:
        raise ViewError(
            f"{op}: the array starts {t.data_ptr() - t.untyped_storage().data_ptr()} bytes "
            f"into its memory, not a multiple of the element size ({isz} bytes); copy it "
            "with dt.tensor(a) instead"
        )
    return t


def from_numpy(a: np.ndarray) -> Tensor:
    """A tensor that shares memory with the numpy array ``a`` (no copy).

    **Local.** Any strides work, including negative and zero strides (PyTorch rejects
    negative ones): element strides may then be negative, ``is_contiguous()`` is False
    and ``view`` follows PyTorch's stride rule. The storage is the whole buffer of
    ``a``'s memory owner (``a.base`` followed to the end), so views of one numpy array
    share one storage.

    Raises
    ------
    DTypeError
        If ``a`` is not a numpy array (a TypeError); for non-numeric or
        non-native-byte-order dtypes.
    ViewError
        If a byte stride, or ``a``'s byte offset into its owner's memory, is not a
        multiple of the element size (copy with :func:`tensor` instead).
    """
    if not isinstance(a, np.ndarray):
        raise DTypeError(f"from_numpy: expected np.ndarray (got {type(a).__name__})")
    if type(a) is not np.ndarray:
        a = a.view(np.ndarray)
    # Note: negative strides are kept zero-copy (PyTorch raises for them).
    return _from_array(a, "from_numpy")


def tensor(data, dtype=None, device=None) -> Tensor:
    """A new tensor holding a copy of ``data``.

    **Local.**

    Parameters
    ----------
    data : scalar, nested sequence, numpy/cupy array or Tensor
    dtype : dtype-like, optional
        Default: the dtype of an array or tensor; for python data bools -> bool,
        ints -> int64, floats -> the default float dtype.
    device : str or Device, optional
        Default: the device of a tensor or array, else the CPU.

    Returns
    -------
    Tensor
        Contiguous, in a new Storage.
    """
    if isinstance(data, Tensor):
        src = data._arr
    elif B.is_array(data):
        src = data
    else:
        src = np.asarray(data)
        if dtype is None and not isinstance(data, np.generic):
            dtype = _dtypes.python_data_dtype(src)
    dtype = src.dtype if dtype is None else dtype
    dev = B.device_of(src) if device is None else B.as_device(device)
    out = _alloc(src.shape, _dtypes.to_dtype(dtype), dev)
    _copy_into(out, src)
    return _wrap(out)


def as_tensor(data, dtype=None, device=None) -> Tensor:
    """``data`` as a tensor, sharing memory when dtype and device allow.

    **Local.** A tensor with the requested dtype/device is returned as is; an array is
    viewed zero-copy (as :func:`from_numpy`) when its dtype and device match and its
    strides allow; anything else is copied as by :func:`tensor`.
    """
    if isinstance(data, Tensor):
        return data.to(dtype=dtype, device=device)
    if B.is_array(data):
        same_dtype = dtype is None or _dtypes.to_dtype(dtype) == data.dtype
        same_device = device is None or B.as_device(device) == B.device_of(data)
        if same_dtype and same_device:
            try:
                return _from_array(data, "as_tensor")
            except ViewError:
                pass  # strides a tensor cannot describe: copy below
    return tensor(data, dtype=dtype, device=device)


# ------------------------------------------------------------------ factories


def _size(args: tuple) -> tuple:
    """Sizes from varargs or one sequence, validated like PyTorch."""
    size = tuple([operator.index(s) for s in _shape_arg(args)])
    for s in size:
        if s < 0:
            raise ShardingError(
                f"Trying to create tensor with negative dimension {s}: {list(size)}"
            )
    return size


def _is_distributed(device_mesh, placements, name: str) -> bool:
    if device_mesh is None:
        if placements is not None:
            raise PlacementError(f"{name}: placements={placements!r} given without device_mesh")
        return False
    return True


def _distributed(name: str, size: tuple, dtype, device, device_mesh, placements, **other):
    from ..distributed.factory import distributed_factory

    return distributed_factory(
        name,
        size,
        dtype=dtype,
        device_mesh=device_mesh,
        placements=placements,
        device=device,
        **other,
    )


def _fill(out, name: str, *, fill_value=None, low: int = 0, high: int | None = None) -> None:
    """Write the values of factory ``name`` into the fresh array ``out``."""
    if name == "empty":
        return
    if name in ("zeros", "ones", "full"):
        out.fill({"zeros": 0, "ones": 1}.get(name, fill_value))
        return
    kind = {"rand": "uniform", "randn": "normal", "randint": "randint"}[name]
    shape = out.shape
    seed, offset = _random._reserve(out.size)
    values = _random.random_block(
        kind,
        shape,
        (0,) * len(shape),
        shape,
        out.dtype,
        seed,
        offset,
        B.array_module_of(out),
        low=low,
        high=high,
    )
    _copy_into(out, values)


def _dtype_or_default(name: str, dtype) -> np.dtype:
    """The requested dtype, or the default float dtype; random floats must be floating."""
    if dtype is None:
        return _dtypes.get_default_dtype()
    dtype = _dtypes.to_dtype(dtype)
    if name in ("rand", "randn") and dtype.kind != "f":
        raise DTypeError(f"{name}: dtype must be a floating-point dtype, got {dtype}")
    return dtype


def _make(name: str, size: tuple, dtype, device, device_mesh, placements, **other) -> Tensor:
    if _is_distributed(device_mesh, placements, name):
        return _distributed(name, size, dtype, device, device_mesh, placements, **other)
    out = _alloc(size, dtype, B.as_device(device))
    _fill(out, name, **other)
    return _wrap(out)


def empty(*size, dtype=None, device=None, device_mesh=None, placements=None) -> Tensor:
    """Uninitialised tensor of ``size`` (varargs or a tuple). **Local.**

    With ``device_mesh=``: a DTensor (**Collective** over the mesh).
    """
    return _make(
        "empty", _size(size), _dtype_or_default("empty", dtype), device, device_mesh, placements
    )


def zeros(*size, dtype=None, device=None, device_mesh=None, placements=None) -> Tensor:
    """Tensor of zeros. **Local** (with ``device_mesh=``: **Collective**)."""
    return _make(
        "zeros", _size(size), _dtype_or_default("zeros", dtype), device, device_mesh, placements
    )


def ones(*size, dtype=None, device=None, device_mesh=None, placements=None) -> Tensor:
    """Tensor of ones. **Local** (with ``device_mesh=``: **Collective**)."""
    return _make(
        "ones", _size(size), _dtype_or_default("ones", dtype), device, device_mesh, placements
    )


def full(size, fill_value, *, dtype=None, device=None, device_mesh=None, placements=None) -> Tensor:
    """Tensor of ``size`` filled with ``fill_value``.

    **Local** (with ``device_mesh=``: **Collective**). The dtype defaults to the one of
    ``fill_value`` (bool, int64, the default float or complex dtype).
    """
    dtype = _dtypes.infer_dtype(fill_value) if dtype is None else _dtypes.to_dtype(dtype)
    fill_value = _scalar(fill_value)
    return _make(
        "full", _size((size,)), dtype, device, device_mesh, placements, fill_value=fill_value
    )


def rand(*size, dtype=None, device=None, device_mesh=None, placements=None) -> Tensor:
    """Uniform values in [0, 1) from the global generator.

    **Local** (with ``device_mesh=``: **Collective**; same values for the same seed).
    """
    return _make(
        "rand", _size(size), _dtype_or_default("rand", dtype), device, device_mesh, placements
    )


def randn(*size, dtype=None, device=None, device_mesh=None, placements=None) -> Tensor:
    """Standard normal values from the global generator.

    **Local** (with ``device_mesh=``: **Collective**; same values for the same seed).
    """
    return _make(
        "randn", _size(size), _dtype_or_default("randn", dtype), device, device_mesh, placements
    )


def randint(*args, size=None, dtype=None, device=None, device_mesh=None, placements=None) -> Tensor:
    """Integers uniform in ``[low, high)``: ``randint(high, size)`` or ``randint(low, high, size)``.

    **Local** (with ``device_mesh=``: **Collective**). The dtype defaults to int64.
    """
    if size is None:
        if not args:
            raise SignatureError("randint() missing required argument 'size'")
        *bounds, size = args
    else:
        bounds = list(args)
    if len(bounds) == 1:
        low, high = 0, bounds[0]
    elif len(bounds) == 2:
        low, high = bounds
    else:
        raise SignatureError(
            "randint() takes (high, size) or (low, high, size), got "
            f"{len(args)} positional arguments"
        )
    low, high = operator.index(low), operator.index(high)
    if low >= high:
        raise ArgumentError(
            f"random_ expects 'from' to be less than 'to', but got from={low} >= to={high}"
        )
    dtype = _dtypes.int64 if dtype is None else _dtypes.to_dtype(dtype)
    return _make(
        "randint", _size((size,)), dtype, device, device_mesh, placements, low=low, high=high
    )


def _scalar(x):
    return x.item() if isinstance(x, Tensor) else x


def arange(
    start, end=None, step=1, *, dtype=None, device=None, device_mesh=None, placements=None
) -> Tensor:
    """Values ``start, start + step, ...`` below ``end`` (``arange(end)`` starts at 0).

    **Local** (with ``device_mesh=``: **Collective**). The dtype is int64 when all
    arguments are integers, else the default float dtype. Value ``i`` is computed as
    ``start + i * step`` in double precision, then cast.
    """
    start, end, step = _scalar(start), _scalar(end), _scalar(step)
    if end is None:
        start, end = 0, start
    if step == 0:
        raise ArgumentError("arange: step must be nonzero")
    if (step > 0 and start > end) or (step < 0 and start < end):
        raise ArgumentError(
            f"arange: upper bound and larger bound inconsistent with step sign "
            f"(start={start}, end={end}, step={step})"
        )
    integral = all(isinstance(v, (int, np.integer)) for v in (start, end, step))
    n = -((start - end) // step) if integral else math.ceil((end - start) / step)
    if dtype is None:
        dtype = _dtypes.int64 if integral else _dtypes.get_default_dtype()
    dtype = _dtypes.to_dtype(dtype)
    if _is_distributed(device_mesh, placements, "arange"):
        return _distributed(
            "arange", (n,), dtype, device, device_mesh, placements, start=start, end=end, step=step
        )
    dev = B.as_device(device)
    out = _alloc((n,), dtype, dev)
    idx = np.arange(n, dtype=np.int64 if integral else np.float64)
    _copy_into(out, start + idx * step)
    return _wrap(out)


def linspace(
    start, end, steps: int, *, dtype=None, device=None, device_mesh=None, placements=None
) -> Tensor:
    """``steps`` evenly spaced values from ``start`` to ``end`` inclusive.

    **Local** (with ``device_mesh=``: **Collective**). PyTorch's formula: the first half
    counts up from ``start``, the second half down from ``end``, in double precision.
    """
    start, end, steps = _scalar(start), _scalar(end), operator.index(steps)
    if steps < 0:
        raise ArgumentError(f"linspace: number of steps must be non-negative, got {steps}")
    dtype = _dtype_or_default("linspace", dtype)
    if _is_distributed(device_mesh, placements, "linspace"):
        return _distributed(
            "linspace",
            (steps,),
            dtype,
            device,
            device_mesh,
            placements,
            start=start,
            end=end,
            steps=steps,
        )
    out = _alloc((steps,), dtype, B.as_device(device))
    # Note: values are computed in float64 and cast, also for integer dtypes (truncation).
    idx = np.arange(steps, dtype=np.float64)
    step = (end - start) / (steps - 1) if steps > 1 else 0.0
    values = np.where(idx < steps / 2, start + step * idx, end - step * (steps - 1 - idx))
    _copy_into(out, values)
    return _wrap(out)


def eye(
    n: int, m: int | None = None, *, dtype=None, device=None, device_mesh=None, placements=None
) -> Tensor:
    """2-D tensor with ones on the diagonal. **Local** (with ``device_mesh=``: **Collective**)."""
    size = _size((n, n if m is None else m))
    dtype = _dtype_or_default("eye", dtype)
    if _is_distributed(device_mesh, placements, "eye"):
        return _distributed("eye", size, dtype, device, device_mesh, placements)
    out = _alloc(size, dtype, B.as_device(device))
    out.fill(0)
    B.array_module_of(out).fill_diagonal(out, 1)
    return _wrap(out)


# ------------------------------------------------------------------ *_like


def _like(name: str, input, dtype, device, device_mesh, placements, **other) -> Tensor:
    """Factory ``name`` shaped like ``input``; dtype and device inherited unless given.

    A DTensor input (anything with ``device_mesh`` and ``placements``) gives a DTensor
    with its mesh and placements unless others are passed.
    """
    if device_mesh is None and not isinstance(input, Tensor) and hasattr(input, "device_mesh"):
        device_mesh = input.device_mesh
        placements = input.placements if placements is None else placements
    if not isinstance(input, Tensor) and device_mesh is None:
        input = as_tensor(input)
    dtype = input.dtype if dtype is None else _dtypes.to_dtype(dtype)
    if name in ("rand", "randn"):
        _dtype_or_default(name, dtype)
    if _is_distributed(device_mesh, placements, f"{name}_like"):
        return _distributed(
            name, tuple(input.shape), dtype, device, device_mesh, placements, **other
        )
    arr = input._arr
    dev = B.device_of(arr) if device is None else B.as_device(device)
    out = _empty_like_arr(arr, dtype, dev)
    _fill(out, name, **other)
    return _wrap(out)


def empty_like(input, *, dtype=None, device=None, device_mesh=None, placements=None) -> Tensor:
    """Uninitialised, like ``input`` (a dense input's strides are kept). **Local.**"""
    return _like("empty", input, dtype, device, device_mesh, placements)


def zeros_like(input, *, dtype=None, device=None, device_mesh=None, placements=None) -> Tensor:
    """Zeros like ``input``. **Local** (**Collective** for a DTensor/mesh)."""
    return _like("zeros", input, dtype, device, device_mesh, placements)


def ones_like(input, *, dtype=None, device=None, device_mesh=None, placements=None) -> Tensor:
    """Ones like ``input``. **Local** (**Collective** for a DTensor/mesh)."""
    return _like("ones", input, dtype, device, device_mesh, placements)


def full_like(
    input, fill_value, *, dtype=None, device=None, device_mesh=None, placements=None
) -> Tensor:
    """``fill_value`` everywhere, like ``input``. **Local** (**Collective** for a DTensor/mesh)."""
    return _like(
        "full", input, dtype, device, device_mesh, placements, fill_value=_scalar(fill_value)
    )


def rand_like(input, *, dtype=None, device=None, device_mesh=None, placements=None) -> Tensor:
    """Uniform [0, 1) values like ``input``. **Local** (**Collective** for a DTensor/mesh)."""
    return _like("rand", input, dtype, device, device_mesh, placements)


def randn_like(input, *, dtype=None, device=None, device_mesh=None, placements=None) -> Tensor:
    """Standard normal values like ``input``. **Local** (**Collective** for a DTensor/mesh)."""
    return _like("randn", input, dtype, device, device_mesh, placements)
