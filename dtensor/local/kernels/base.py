"""Shared machinery of the local math kernels.

This module owns what every kernel family (pointwise, reductions, linear algebra, nn)
needs: PyTorch's type promotion (dimensioned tensors, zero-dim tensors and python scalars
in three priority tiers), turning arguments into arrays, dim normalisation, broadcast
shapes, the allocation of outputs, ``out=`` / in-place validation, the wording of errors,
and, re-exported from :mod:`dtensor.local.quiet`, running kernels with numpy's
floating-point errors ignored (:func:`quiet_call`).
Kernels are written against an array module ``xp`` taken from their inputs (numpy, or
cupy on a GPU).
"""

from __future__ import annotations

import math

import numpy as np

from placements.errors import DTypeError, ShardingError
from placements.meta import (
    BOOL,
    FLOAT32,
    INT64,
    can_cast,
    combine_categories,
    is_bfloat16,
    promote_types,
)
from placements.meta import broadcast_shapes as _broadcast_shapes
from placements.meta import float_dtype as _float_dtype

from .. import allocator as _allocator
from .. import dtypes as _dtypes
from ..backend import array_module_of, device_of, is_array
from ..quiet import QUIET, quiet_call, quiet_function, quiet_run  # noqa: F401 (re-exported)
from ..tensor import Tensor, _check_no_internal_overlap, wrap_array

FLOAT16 = np.dtype(np.float16)

# Python scalar types (numpy scalars are treated as python scalars of their kind).
SCALAR_TYPES = (bool, int, float, complex, np.generic)
# What ops that accept python scalars take.
TensorLike = Tensor | bool | int | float | complex

_TORCH_NAMES = {
    "bool": "Bool",
    "uint8": "Byte",
    "int8": "Char",
    "int16": "Short",
    "int32": "Int",
    "int64": "Long",
    "float16": "Half",
    "bfloat16": "BFloat16",
    "float32": "Float",
    "float64": "Double",
    "complex64": "ComplexFloat",
    "complex128": "ComplexDouble",
}


def tname(dtype) -> str:
    """PyTorch's name of a dtype (``Float``, ``Long``...), for error messages."""
    return _TORCH_NAMES.get(dtype.name, dtype.name)


def scalar_dtype(value):
    """Dtype of a python scalar as a "wrapped number" in PyTorch's promotion.

    bool -> bool, int -> int64, float -> the default float dtype, complex -> the default
    complex dtype.
    """
    if isinstance(value, (bool, np.bool_)):
        return BOOL
    if isinstance(value, (int, np.integer)):
        return INT64
    if isinstance(value, (float, np.floating)) or is_bfloat16(getattr(value, "dtype", None)):
        return _dtypes.get_default_dtype()  # (an ml_dtypes bfloat16 scalar too)
    if isinstance(value, (complex, np.complexfloating)):
        return _dtypes.default_complex_dtype()
    raise DTypeError(f"unsupported scalar {value!r} of type {type(value).__name__}")


def result_type(*operands):
    """PyTorch's result dtype of operands (arrays or python scalars).

    Dimensioned arrays decide; a zero-dim array or a python scalar only matters when its
    category (bool < integer < floating < complex) is higher: ``float32`` array with a
    python float gives ``float32``, ``int64`` array with a python float gives the default
    float dtype, ``int32`` array with a python int gives ``int32``. These are the three
    tiers of :func:`placements.meta.result_dtype` (the rules' answer), read from arrays
    and python scalars.
    """
    # Note: the tiers are walked here rather than through meta.result_dtype, which takes
    # objects with ``shape``/``dtype``/``is_scalar``: wrapping each operand for it doubles
    # the cost of this function, which every local op's slow path calls.
    # Note: numpy (NEP 50) also treats python scalars as weak, but gives int64 + 2.5 ->
    # float64, int + float tensors -> float64 and uint64 + int64 -> float64; PyTorch's table
    # is followed here (the default float dtype, the float tensor's dtype). numpy scalars
    # (np.float64(2.5)) count as python scalars of their kind.
    dim = zero = wrapped = None
    for o in operands:
        if isinstance(o, SCALAR_TYPES):
            wrapped = promote_types(wrapped, scalar_dtype(o))
        elif o.ndim:
            dim = promote_types(dim, o.dtype)
        else:
            zero = promote_types(zero, o.dtype)
    return combine_categories(dim, combine_categories(zero, wrapped))


def float_dtype(dtype):
    """``dtype`` when floating or complex, else the current default float dtype (int ->
    float ops): :func:`placements.meta.float_dtype`."""
    return _float_dtype(dtype, _dtypes.get_default_dtype())


def acc_dtype(dtype):
    """Accumulation dtype of sums and normalisations: float16 and bfloat16 accumulate in
    float32."""
    # Note: like PyTorch on CPU, float16 and bfloat16 reductions accumulate in float32
    # (numpy would accumulate in float16; ml_dtypes' bfloat16 loops round every step).
    return FLOAT32 if dtype == FLOAT16 or is_bfloat16(dtype) else dtype


def opmath_dtype(dtype):
    """The dtype elementwise math on ``dtype`` computes in (PyTorch's ``opmath_type``):
    float32 for bfloat16, ``dtype`` itself otherwise."""
    # Note: numpy has no bfloat16 loops; ml_dtypes' round after every operation, so a
    # formula of several steps (gelu, lerp, addcdiv...) would round at each. Like PyTorch,
    # bfloat16 math computes in float32 and rounds once, on store. float16 keeps numpy's
    # loops (each op correctly rounded; float16 reductions accumulate in float32).
    return FLOAT32 if is_bfloat16(dtype) else dtype


def store(out, r, dtype):
    """Result ``r`` (computed in :func:`opmath_dtype`) rounded to ``dtype``: written into
    ``out`` when given (returned), else a new array (``r`` itself when already ``dtype``)."""
    if out is None:
        return r if r.dtype == dtype else r.astype(dtype)
    if r is not out:
        xp_of(r).copyto(out, r, casting="unsafe")
    return out


class OperandTypeError(DTypeError):
    """An argument that is neither a Tensor, an array nor (where allowed) a python scalar.

    Operators catch it to return NotImplemented, so that python tries the other operand.
    """


def as_array(op: str, x):
    """The array of a Tensor (a numpy/cupy ndarray passes through)."""
    try:
        return x._arr
    except AttributeError:
        if is_array(x):
            return x
        raise OperandTypeError(f"{op}: expected a Tensor, got {type(x).__name__}") from None


def operand(op: str, x):
    """The array of a Tensor, or a python scalar as is (for ops that accept scalars)."""
    if isinstance(x, SCALAR_TYPES):
        return x
    return as_array(op, x)


#: The values of each integer dtype, ``(min, max)``: a python int outside them wraps when
#: it meets the dtype (:func:`cast_scalar`), so the short paths that hand a python int to a
#: ufunc check it against these first (a cheap range check; numpy 2 would compare exactly).
INT_RANGES = {
    np.dtype(t): (int(np.iinfo(t).min), int(np.iinfo(t).max)) for t in "bBhHiIlLqQ"
}


def cast_scalar(value, dtype, op: str = ""):
    """A python scalar as a numpy scalar of ``dtype``, wrapping integers like a C cast.

    PyTorch casts a wrapped number to the computation dtype (``uint8 tensor - 1`` wraps
    to 255), where numpy raises OverflowError. A python int beyond 64 bits has no such
    cast (PyTorch refuses it too): DTypeError naming ``op``.
    """
    # Note: numpy raises OverflowError for an out-of-range python int (uint8 tensor - 1);
    # PyTorch wraps it like a C cast, as done here.
    try:
        return dtype.type(value)
    except OverflowError:
        if isinstance(value, int) and not -(1 << 63) <= value < (1 << 64):
            raise DTypeError(
                f"{op or 'cast'}: the python int {value} does not fit in 64 bits, so it "
                f"cannot be converted to {dtype.name}"
            ) from None
        return np.asarray(value).astype(dtype)[()]


def cast(x, dtype, op: str = ""):
    """An operand (array or python scalar) in ``dtype``; arrays are copied only if needed.
    Errors name ``op``."""
    if isinstance(x, SCALAR_TYPES):
        return cast_scalar(x, dtype, op)
    return x if x.dtype == dtype else x.astype(dtype)


def broadcast_shapes(op: str, *shapes) -> tuple:
    """Broadcast shape of ``shapes``; raises ShardingError naming ``op`` and the shapes."""
    return _broadcast_shapes(op, shapes)


def shape_of(x) -> tuple:
    """Shape of an operand (``()`` for a python scalar)."""
    return () if isinstance(x, SCALAR_TYPES) else x.shape


def wrap(r) -> Tensor:
    """Wrap a kernel result (numpy turns 0-d results into scalars; they become 0-d arrays)."""
    if isinstance(r, np.generic):
        r = np.asarray(r)
    return wrap_array(r)


def new_array(shape: tuple, dtype, like):
    """A fresh uninitialised array on ``like``'s device, from the caching allocator."""
    return _allocator.empty_array(shape, dtype, device_of(like))


def out_buffer(shape: tuple, dtype, like):
    """Output buffer for a kernel that writes every element, passed as ``out=``.

    The one place that decides how outputs are allocated: outputs of at least
    ``_allocator.POOL_MIN_BYTES`` come from the caching allocator; smaller ones return
    None so that the array module allocates them itself (its small-block cache is faster).
    """
    if math.prod(shape) * dtype.itemsize < _allocator.POOL_MIN_BYTES:
        return None
    return new_array(shape, dtype, like)


def check_out(op: str, out, shape: tuple, dtype):
    """Validate an ``out=`` tensor (or an in-place op's self) before anything is written.

    Its shape must be the result shape, the result dtype must be castable to its dtype
    (PyTorch's rule) and no two of its elements may share memory. Returns its array.
    """
    arr = as_array(op, out)
    # Note: PyTorch resizes a wrongly shaped ``out=`` tensor (with a warning); here the
    # shape must match exactly, as for in-place ops.
    if arr.shape != tuple(shape):
        raise ShardingError(
            f"{op}: output with shape {list(arr.shape)} doesn't match the broadcast shape "
            f"{list(shape)}"
        )
    if not can_cast(dtype, arr.dtype):
        raise DTypeError(
            f"{op}: result type {tname(dtype)} can't be cast to the desired output type "
            f"{tname(arr.dtype)}"
        )
    _check_no_internal_overlap(arr, op)
    return arr


def xp_of(*operands):
    """Array module (numpy or cupy) of the first array among ``operands``."""
    for x in operands:
        if not isinstance(x, SCALAR_TYPES):
            return array_module_of(x)
    return np


def copy_to(out, a):
    """``a`` copied into ``out`` (or a fresh contiguous copy when ``out`` is None)."""
    if out is None:
        out = new_array(a.shape, a.dtype, a)
    xp_of(a).copyto(out, a)
    return out
