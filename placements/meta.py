"""PyTorch's metadata semantics, written once: dims, broadcasting, dtypes and view shapes.

This module owns the answers that both the sharding rules (on global shapes) and the local
tensor (on its own shape) must give identically, as pure functions of shapes, ints and
dtypes:

- dims: :func:`norm_dim` (PyTorch's ``maybe_wrap_dim``), :func:`norm_dims` (a reduction's
  ``dim``), :func:`nonscalar_dim`, :func:`as_dims`;
- broadcasting and reductions: :func:`broadcast_shapes`, :func:`reduced_shape`;
- dtypes: PyTorch's type promotion (:func:`promote_types`, :func:`combine_categories`,
  :func:`scalar_dtype`, :func:`result_dtype`), :func:`can_cast`, ``dtype=`` arguments
  (:data:`TORCH_DTYPE_NAMES`, :func:`as_dtype`), :func:`float_dtype`, :func:`real_dtype`,
  :func:`check_embedding_indices`, and the kind of a dtype (:func:`dtype_kind`,
  :func:`is_floating`: ``bfloat16``, from ml_dtypes, is a float whose numpy kind is 'V';
  :func:`bfloat16` and :func:`is_bfloat16` import ml_dtypes on first need, :data:`BFLOAT16`
  is that dtype, read lazily, and :class:`DtypeTable` a dict whose bfloat16 entries are
  added on the first lookup that could need them);
- the shape checks of view ops, each returning the normalised values the op needs:
  :func:`infer_size` (view/reshape), :func:`expand_shape`, :func:`narrow_args`,
  :func:`select_args`, :func:`squeeze_dims`, :func:`permute_dims`,
  :func:`transpose_dims`, :func:`t_dims`, :func:`movedim_dims`, :func:`flatten_shape`,
  :func:`unflatten_shape`, :func:`split_dim`, :func:`split_sizes`, :func:`chunk_sizes`,
  :func:`index_shape` (basic indexing).

Errors use PyTorch's wording and the types of :mod:`placements.errors`: a dim or an index
out of range is a :class:`~placements.errors.DimError` (an IndexError), a bad view size a
:class:`~placements.errors.ViewError` (a RuntimeError), a value that is not an int where
one is needed a :class:`~placements.errors.DTypeError` (a TypeError).

Pure: numpy only (with ml_dtypes, numpy's ``bfloat16``, imported on first need: its import
costs about 0.8 s of CPU, which every process of a job would pay; and the memo helper of
:mod:`placements.cache`), no placements, no data.
Everything here is **Local**.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from .cache import memoize
from .errors import ArgumentError, DimError, DTypeError, ShardingError, ViewError

__all__ = [
    "BFLOAT16",  # noqa: F822 - read lazily (__getattr__)
    "BOOL",
    "FLOAT32",
    "INT64",
    "TORCH_DTYPE_NAMES",
    "DtypeTable",
    "as_dims",
    "as_dtype",
    "bfloat16",
    "broadcast_shapes",
    "can_cast",
    "check_embedding_indices",
    "chunk_sizes",
    "combine_categories",
    "complex_of",
    "dtype_kind",
    "dtype_of_char",
    "expand_shape",
    "flatten_shape",
    "float_dtype",
    "index_shape",
    "infer_size",
    "is_advanced_entry",
    "is_bfloat16",
    "is_floating",
    "movedim_dims",
    "narrow_args",
    "nonscalar_dim",
    "norm_dim",
    "norm_dims",
    "parse_index",
    "permute_dims",
    "promote_types",
    "real_dtype",
    "reduced_shape",
    "result_dtype",
    "scalar_dtype",
    "select_args",
    "split_dim",
    "split_sizes",
    "squeeze_dims",
    "t_dims",
    "transpose_dims",
    "unflatten_shape",
]


# -- dims ------------------------------------------------------------------------------------
def norm_dim(dim: object, ndim: int, op: str | None = None) -> int:
    """A dim in ``[0, ndim)`` (a 0-d tensor accepts 0 and -1, as in PyTorch).

    The one dim check of the project: the rules and the local tensor use it, so a local
    Tensor and a DTensor raise the same error.

    Raises
    ------
    DimError
        PyTorch's wording after the op's name (no prefix when ``op`` is None):
        ``sum: Dimension out of range (expected to be in range of [-2, 1], but got 3)``.
    DTypeError
        If ``dim`` is not an integer (a TypeError).
    """
    try:
        d = operator.index(dim)  # type: ignore[arg-type]
    except TypeError:
        where = f"{op}: " if op else ""
        raise DTypeError(f"{where}dim must be an int, got {type(dim).__name__} ({dim!r})") from None
    n = ndim if ndim else 1
    if not -n <= d < n:
        where = f"{op}: " if op else ""
        raise DimError(
            f"{where}Dimension out of range (expected to be in range of [{-n}, {n - 1}], "
            f"but got {d})"
        )
    return d % n if ndim else 0


def nonscalar_dim(dim: object, ndim: int, op: str) -> int:
    """:func:`norm_dim` for an op that needs at least one dim (``size(d)``, ``unbind``).

    Raises
    ------
    DimError
        ``unbind: dimension specified as 0 but tensor has no dimensions`` on a 0-d tensor;
        otherwise as :func:`norm_dim`.
    """
    if not ndim:
        raise DimError(f"{op}: dimension specified as {dim} but tensor has no dimensions")
    return norm_dim(dim, ndim, op)


def norm_dims(op: str, dim: object, ndim: int) -> tuple[int, ...]:
    """A reduction's ``dim`` (None, int or sequence) as sorted axes; None or (): all.

    Every given dim is checked (a 0-d tensor accepts 0 and -1 and has no axes).

    Raises
    ------
    ShardingError
        A dim given twice (``sum: dim [0, 0] has a dim that appears multiple times``).
    DimError, DTypeError
        As :func:`norm_dim`.
    """
    if dim is None:
        return tuple(range(ndim))
    if isinstance(dim, (int, np.integer)) or not hasattr(dim, "__iter__"):
        d = norm_dim(dim, ndim, op)  # one dim (a DTypeError naming the op if not an int)
        return (d,) if ndim else ()
    axes = tuple(norm_dim(d, ndim, op) for d in dim)  # type: ignore[attr-defined]
    if len(set(axes)) != len(axes):
        raise ShardingError(f"{op}: dim {list(dim)} has a dim that appears multiple times")
    # Note: like PyTorch, an empty dim list reduces over every dim.
    return tuple(sorted(axes)) if axes and ndim else tuple(range(ndim))


def as_dims(value: object) -> tuple:
    """One dim/size or a sequence of them, as a tuple (``2`` -> ``(2,)``; values unchecked)."""
    if isinstance(value, (tuple, list)):
        return tuple(value)
    if hasattr(value, "__index__") or isinstance(value, str) or not hasattr(value, "__iter__"):
        return (value,)
    return tuple(value)  # type: ignore[arg-type]


def _ints(values: Sequence[object], what: str) -> tuple[int, ...]:
    """``values`` as python ints; DTypeError naming ``what`` for one that is not an int."""
    out = []
    for i, v in enumerate(values):
        try:
            out.append(operator.index(v))  # type: ignore[arg-type]
        except TypeError:
            raise DTypeError(
                f"{what} must be a sequence of ints, but found element of type "
                f"{type(v).__name__} at pos {i}"
            ) from None
    return tuple(out)


# -- broadcasting and reductions ---------------------------------------------------------------
def broadcast_shapes(op: str, shapes: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    """Broadcast shape of ``shapes`` (numpy/PyTorch rules).

    Raises
    ------
    ShardingError
        ``add: shapes (2, 3) and (4,) do not broadcast (size 3 vs 4 at dimension -1)``.
    """
    ndim = max((len(s) for s in shapes), default=0)
    out = [1] * ndim
    for s in shapes:
        for i, n in enumerate(s, ndim - len(s)):
            if n != 1:
                if out[i] == 1:
                    out[i] = n
                elif out[i] != n:
                    listed = " and ".join(str(tuple(t)) for t in shapes)
                    raise ShardingError(
                        f"{op}: shapes {listed} do not broadcast (size {out[i]} vs {n} at "
                        f"dimension {i - ndim})"
                    )
    return tuple(out)


def reduced_shape(
    shape: Sequence[int], axes: Sequence[int] | None, keepdim: bool
) -> tuple[int, ...]:
    """Shape of a reduction of ``shape`` over ``axes`` (normalised; None: every dim, as a
    flat ``argmax``), size 1 kept in their place when ``keepdim``."""
    if axes is None:
        return (1,) * len(shape) if keepdim else ()
    if keepdim:
        return tuple(1 if d in axes else n for d, n in enumerate(shape))
    return tuple(n for d, n in enumerate(shape) if d not in axes)


def check_nonempty_reduction(op: str, shape: Sequence[int], axes: Sequence[int] | None) -> None:
    """Refuse a reduction without an identity (max, min, argmax...) over an empty dim.

    **Local.** ``axes`` are the reduced dims (None: every dim). Checked on the global shape
    by the rule and on the local shape by the kernel, so a sharded tensor raises exactly as
    a replicated or local one.

    Raises
    ------
    ShardingError
        A reduced dim has size 0 (the message names ``op``, the shape and the dims).
    """
    sizes = shape if axes is None else [shape[i] for i in axes]
    if 0 in sizes:
        raise ShardingError(
            f"{op}(): expected reduction dim to have non-zero size (input shape "
            f"{tuple(shape)}, dim {'all' if axes is None else list(axes)})"
        )


# -- dtypes ------------------------------------------------------------------------------------
# promotion categories: bool < integer < floating < complex
_CATEGORY = {"b": 0, "u": 1, "i": 1, "f": 2, "c": 3}
BOOL = np.dtype(np.bool_)
INT64 = np.dtype(np.int64)
FLOAT32 = np.dtype(np.float32)
_FLOAT16 = np.dtype(np.float16)
_FLOAT64 = np.dtype(np.float64)
_COMPLEX64 = np.dtype(np.complex64)
_COMPLEX128 = np.dtype(np.complex128)
#: ``dtype.char`` of ml_dtypes' bfloat16 (``numpy.dtype`` does not parse it).
_BFLOAT16_CHAR = "E"
_BFLOAT16: np.dtype | None = None


def bfloat16() -> np.dtype:
    """``bfloat16`` (8 exponent bits like float32, 8 significand bits), from ml_dtypes: a
    numpy dtype whose ``kind`` is 'V' (numpy has no kind letter for it); :func:`dtype_kind`
    says 'f'. ml_dtypes is imported on the first call (its import costs about 0.8 s of CPU,
    and only bfloat16 needs it); the module attribute :data:`BFLOAT16` reads this."""
    global _BFLOAT16
    if _BFLOAT16 is None:
        import ml_dtypes  # lazy: 0.8 s of CPU per process; only bfloat16 needs it

        _BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
    return _BFLOAT16


def is_bfloat16(dtype: object) -> bool:
    """Whether ``dtype`` (a numpy dtype, or anything else: False) is ml_dtypes' bfloat16.

    Without importing ml_dtypes for the dtypes that cannot be it: bfloat16's numpy kind is
    'V', and a bfloat16 array exists only once something imported ml_dtypes."""
    if isinstance(dtype, np.dtype):
        return dtype.kind == "V" and dtype == bfloat16()
    # a scalar type (ml_dtypes.bfloat16 itself), as a dtype's ``==`` would take it
    return (isinstance(dtype, type) and dtype.__name__ == "bfloat16"
            and np.dtype(dtype) == bfloat16())


def __getattr__(name: str) -> Any:
    # BFLOAT16, read lazily (see bfloat16()): ``from placements.meta import BFLOAT16`` keeps
    # working, and imports ml_dtypes only where it runs
    if name == "BFLOAT16":
        return bfloat16()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class DtypeTable(dict):
    """A dict keyed by dtypes (or dtype names) whose bfloat16 entries are added on the first
    lookup that could need them: a dtype of numpy kind 'V' or the name ``"bfloat16"``, or any
    look at the whole table (iteration, ``len``, ``repr``). Building one does not import
    ml_dtypes; lookups of every other key cost one Python call more than a dict's.

    ``late`` takes the bfloat16 dtype and returns the entries to add.
    """

    __slots__ = ("_late",)

    def __init__(self, entries: dict, late: Any) -> None:
        super().__init__(entries)
        self._late = late

    def _complete(self, key: object = None, force: bool = False) -> bool:
        if self._late is None:
            return False
        if not force and not (
            getattr(key, "kind", None) == "V" or (isinstance(key, str) and key == "bfloat16")
        ):
            return False
        late, self._late = self._late, None
        self.update(late(bfloat16()))
        return True

    def __missing__(self, key: object) -> Any:
        if self._complete(key):
            return self[key]
        raise KeyError(key)

    def __contains__(self, key: object) -> bool:
        return dict.__contains__(self, key) or (
            self._complete(key) and dict.__contains__(self, key))

    def get(self, key: object, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def __iter__(self):
        self._complete(force=True)
        return dict.__iter__(self)

    def __len__(self) -> int:
        self._complete(force=True)
        return dict.__len__(self)

    def __repr__(self) -> str:
        self._complete(force=True)
        return dict.__repr__(self)

    def keys(self):
        self._complete(force=True)
        return dict.keys(self)

    def values(self):
        self._complete(force=True)
        return dict.values(self)

    def items(self):
        self._complete(force=True)
        return dict.items(self)

    def __reduce__(self):
        self._complete(force=True)
        return (dict, (dict(self),))


def dtype_kind(dtype: np.dtype) -> str:
    """numpy's kind letter of ``dtype`` ('b', 'i', 'u', 'f', 'c'...), 'f' for ``bfloat16``.

    The one place that knows ml_dtypes' ``bfloat16`` is a float: every dtype check that
    tells floats from the rest reads the kind through here (or :func:`is_floating`).
    """
    kind = dtype.kind
    return "f" if kind == "V" and dtype == bfloat16() else kind


def dtype_of_char(char: str) -> np.dtype:
    """The dtype whose ``dtype.char`` is ``char`` (``"E"``, which ``numpy.dtype`` does not
    parse, is bfloat16): how a dtype crosses ranks in one integer."""
    return bfloat16() if char == _BFLOAT16_CHAR else np.dtype(char)


def is_floating(dtype: np.dtype) -> bool:
    """Whether ``dtype`` is a real floating dtype (float16, bfloat16, float32, float64)."""
    return dtype_kind(dtype) == "f"


def promote_types(a: np.dtype | None, b: np.dtype | None) -> np.dtype | None:
    """PyTorch's ``promote_types`` (None: no operand yet).

    Within a category numpy's table is PyTorch's; across categories the higher category's
    dtype wins (``int64`` with ``float16`` is ``float16``), float with complex widens.
    ``bfloat16`` follows PyTorch: with ``float16`` it gives ``float32``, with a wider float
    or a complex dtype that dtype, with bools and integers ``bfloat16``. Results are
    memoised: the local kernels call this on every op.
    """
    if a is None or a == b:
        return b
    if b is None:
        return a
    return _promoted(a, b)


@memoize("placements.meta.promote_types", 1024)
def _promoted(a: np.dtype, b: np.dtype) -> np.dtype:
    """:func:`promote_types` of two different dtypes (memoised: pairs of dtypes are few)."""
    ca, cb = _CATEGORY[dtype_kind(a)], _CATEGORY[dtype_kind(b)]
    if ca != cb and min(ca, cb) < 2:
        return a if ca > cb else b
    if is_bfloat16(a) or is_bfloat16(b):
        # every float and complex dtype but float16 holds bfloat16's values (numpy has no
        # promotion table for it; PyTorch's gives float32 with float16)
        other = b if is_bfloat16(a) else a
        return FLOAT32 if other == _FLOAT16 else other
    return np.promote_types(a, b)


def combine_categories(higher: np.dtype | None, lower: np.dtype | None) -> np.dtype | None:
    """Combine two promotion tiers, e.g. dimensioned tensors with 0-d ones (PyTorch's
    ``combine_categories``): the lower tier matters only when its category is higher."""
    if higher is None:
        return lower
    if lower is None:
        return higher
    ch, cl = _CATEGORY[dtype_kind(higher)], _CATEGORY[dtype_kind(lower)]
    if ch == 3:
        return higher
    if cl == 3:
        return promote_types(higher, lower) if ch == 2 else lower
    if ch == 2:
        return higher
    if ch == 0 or cl == 2:
        return promote_types(higher, lower)
    return higher


def complex_of(default_float: np.dtype) -> np.dtype:
    """The complex dtype that goes with a default float dtype (complex128 for float64,
    complex64 otherwise, as in PyTorch)."""
    return _COMPLEX128 if default_float == _FLOAT64 else _COMPLEX64


def scalar_dtype(dtype: np.dtype, default_float: np.dtype) -> np.dtype:
    """The dtype of a python scalar of ``dtype``'s kind as a "wrapped number": bool, int64,
    the default float dtype or the default complex dtype."""
    kind = dtype_kind(dtype)
    if kind == "f":
        return default_float
    if kind == "c":
        return complex_of(default_float)
    return BOOL if kind == "b" else INT64


def result_dtype(args: Sequence[Any], default_float: np.dtype) -> np.dtype:
    """PyTorch's result dtype of operands: dimensioned tensors, then 0-d ones, then scalars.

    ``args`` holds None (skipped) or objects with ``shape``, ``dtype`` and ``is_scalar``
    (the rules' ``ArgMeta``). A 0-d tensor or a python scalar matters only when its
    category (bool < int < float < complex) is higher than the dimensioned tensors'; no
    operand at all gives the default float dtype.
    """
    dim = zero = wrapped = None
    for a in args:
        if a is None:
            continue
        if a.is_scalar:
            wrapped = promote_types(wrapped, scalar_dtype(a.dtype, default_float))
        elif a.shape:
            dim = promote_types(dim, a.dtype)
        else:
            zero = promote_types(zero, a.dtype)
    out = combine_categories(dim, combine_categories(zero, wrapped))
    return default_float if out is None else out


def can_cast(src: np.dtype, dst: np.dtype) -> bool:
    """PyTorch's ``canCast``: no complex->real, float->integral or non-bool->bool."""
    return _CATEGORY[dtype_kind(src)] <= _CATEGORY[dtype_kind(dst)]


# Note: dtype strings follow PyTorch ("float" is float32, "int" is int32), not numpy (where
# np.dtype("float") is float64 and np.dtype("int") is int64). Any other string goes through
# numpy.dtype(). The local tensor's ``to_dtype`` uses this table too.
TORCH_DTYPE_NAMES = DtypeTable({
    "float": np.dtype(np.float32),
    "double": _FLOAT64,
    "half": _FLOAT16,
    "int": np.dtype(np.int32),
    "long": INT64,
    "short": np.dtype(np.int16),
    "char": np.dtype(np.int8),
    "byte": np.dtype(np.uint8),
    "bool": BOOL,
    "cfloat": _COMPLEX64,
    "cdouble": _COMPLEX128,
}, lambda bf16: {"bfloat16": bf16})


def as_dtype(value: object, default_float: np.dtype) -> np.dtype:
    """A ``dtype=`` argument as a numpy dtype (python ``float`` is the default float dtype,
    ``complex`` the matching complex dtype, ``int`` int64, as in PyTorch's TensorOptions;
    strings as in :data:`TORCH_DTYPE_NAMES`, others through ``numpy.dtype``).

    Raises DTypeError for what is not a dtype (as the local tensor's ``to_dtype``).
    """
    if value is float:
        return default_float
    if value is complex:
        return complex_of(default_float)
    if value is int:
        return INT64
    if isinstance(value, str) and value in TORCH_DTYPE_NAMES:
        return TORCH_DTYPE_NAMES[value]
    try:
        return np.dtype(value)  # type: ignore[call-overload]
    except TypeError as exc:
        raise DTypeError(f"cannot interpret {value!r} as a dtype") from exc


def float_dtype(dtype: np.dtype, default_float: np.dtype) -> np.dtype:
    """``dtype`` if floating/complex, else the default float dtype (float ops on ints)."""
    return dtype if dtype_kind(dtype) in "fc" else default_float


def real_dtype(dtype: np.dtype) -> np.dtype:
    """The real dtype of ``dtype`` (``float32`` for ``complex64``; real dtypes unchanged)."""
    return np.finfo(dtype).dtype if dtype.kind == "c" else dtype


def check_embedding_indices(dtype: np.dtype) -> None:
    """Raise DTypeError unless ``dtype`` (embedding's indices) is an integer dtype.

    The local kernel and the rule both call it, so a local Tensor and a DTensor raise the
    same error (a DTensor's before any communication).
    """
    if dtype.kind not in "iu":
        raise DTypeError(
            f"embedding: expected indices of an integer dtype (int64, int32...), got {dtype.name}"
        )


# -- view shapes -------------------------------------------------------------------------------
def infer_size(shape: Sequence[int], numel: int) -> tuple[int, ...]:
    """``shape`` with its one ``-1`` (if any) resolved so that it holds ``numel`` elements
    (PyTorch's ``infer_size``).

    Raises
    ------
    ViewError
        ``only one dimension can be inferred``; ``invalid shape dimension -2``;
        ``shape '[3, 5]' is invalid for input of size 8``; and, for a ``-1`` when the other
        sizes multiply to 0, ``cannot reshape tensor of 0 elements into shape [-1, 0]
        because the unspecified dimension size -1 can be any value and is ambiguous``.
    DTypeError
        A size that is not an int.
    """
    shape = _ints(shape, "shape")
    newsize = 1
    infer = -1
    for d, size in enumerate(shape):
        if size == -1:
            if infer >= 0:
                raise ViewError("only one dimension can be inferred")
            infer = d
        elif size >= 0:
            newsize *= size
        else:
            raise ViewError(f"invalid shape dimension {size}")
    if numel == newsize or (infer >= 0 and newsize > 0 and numel % newsize == 0):
        if infer < 0:
            return shape
        if newsize == 0:
            raise ViewError(
                f"cannot reshape tensor of 0 elements into shape {list(shape)} because the "
                "unspecified dimension size -1 can be any value and is ambiguous"
            )
        return shape[:infer] + (numel // newsize,) + shape[infer + 1 :]
    raise ViewError(f"shape '{list(shape)}' is invalid for input of size {numel}")


def expand_shape(shape: Sequence[int], sizes: Sequence[int]) -> tuple[int, ...]:
    """The shape of ``expand(*sizes)`` of a tensor of ``shape`` (PyTorch's
    ``inferExpandGeometry``): ``-1`` keeps an existing size, new dims lead, a size-1 dim
    may grow. Dims are checked from the last one.

    Raises
    ------
    ViewError
        Fewer sizes than dims; ``-1`` on a new leading dim; a negative size; a size that
        differs from an existing size other than 1 (``The expanded size of the tensor (4)
        must match the existing size (3) at non-singleton dimension 1.  Target sizes:
        [2, 4].  Tensor sizes: [2, 3]``).
    DTypeError
        A size that is not an int.
    """
    sizes = _ints(sizes, "sizes")
    ndim, tdim = len(sizes), len(shape)
    if ndim < tdim:
        raise ViewError(
            f"expand: the number of sizes provided ({ndim}) must be greater or equal to the "
            f"number of dimensions in the tensor ({tdim})"
        )
    out = [0] * ndim
    for i in range(ndim - 1, -1, -1):
        d = tdim - ndim + i
        size = shape[d] if d >= 0 else 1
        target = sizes[i]
        if target == -1:
            if d < 0:
                raise ViewError(
                    "The expanded size of the tensor (-1) isn't allowed in a leading, "
                    f"non-existing dimension {i}"
                )
            target = size
        elif target < 0:
            raise ViewError(f"expand: invalid size {target} at dimension {i}")
        if size != target and size != 1:
            raise ViewError(
                f"The expanded size of the tensor ({target}) must match the existing size "
                f"({size}) at non-singleton dimension {i}.  Target sizes: {list(sizes)}.  "
                f"Tensor sizes: {list(shape)}"
            )
        out[i] = target
    return tuple(out)


def narrow_args(
    shape: Sequence[int], dim: object, start: object, length: object
) -> tuple[int, int, int]:
    """``narrow(dim, start, length)``'s dim and start normalised (``start`` in
    ``[0, size]``): ``(dim, start, length)``.

    Raises
    ------
    ViewError
        A 0-d tensor (``narrow() cannot be applied to a 0-dim tensor.``), a negative length,
        ``start (2) + length (2) exceeds dimension size (3).``.
    DimError
        ``dim`` out of range, or ``start`` outside ``[-size, size]``.
    """
    if not shape:
        raise ViewError("narrow() cannot be applied to a 0-dim tensor.")
    d = norm_dim(dim, len(shape), "narrow")
    size = shape[d]
    start, length = operator.index(start), operator.index(length)  # type: ignore[arg-type]
    if length < 0:
        raise ViewError("narrow(): length must be non-negative.")
    if not -size <= start <= size:
        raise DimError(
            f"narrow(): start out of range (expected to be in range of [{-size}, {size}], "
            f"but got {start})"
        )
    if start < 0:
        start += size
    if start > size - length:
        raise ViewError(f"start ({start}) + length ({length}) exceeds dimension size ({size}).")
    return d, start, length


def select_args(shape: Sequence[int], dim: object, index: object) -> tuple[int, int]:
    """``select(dim, index)``'s dim and index normalised: ``(dim, index)``, the index in
    ``[0, size)``.

    Raises
    ------
    DimError
        A 0-d tensor, ``dim`` out of range, or ``select(): index 5 out of range for tensor
        of size [3, 4] at dimension 0``.
    """
    if not shape:
        raise DimError("select() cannot be applied to a 0-dim tensor.")
    d = norm_dim(dim, len(shape), "select")
    size = shape[d]
    i = operator.index(index)  # type: ignore[arg-type]
    if not -size <= i < size:
        raise DimError(
            f"select(): index {i} out of range for tensor of size {list(shape)} at "
            f"dimension {d}"
        )
    return d, i % size


def squeeze_dims(shape: Sequence[int], dim: object = None) -> tuple[int, ...]:
    """The dims ``squeeze(dim)`` removes, sorted: the size-1 dims among ``dim`` (None:
    every dim; an int or a sequence). A listed dim whose size is not 1 stays (PyTorch).

    Raises DimError/DTypeError for a dim out of range or not an int.
    """
    ndim = len(shape)
    if dim is None:
        return tuple(d for d in range(ndim) if shape[d] == 1)
    dims = {norm_dim(d, ndim, "squeeze") for d in as_dims(dim)}
    return tuple(sorted(d for d in dims if ndim and shape[d] == 1))


def permute_dims(ndim: int, dims: object) -> tuple[int, ...]:
    """``permute(dims)``'s dims normalised (a permutation of ``range(ndim)``).

    Raises
    ------
    ViewError
        A count other than ``ndim`` (PyTorch's message), a dim given twice
        (``permute(): duplicate dims are not allowed: [0, 0]``).
    DimError
        A dim out of range.
    """
    given = as_dims(dims)
    if len(given) != ndim:
        raise ViewError(
            "permute(): number of dimensions in the tensor input does not match the length of "
            f"the desired ordering of dimensions i.e. input.dim() = {ndim} is not equal to "
            f"len(dims) = {len(given)}"
        )
    perm = tuple(norm_dim(d, ndim, "permute") for d in given)
    if len(set(perm)) != ndim:
        raise ViewError(f"permute(): duplicate dims are not allowed: {list(given)}")
    return perm


def transpose_dims(ndim: int, dim0: object, dim1: object, op: str = "transpose") -> tuple[int, ...]:
    """The permutation of ``transpose(dim0, dim1)`` (``()`` for a 0-d tensor, which accepts
    dims 0 and -1). Raises DimError/DTypeError naming ``op`` for a bad dim."""
    d0, d1 = norm_dim(dim0, ndim, op), norm_dim(dim1, ndim, op)
    perm = list(range(ndim))
    if ndim:
        perm[d0], perm[d1] = perm[d1], perm[d0]
    return tuple(perm)


def t_dims(ndim: int) -> tuple[int, ...]:
    """The permutation of ``t()``: the dims reversed, for at most 2 dims.

    Raises ViewError ``t() expects a tensor with <= 2 dimensions, but self is 3D``.
    """
    if ndim > 2:
        raise ViewError(f"t() expects a tensor with <= 2 dimensions, but self is {ndim}D")
    return tuple(range(ndim))[::-1]


def movedim_dims(ndim: int, source: object, destination: object) -> tuple[int, ...]:
    """The permutation of ``movedim(source, destination)``: output dim ``j`` is input dim
    ``perm[j]``.

    Raises
    ------
    ViewError
        ``source`` and ``destination`` of different lengths, or a dim repeated in one of
        them (``movedim: repeated dim in `source` ([0, 0])``).
    DimError
        A dim out of range.
    """
    src, dst = list(as_dims(source)), list(as_dims(destination))
    if len(src) != len(dst):
        raise ViewError(
            f"movedim: Invalid source or destination dims: source ({src} dims) should contain "
            f"the same number of dims as destination ({dst} dims)"
        )
    src = [norm_dim(d, ndim, "movedim") for d in src]
    dst = [norm_dim(d, ndim, "movedim") for d in dst]
    for name, ds in (("source", src), ("destination", dst)):
        if len(set(ds)) != len(ds):
            raise ViewError(f"movedim: repeated dim in `{name}` ({ds})")
    order = [d for d in range(ndim) if d not in src]
    for d, s in sorted(zip(dst, src)):
        order.insert(d, s)
    return tuple(order)


def flatten_shape(
    shape: Sequence[int], start_dim: object = 0, end_dim: object = -1
) -> tuple[int, ...]:
    """The shape of ``flatten(start_dim, end_dim)``: dims ``start_dim..end_dim`` merged
    (a 0-d tensor gives ``(1,)``; its dims may be 0 or -1).

    Raises ViewError ``flatten() has invalid args: start_dim cannot come after end_dim``
    and DimError for a dim out of range.
    """
    ndim = len(shape)
    s, e = norm_dim(start_dim, ndim, "flatten"), norm_dim(end_dim, ndim, "flatten")
    if s > e:
        raise ViewError("flatten() has invalid args: start_dim cannot come after end_dim")
    if not ndim:
        return (1,)
    shape = tuple(shape)
    return shape[:s] + (math.prod(shape[s : e + 1]),) + shape[e + 1 :]


def unflatten_shape(shape: Sequence[int], dim: object, sizes: object) -> tuple[int, ...]:
    """The shape of ``unflatten(dim, sizes)``: dim ``dim`` split into ``sizes`` (one may be
    -1).

    Raises
    ------
    ViewError
        Empty ``sizes`` (``unflatten: sizes must be non-empty``), or sizes that do not
        multiply to the dim's size (``unflatten: Provided sizes [2, 2] don't multiply up to
        the size of dim 0 (5) in the input tensor``).
    DimError
        A 0-d tensor or a dim out of range.
    """
    shape = tuple(shape)
    d = nonscalar_dim(dim, len(shape), "unflatten")
    given = _ints(as_dims(sizes), "sizes")
    if not given:
        raise ViewError("unflatten: sizes must be non-empty")
    try:
        inferred = infer_size(given, shape[d])
    except ViewError as exc:
        raise ViewError(
            f"unflatten: Provided sizes {list(given)} don't multiply up to the size of dim "
            f"{d} ({shape[d]}) in the input tensor"
        ) from exc
    return shape[:d] + inferred + shape[d + 1 :]


def split_dim(ndim: int, dim: object, op: str) -> int:
    """The dim of ``split``/``chunk`` normalised.

    Raises ViewError ``split expects at least a 1-dimensional tensor`` on a 0-d tensor and
    DimError for a dim out of range.
    """
    if not ndim:
        raise ViewError(f"{op} expects at least a 1-dimensional tensor")
    return norm_dim(dim, ndim, op)


def split_sizes(size: int, split_size_or_sections: object, dim: int) -> tuple[int, ...]:
    """The piece sizes of ``split(split_size_or_sections, dim)`` of a dim of ``size``.

    An int gives pieces of that size (the last may be smaller; 0 only for an empty dim,
    giving one empty piece); a sequence gives each piece's size.

    Raises
    ------
    ViewError
        A negative split size, 0 on a non-empty dim, sections with a negative entry or that
        do not sum to ``size`` (PyTorch's messages; ``dim`` is named in the last one).
    """
    spec = split_size_or_sections
    if hasattr(spec, "__index__"):
        n = operator.index(spec)  # type: ignore[arg-type]
        if n < 0:
            raise ViewError(f"split expects split_size be non-negative, but got split_size={n}")
        if n == 0 and size != 0:
            raise ViewError(
                "split_size can only be 0 if dimension size is 0, but got dimension size of "
                f"{size}"
            )
        count = max(-(-size // n), 1) if n else 1
        return (n,) * (count - 1) + (size - n * (count - 1),)
    sizes = _ints(as_dims(spec), "split_sizes")
    if any(s < 0 for s in sizes):
        raise ViewError(
            "split_with_sizes expects split_sizes have only non-negative entries, but got "
            f"split_sizes={list(sizes)}"
        )
    if sum(sizes) != size:
        raise ViewError(
            f"split_with_sizes expects split_sizes to sum exactly to {size} (input tensor's "
            f"size at dimension {dim}), but got split_sizes={list(sizes)}"
        )
    return sizes


def chunk_sizes(size: int, chunks: object) -> tuple[int, ...]:
    """The piece sizes of ``chunk(chunks)`` of a dim of ``size``: pieces of
    ``ceil(size / chunks)`` (so maybe fewer than ``chunks``); an empty dim gives ``chunks``
    empty pieces.

    Raises ViewError ``chunk expects `chunks` to be greater than 0, got: 0``.
    """
    n = operator.index(chunks)  # type: ignore[arg-type]
    if n <= 0:
        raise ViewError(f"chunk expects `chunks` to be greater than 0, got: {n}")
    if size == 0:
        return (0,) * n
    return split_sizes(size, -(-size // n), 0)


def _full_slice(s: slice, n: int) -> bool:
    """Whether slice ``s`` of a dim of size ``n`` is written as the whole dim."""
    return s.start in (None, 0) and (s.stop is None or s.stop >= n) and s.step in (None, 1)


def is_advanced_entry(item: object) -> bool:
    """Whether an index entry asks for advanced indexing: a list, a bool, or an array or
    tensor (anything with a ``shape`` and a ``dtype``) of one dim or more."""
    return isinstance(item, (bool, np.bool_, list)) or (
        hasattr(item, "dtype") and len(getattr(item, "shape", ())) > 0
    )


def parse_index(
    index: object, ndim: int, op: str, where: str = "", arrays: bool = False
) -> tuple[list[tuple[str, object]], int]:
    """The entries of ``x[index]`` on a tensor of ``ndim`` dims, checked, and how many dims
    they consume: ``(kind, value)`` with kind ``"none"``, ``"..."`` (one is appended when
    none is written), ``"slice"``, ``"int"`` (the value as an int) and, with ``arrays``,
    ``"mask"`` and ``"array"`` (the value as an ndarray). The one index parser of
    :func:`index_shape` (basic indexing) and :func:`placements.index_meta.index_plan`.
    ``where`` ends each message (the index and the shape). **Local**.

    Raises
    ------
    ArgumentError
        A slice step that is not positive.
    DimError
        More indices than dims, two ellipses, an entry that is not an index (without
        ``arrays``: anything but ints, slices, None and ``...``).
    DTypeError
        An index array that is not of an integer or bool dtype.
    """
    tail = f" {where}" if where else ""
    items = index if isinstance(index, tuple) else (index,)
    entries: list[tuple[str, object]] = []
    consumed = ellipses = 0
    for it in items:
        if it is None or it is Ellipsis:
            ellipses += it is Ellipsis
            entries.append(("none" if it is None else "...", it))
            continue
        if isinstance(it, slice):
            if it.step is not None and it.step <= 0:
                raise ArgumentError(f"{op}: step must be greater than zero (got {it.step})")
            entries.append(("slice", it))
            consumed += 1
            continue
        if arrays and (is_advanced_entry(it) or (hasattr(it, "dtype")
                                                 and not isinstance(it, np.generic))):
            arr = np.asarray(it)
            if arr.dtype.kind not in "iub":
                raise DTypeError(
                    f"{op}: tensors used as indices must be long, int, byte or bool tensors, "
                    f"got {arr.dtype}{tail}"
                )
            entries.append(("mask" if arr.dtype.kind == "b" else "array", arr))
            consumed += arr.ndim if arr.dtype.kind == "b" else 1
            continue
        value = None
        if not isinstance(it, (bool, np.bool_)):  # a bool is a mask, not the int 0 or 1
            try:
                value = operator.index(it)
            except TypeError:
                pass
        if value is None:
            raise DimError(
                f"{op}: only integers, slices, None, ..., and integer or boolean tensors "
                f"are valid indices (got {type(it).__name__}){tail}"
            )
        entries.append(("int", value))
        consumed += 1
    if consumed > ndim:
        raise DimError(f"{op}: too many indices for tensor of dimension {ndim}{tail}")
    if ellipses > 1:
        raise DimError(f"{op}: an index can only have a single ellipsis ('...'){tail}")
    if not ellipses:
        entries.append(("...", Ellipsis))
    return entries, consumed


def index_shape(
    shape: Sequence[int], index: object, op: str = "__getitem__"
) -> tuple[tuple[int, ...], dict[int, int]]:
    """The shape of basic indexing ``x[index]`` (ints, slices, None, one ``...``) and the
    input dims it keeps whole: ``(out_shape, {input dim: output dim})`` for the dims under
    ``...`` (written or implied) and those sliced by a slice written as the whole dim.

    Raises
    ------
    ArgumentError
        A slice step that is not positive (``__getitem__: step must be greater than zero
        (got -1)``).
    DimError
        More indices than dims (``too many indices for tensor of dimension 2``), two
        ellipses, an int out of range (``index 10 is out of bounds for dimension 0 with
        size 4``) or an entry that is not an index, each after ``op: ``.
    """
    entries, consumed = parse_index(index, len(shape), op)
    ndim = len(shape)
    out: list[int] = []
    kept: dict[int, int] = {}
    src = 0
    for kind, it in entries:
        if kind == "none":
            out.append(1)
        elif kind == "...":
            for _ in range(ndim - consumed):
                kept[src] = len(out)
                out.append(shape[src])
                src += 1
        elif kind == "slice":
            n = shape[src]
            if _full_slice(it, n):
                kept[src] = len(out)
            out.append(len(range(*it.indices(n))))
            src += 1
        else:
            i, n = it, shape[src]
            if not -n <= i < n:
                raise DimError(
                    f"{op}: index {i} is out of bounds for dimension {src} with size {n}"
                )
            src += 1
    return tuple(out), kept
