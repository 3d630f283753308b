"""Dtypes of the local tensor: names, the default float dtype, conversion and inference.

Dtypes are plain ``numpy.dtype`` objects (cupy uses the same ones). This module owns
the exported names (``dt.float32`` ...), the process-wide default floating dtype
(``float32`` unless :func:`set_default_dtype` changed it), :func:`to_dtype` which turns
what users write (dtypes, python types, strings) into a dtype, and the dtype inference
of ``dt.tensor`` from python data.

``bfloat16`` is ml_dtypes' numpy dtype (a runtime dependency): numpy has no such type and
gives it the kind 'V', so dtype checks read kinds through
:func:`placements.meta.dtype_kind`. Kernels compute it in float32 and round on store
(``dtensor.local.kernels``), and reductions over MPI widen it to float32 (MPI has no
bfloat16 datatype).
"""

from __future__ import annotations

import builtins

import numpy as np

from placements.errors import DTypeError
from placements.meta import as_dtype, complex_of, dtype_kind, is_bfloat16
from placements.meta import bfloat16 as _bfloat16

__all__ = [
    "bfloat16",  # noqa: F822 - read lazily (__getattr__)
    "bool_",
    "cdouble",
    "cfloat",
    "complex64",
    "complex128",
    "default_complex_dtype",
    "double",
    "float16",
    "float32",
    "float64",
    "get_default_dtype",
    "half",
    "infer_dtype",
    "int8",
    "int16",
    "int32",
    "int64",
    "long",
    "python_data_dtype",
    "set_default_dtype",
    "short",
    "to_dtype",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
]

float16 = np.dtype(np.float16)
float32 = np.dtype(np.float32)
float64 = np.dtype(np.float64)
complex64 = np.dtype(np.complex64)
complex128 = np.dtype(np.complex128)
int8 = np.dtype(np.int8)
int16 = np.dtype(np.int16)
int32 = np.dtype(np.int32)
int64 = np.dtype(np.int64)
uint8 = np.dtype(np.uint8)
uint16 = np.dtype(np.uint16)
uint32 = np.dtype(np.uint32)
uint64 = np.dtype(np.uint64)
# Exported as ``dt.bool`` by the package (a module-level ``bool`` would shadow the builtin).
bool_ = np.dtype(np.bool_)

# PyTorch's aliases (``dt.float`` and ``dt.int`` are bound in the package namespace).
half = float16
double = float64
short = int16
long = int64
cfloat = complex64
cdouble = complex128

_SUPPORTED_KINDS = frozenset("biufc")
_FLOAT_DEFAULTS = (float16, float32, float64)  # and bfloat16 (is_bfloat16)

_default_float = float32


def __getattr__(name: str) -> np.dtype:
    # ``bfloat16``, read lazily: ml_dtypes is imported on first use (placements.meta.bfloat16)
    if name == "bfloat16":
        return _bfloat16()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_default_dtype() -> np.dtype:
    """Return the default floating dtype (``float32`` unless changed).

    **Local.**

    Returns
    -------
    numpy.dtype
    """
    return _default_float


def set_default_dtype(dtype) -> None:
    """Set the default floating dtype used for python floats and float factories.

    **Local** (process-wide state; set it identically on every rank).

    Parameters
    ----------
    dtype : dtype-like
        ``float16``, ``bfloat16``, ``float32`` or ``float64``.

    Raises
    ------
    DTypeError
        If ``dtype`` is not one of these floating dtypes.
    """
    global _default_float
    d = to_dtype(dtype)
    if d not in _FLOAT_DEFAULTS and not is_bfloat16(d):
        raise DTypeError(
            "set_default_dtype: only floating-point dtypes (float16, bfloat16, float32, "
            f"float64) can be the default dtype, got {d}"
        )
    _default_float = d


def default_complex_dtype() -> np.dtype:
    """Complex dtype matching the default float dtype (``complex64`` for ``float32``).

    **Local.**
    """
    return complex_of(_default_float)


def to_dtype(x) -> np.dtype:
    """Convert a dtype-like to a supported ``numpy.dtype``.

    **Local.**

    Parameters
    ----------
    x : numpy.dtype, numpy scalar type, python type, or str
        python ``float`` -> the default float dtype, ``int`` -> ``int64``,
        ``bool`` -> ``bool``, ``complex`` -> the default complex dtype. Strings use
        PyTorch's names where PyTorch has one (``"float"``, ``"int"``, ``"long"`` ...),
        else numpy's (``"float64"``, ``"i4"`` ...); ``"bfloat16"`` is ml_dtypes' bfloat16.

    Returns
    -------
    numpy.dtype

    Raises
    ------
    DTypeError
        For anything that is not a boolean, integer, floating or complex dtype.
    """
    # Note: PyTorch and numpy map the python type ``float`` to float64; here it means the
    # default float dtype (float32 unless set_default_dtype changed it), and dtype strings
    # follow PyTorch ("float" is float32), as the sharding rules read them (placements.meta).
    d = x if isinstance(x, np.dtype) else as_dtype(x, _default_float)
    if dtype_kind(d) not in _SUPPORTED_KINDS or not d.isnative or d.fields is not None:
        raise DTypeError(
            f"unsupported dtype {d}: tensors hold native-byte-order boolean, integer, "
            "floating or complex values"
        )
    return d


def infer_dtype(data) -> np.dtype:
    """Dtype that ``dt.tensor(data)`` gives when no dtype is passed.

    **Local.** Arrays, numpy scalars and tensors keep their dtype; python data goes
    through :func:`python_data_dtype`.

    Parameters
    ----------
    data : scalar, nested sequence, array or tensor

    Returns
    -------
    numpy.dtype
    """
    dtype = getattr(data, "dtype", None)
    if isinstance(dtype, np.dtype):
        return to_dtype(dtype)
    return python_data_dtype(np.asarray(data))


def python_data_dtype(arr: np.ndarray) -> np.dtype:
    """Dtype of python data, given the array numpy built from it.

    **Local.** Follows PyTorch: all bools -> ``bool``, ints (and bools) -> ``int64``,
    any float -> the default float dtype, any complex -> the default complex dtype, an
    empty sequence -> the default float dtype.

    Raises
    ------
    DTypeError
        When the data is not numeric (strings, objects).
    OverflowError
        For python ints that do not fit int64.
    """
    kind = arr.dtype.kind
    if kind == "f":
        # numpy gives float64 for python floats and for empty sequences.
        return _default_float
    if kind == "c":
        return default_complex_dtype()
    if kind == "b":
        return bool_
    if kind == "i":
        return int64
    if kind == "u" or (kind == "O" and all(isinstance(v, builtins.int) for v in arr.flat)):
        raise OverflowError("value cannot be converted to type int64 without overflow")
    raise DTypeError(
        f"could not infer a dtype from python data of {arr.dtype} values (tensors hold "
        "bool, int, float or complex values)"
    )
