"""Creation of local tensors: from data, from arrays, and the factory functions.

This module owns ``tensor`` (copies), ``from_numpy`` and ``as_tensor`` (zero-copy when
possible) and the factories (``empty``, ``zeros``, ``ones``, ``full``, ``arange``,
``linspace``, ``eye``, ``rand``, ``randn``, ``randint`` and the ``*_like`` forms).
Options follow PyTorch's TensorOptions: a missing dtype comes from the factory's rule
(python floats -> the default float dtype, ints -> int64, bools -> bool), a missing
device is the CPU, and ``*_like`` inherit both from their input. Every array is
allocated by :func:`dtensor.local.allocator.empty_array` and never zero-filled when it is
fully written.

Every factory is written once, as a *request* function (:data:`REQUESTS`): it validates
the arguments and resolves dtype and device, and returns a :class:`Request`. The local
factory builds the whole tensor from it; the mesh-aware twins in
:mod:`dtensor.distributed.factory` build one shard from the same request. The values are
written by one routine for both (:func:`fill_block`): each element's value is a function of
its global index (random values of its global counter), so a shard equals the matching
block of the whole tensor. This module also installs the constructors of :class:`Tensor`
(``Tensor(data)`` and ``new_empty``/``new_zeros``/``new_ones``/``new_full``/
``new_tensor``), which need the factories.
"""

from __future__ import annotations

import functools
import inspect
import math
import operator
from dataclasses import dataclass, field

import numpy as np

from placements.errors import (
    ArgumentError,
    DTypeError,
    ShardingError,
    SignatureError,
    ViewError,
)
from placements.meta import is_floating

from . import allocator as _allocator
from . import backend
from . import dtypes as _dtypes
from . import grad_engine as _grad_engine  # noqa: F401  (installs the autograd API on Tensor)
from . import rng as _random
from .quiet import quiet_call
from .tensor import Tensor, _alloc, _copy_into, _empty_like_arr, _shape_arg, wrap_array

__all__ = [
    "REQUESTS",
    "Request",
    "arange",
    "as_tensor",
    "empty",
    "empty_like",
    "eye",
    "fill_block",
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
    t = wrap_array(arr)
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


def tensor(data, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
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
    requires_grad : bool
        Make it a leaf that requires grad.

    Returns
    -------
    Tensor
        Contiguous, in a new Storage.
    """
    if isinstance(data, Tensor):
        src = data._arr
    elif backend.is_array(data):
        src = data
    else:
        src = np.asarray(data)
        if dtype is None and not isinstance(data, np.generic):
            dtype = _dtypes.python_data_dtype(src)
    dtype = src.dtype if dtype is None else dtype
    dev = backend.device_of(src) if device is None else backend.as_device(device)
    out = _alloc(src.shape, _dtypes.to_dtype(dtype), dev)
    _copy_into(out, src)
    t = wrap_array(out)
    return t.requires_grad_() if requires_grad else t


def as_tensor(data, dtype=None, device=None) -> Tensor:
    """``data`` as a tensor, sharing memory when dtype and device allow.

    **Local.** A tensor with the requested dtype/device is returned as is; an array is
    viewed zero-copy (as :func:`from_numpy`) when its dtype and device match and its
    strides allow; anything else is copied as by :func:`tensor`.
    """
    if isinstance(data, Tensor):
        return data.to(dtype=dtype, device=device)
    if backend.is_array(data):
        same_dtype = dtype is None or _dtypes.to_dtype(dtype) == data.dtype
        same_device = device is None or backend.as_device(device) == backend.device_of(data)
        if same_dtype and same_device:
            try:
                return _from_array(data, "as_tensor")
            except ViewError:
                pass  # strides a tensor cannot describe: copy below
    return tensor(data, dtype=dtype, device=device)


# ------------------------------------------------------------------ requests


@dataclass(frozen=True)
class Request:
    """A factory call with its arguments resolved: what to build, before any allocation.

    ``name`` is the factory kind (``empty``, ``zeros``, ``ones``, ``full``, ``arange``,
    ``linspace``, ``eye``, ``rand``, ``randn``, ``randint``), ``size`` the (global) shape,
    ``dtype`` the resolved dtype, ``device`` the requested device (None: the default, or
    the device of ``like``), ``like`` the input of a ``*_like`` factory (its dense strides
    are kept by the local build) and ``values`` the kind's value arguments (``fill_value``;
    ``start``/``step``; ``start``/``end``/``steps``; ``low``/``high``).
    """

    name: str
    size: tuple[int, ...]
    dtype: np.dtype
    device: object = None
    like: object = None
    values: dict = field(default_factory=dict)


def _size(args: tuple) -> tuple:
    """Sizes from varargs or one sequence, validated like PyTorch."""
    size = tuple([operator.index(s) for s in _shape_arg(args)])
    for s in size:
        if s < 0:
            raise ShardingError(
                f"Trying to create tensor with negative dimension {s}: {list(size)}"
            )
    return size


def _dtype_or_default(name: str, dtype) -> np.dtype:
    """The requested dtype, or the default float dtype; random floats must be floating."""
    if dtype is None:
        return _dtypes.get_default_dtype()
    dtype = _dtypes.to_dtype(dtype)
    if name in ("rand", "randn") and not is_floating(dtype):
        raise DTypeError(f"{name}: dtype must be a floating-point dtype, got {dtype}")
    return dtype


def _scalar(x):
    return x.item() if isinstance(x, Tensor) else x


def empty(*size, dtype=None, device=None) -> Request:
    """Uninitialised tensor of ``size`` (varargs or a tuple). **Local.**"""
    return Request("empty", _size(size), _dtype_or_default("empty", dtype), device)


def zeros(*size, dtype=None, device=None) -> Request:
    """Tensor of zeros. **Local.**"""
    return Request("zeros", _size(size), _dtype_or_default("zeros", dtype), device)


def ones(*size, dtype=None, device=None) -> Request:
    """Tensor of ones. **Local.**"""
    return Request("ones", _size(size), _dtype_or_default("ones", dtype), device)


def full(size, fill_value, *, dtype=None, device=None) -> Request:
    """Tensor of ``size`` filled with ``fill_value``.

    **Local.** The dtype defaults to the one of ``fill_value`` (bool, int64, the default
    float or complex dtype).
    """
    dtype = _dtypes.infer_dtype(fill_value) if dtype is None else _dtypes.to_dtype(dtype)
    values = {"fill_value": _scalar(fill_value)}
    return Request("full", _size((size,)), dtype, device, values=values)


def rand(*size, dtype=None, device=None) -> Request:
    """Uniform values in [0, 1) from the global generator. **Local.**"""
    return Request("rand", _size(size), _dtype_or_default("rand", dtype), device)


def randn(*size, dtype=None, device=None) -> Request:
    """Standard normal values from the global generator. **Local.**"""
    return Request("randn", _size(size), _dtype_or_default("randn", dtype), device)


def randint(*args, size=None, dtype=None, device=None) -> Request:
    """Integers uniform in ``[low, high)``: ``randint(high, size)`` or ``randint(low, high, size)``.

    **Local.** The dtype defaults to int64.
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
    return Request("randint", _size((size,)), dtype, device, values={"low": low, "high": high})


def arange(start, end=None, step=1, *, dtype=None, device=None) -> Request:
    """Values ``start, start + step, ...`` below ``end`` (``arange(end)`` starts at 0).

    **Local.** The dtype is int64 when all arguments are integers, else the default float
    dtype. Value ``i`` is computed as ``start + i * step`` in double precision, then cast.
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
    return Request("arange", (n,), _dtypes.to_dtype(dtype), device,
                   values={"start": start, "step": step})


def linspace(start, end, steps: int, *, dtype=None, device=None) -> Request:
    """``steps`` evenly spaced values from ``start`` to ``end`` inclusive.

    **Local.** PyTorch's formula: the first half counts up from ``start``, the second half
    down from ``end``, in double precision.
    """
    start, end, steps = _scalar(start), _scalar(end), operator.index(steps)
    if steps < 0:
        raise ArgumentError(f"linspace: number of steps must be non-negative, got {steps}")
    return Request("linspace", (steps,), _dtype_or_default("linspace", dtype), device,
                   values={"start": start, "end": end, "steps": steps})


def eye(n: int, m: int | None = None, *, dtype=None, device=None) -> Request:
    """2-D tensor with ones on the diagonal. **Local.**"""
    size = _size((n, n if m is None else m))
    return Request("eye", size, _dtype_or_default("eye", dtype), device)


def _like(name: str, input, dtype, device, **values) -> Request:
    """Factory ``name`` shaped like ``input``; dtype and device inherited unless given.

    A Tensor (or an array, viewed as one) is kept as ``like``; another object with
    ``shape`` and ``dtype`` (a DTensor) gives its metadata only; other data is taken as by
    :func:`as_tensor`.
    """
    if not isinstance(input, Tensor) and (backend.is_array(input) or not hasattr(input, "dtype")):
        input = as_tensor(input)
    dtype = _dtypes.to_dtype(input.dtype) if dtype is None else _dtypes.to_dtype(dtype)
    if name in ("rand", "randn"):
        _dtype_or_default(name, dtype)
    return Request(name, tuple(input.shape), dtype, device, like=input, values=values)


def empty_like(input, *, dtype=None, device=None) -> Request:
    """Uninitialised, like ``input`` (a dense input's strides are kept). **Local.**"""
    return _like("empty", input, dtype, device)


def zeros_like(input, *, dtype=None, device=None) -> Request:
    """Zeros like ``input``. **Local.**"""
    return _like("zeros", input, dtype, device)


def ones_like(input, *, dtype=None, device=None) -> Request:
    """Ones like ``input``. **Local.**"""
    return _like("ones", input, dtype, device)


def full_like(input, fill_value, *, dtype=None, device=None) -> Request:
    """``fill_value`` everywhere, like ``input``. **Local.**"""
    return _like("full", input, dtype, device, fill_value=_scalar(fill_value))


def rand_like(input, *, dtype=None, device=None) -> Request:
    """Uniform [0, 1) values like ``input``. **Local.**"""
    return _like("rand", input, dtype, device)


def randn_like(input, *, dtype=None, device=None) -> Request:
    """Standard normal values like ``input``. **Local.**"""
    return _like("randn", input, dtype, device)


#: The request function of every factory, by public name.
REQUESTS = {
    fn.__name__: fn
    for fn in (
        empty, zeros, ones, full, rand, randn, randint, arange, linspace, eye, empty_like,
        zeros_like, ones_like, full_like, rand_like, randn_like,
    )
}


# ------------------------------------------------------------------ values


def _arange_values(xp, i, *, start, step):
    return start + i * step


def _linspace_values(xp, i, *, start, end, steps):
    # PyTorch's formula: count up from start in the first half, down from end in the second
    step = (end - start) / (steps - 1) if steps > 1 else 0.0
    return xp.where(i < steps / 2, start + step * i, end - step * (steps - 1 - i))


def _eye_values(xp, i, j):
    return i == j


# Factories whose value is a function of the element's global index (one index array per dim).
_INDEX_VALUES = {"arange": _arange_values, "linspace": _linspace_values, "eye": _eye_values}
_RANDOM = {"rand": "uniform", "randn": "normal", "randint": "randint"}
_CONSTANT = {"zeros": 0, "ones": 1}


def reserve(req: Request) -> tuple[int, int] | None:
    """The generator's ``(seed, offset)`` for a random request (advancing the global
    generator by the whole tensor's element count), else None. **Local**; every rank of a
    distributed factory reserves the same range, so the generator stays in step."""
    if req.name not in _RANDOM:
        return None
    return _random._reserve(math.prod(req.size))


def fill_block(req: Request, out, offsets: tuple[int, ...], counters: tuple[int, int] | None):
    """Write the values of the block of ``req``'s tensor that starts at global index
    ``offsets`` (and has ``out``'s shape) into the fresh array ``out``. **Local**.

    ``counters`` is :func:`reserve`'s answer for a random request. The one value routine of
    the local factories (``offsets`` all 0) and the distributed ones (a shard's offsets).
    """
    name = req.name
    if name == "empty":
        return
    if name in _CONSTANT or name == "full":
        quiet_call(out.fill, _CONSTANT.get(name, req.values.get("fill_value")))
        return
    xp = backend.array_module_of(out)
    if name in _RANDOM:
        seed, offset = counters
        values = _random.random_block(
            _RANDOM[name], req.size, offsets, out.shape, out.dtype, seed, offset, xp,
            **req.values,
        )
    else:
        shape = out.shape
        idx = [xp.arange(o, o + n).reshape((-1,) + (1,) * (len(shape) - d - 1))
               for d, (o, n) in enumerate(zip(offsets, shape))]
        values = _INDEX_VALUES[name](xp, *idx, **req.values)
    _copy_into(out, values)


def build(req: Request) -> Tensor:
    """The local tensor of a request. **Local**."""
    like = req.like
    with _allocator.allocating(req.name, req.size, req.dtype):
        if like is not None and isinstance(like, Tensor):
            arr = like._arr
            dev = backend.device_of(arr) if req.device is None else backend.as_device(req.device)
            out = _empty_like_arr(arr, req.dtype, dev)
        else:
            dev = backend.CPU if req.device is None else backend.as_device(req.device)
            out = _alloc(req.size, req.dtype, dev)
    fill_block(req, out, (0,) * len(req.size), reserve(req))
    return wrap_array(out)


def _local(request):
    """The local factory of a request function (same signature and documentation)."""

    @functools.wraps(request)
    def factory(*args, requires_grad: bool = False, **kwargs) -> Tensor:
        t = build(request(*args, **kwargs))
        return t.requires_grad_() if requires_grad else t

    sig = inspect.signature(request)
    grad = inspect.Parameter("requires_grad", inspect.Parameter.KEYWORD_ONLY, default=False)
    factory.__signature__ = sig.replace(parameters=[*sig.parameters.values(), grad],
                                        return_annotation=Tensor)
    return factory


empty = _local(empty)
zeros = _local(zeros)
ones = _local(ones)
full = _local(full)
rand = _local(rand)
randn = _local(randn)
randint = _local(randint)
arange = _local(arange)
linspace = _local(linspace)
eye = _local(eye)
empty_like = _local(empty_like)
zeros_like = _local(zeros_like)
ones_like = _local(ones_like)
full_like = _local(full_like)
rand_like = _local(rand_like)
randn_like = _local(randn_like)


# ------------------------------------------------------------------ Tensor constructors


def _tensor_init(self, data) -> None:
    """``Tensor(data)`` is ``dt.tensor(data)``. **Local**."""
    self._arr = tensor(data)._arr
    self._storage = None
    self._std = None


def _new_options(self, dtype, device) -> dict:
    return {
        "dtype": self._arr.dtype if dtype is None else dtype,
        "device": backend.device_of(self._arr) if device is None else device,
    }


def _new_empty(self, *size, dtype=None, device=None) -> Tensor:
    """Uninitialised tensor; dtype/device default to this tensor's. **Local.**"""
    return empty(*size, **_new_options(self, dtype, device))


def _new_zeros(self, *size, dtype=None, device=None) -> Tensor:
    """Zeros; dtype/device default to this tensor's. **Local.**"""
    return zeros(*size, **_new_options(self, dtype, device))


def _new_ones(self, *size, dtype=None, device=None) -> Tensor:
    """Ones; dtype/device default to this tensor's. **Local.**"""
    return ones(*size, **_new_options(self, dtype, device))


def _new_full(self, size, fill_value, *, dtype=None, device=None) -> Tensor:
    """Filled with ``fill_value``; dtype/device default to this tensor's. **Local.**"""
    return full(size, fill_value, **_new_options(self, dtype, device))


def _new_tensor(self, data, dtype=None, device=None) -> Tensor:
    """Copy of ``data``; dtype/device default to this tensor's. **Local.**"""
    return tensor(data, **_new_options(self, dtype, device))


for _name, _fn in (("__init__", _tensor_init), ("new_empty", _new_empty),
                   ("new_zeros", _new_zeros), ("new_ones", _new_ones),
                   ("new_full", _new_full), ("new_tensor", _new_tensor)):
    _fn.__name__ = _name
    _fn.__qualname__ = f"Tensor.{_name}"
    setattr(Tensor, _name, _fn)
