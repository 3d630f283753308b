"""Metadata of the indexing ops: output shapes and the checks of their arguments.

``index_select``, ``gather``, ``scatter``/``scatter_add``, ``take_along_dim``,
``masked_fill``, ``sort``/``argsort``, ``topk``, ``kthvalue``, ``index_add`` and the
writes through an index (``x[idx] = value``, ``index_put``) are checked here once, from
shapes and dtypes only: the local kernels and the sharding rules call the same functions,
so a local Tensor and a DTensor raise the same typed errors, and a DTensor raises them on
every rank before any communication (the rules see global shapes). Index VALUES are checked
by :func:`check_index_values`, which the local kernels call on an index that every rank
holds whole (the rules keep index arguments replicated), so every rank raises alike.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable

import numpy as np

from .errors import ArgumentError, DimError, DTypeError, ShardingError
from .meta import _full_slice, broadcast_shapes, is_advanced_entry, norm_dim, parse_index

__all__ = [
    "check_index_dtype",
    "check_index_values",
    "gather_shape",
    "index_add_check",
    "index_digest",
    "index_plan",
    "index_put_check",
    "index_put_index",
    "index_select_shape",
    "is_advanced_entry",
    "kthvalue_shape",
    "masked_fill_check",
    "masked_index_dims",
    "scatter_check",
    "sort_dim",
    "take_along_dim_shape",
    "topk_shape",
    "write_check",
]


_PLAIN = frozenset((int, bool, type(None), type(Ellipsis)))


def _plain(v: object) -> bool:
    """Whether an index holds only ints, bools, slices, None and ``...`` (in tuples and
    lists): its repr then says all of it."""
    t = type(v)
    if t in _PLAIN:
        return True
    if t is tuple or t is list:
        return all(_plain(e) for e in v)  # type: ignore[attr-defined]
    return t is slice and _plain((v.start, v.stop, v.step))  # type: ignore[attr-defined]


def _count(v: object) -> int:
    """The ints and bools of the lists inside a plain index (its index entries)."""
    t = type(v)
    if t is list:
        return sum(_count(e) if type(e) in (list, tuple) else 1 for e in v)  # type: ignore[attr-defined]
    if t is tuple:
        return sum(_count(e) for e in v)  # type: ignore[attr-defined]
    return 0


def index_digest(
    index: object, as_array: Callable[[object], np.ndarray | None] = lambda v: None
) -> tuple[int, int]:
    """``(digest, entries)`` of an index argument (``x[index]``, ``index_put``'s indices):
    a 63-bit digest of its structure and values, and the number of elements of its arrays
    and lists. **Local**.

    Two indices have equal digests when they are built alike: the same nesting of tuples
    and lists, the same ints, slices, ``None`` and ``...``, and arrays of the same dtype,
    shape and values (``as_array(v)`` gives the array of a tensor ``v``, or None for an
    object that is described by its repr, such as a DTensor, whose values no rank holds
    alone). Different indices get different digests but for a chance of about 2**-63.
    """
    if _plain(index):
        text = repr(index).encode()
        return (zlib.crc32(text) << 31 ^ zlib.adler32(text)) & _MASK63, _count(index)
    crc, adler = 0, 1
    entries = 0

    def feed(data: bytes | np.ndarray) -> None:
        nonlocal crc, adler
        crc, adler = zlib.crc32(data, crc), zlib.adler32(data, adler)

    def walk(v: object, in_list: bool) -> None:
        nonlocal entries
        t = type(v)
        if t is tuple or t is list:
            feed(struct.pack("<cq", b"T" if t is tuple else b"L", len(v)))  # type: ignore[arg-type]
            for e in v:  # type: ignore[attr-defined]
                walk(e, in_list or t is list)
            return
        if _plain(v) or isinstance(v, (np.integer, np.bool_)):
            entries += in_list and v is not None and v is not Ellipsis and t is not slice
            feed(repr(v if t is slice else v.item() if isinstance(v, np.generic) else v)
                 .encode())
            return
        arr = v if isinstance(v, np.ndarray) else as_array(v)
        if arr is None or arr.dtype.hasobject:
            feed(b"?" + repr(v).encode())
            return
        arr = np.ascontiguousarray(arr)
        entries += arr.size
        feed(b"A" + arr.dtype.str.encode() + repr(arr.shape).encode())
        feed(arr.reshape(-1).view(np.uint8))

    walk(index, False)
    return (crc << 31 ^ adler) & _MASK63, entries


_MASK63 = (1 << 63) - 1


def check_index_dtype(op: str, dtype: np.dtype, what: str = "index") -> None:
    """Raise DTypeError unless ``dtype`` is an integer dtype (bool and float refused)."""
    if np.dtype(dtype).kind not in "iu":
        raise DTypeError(
            f"{op}(): Expected dtype int64 (or another integer dtype) for {what}, got "
            f"{np.dtype(dtype).name}"
        )


def check_index_values(op: str, lo: int, hi: int, dim: int, size: int) -> None:
    """Raise DimError naming ``op``, the index and the size unless the smallest (``lo``)
    and largest (``hi``) index lie in ``[0, size)``. **Local**."""
    if lo < 0 or hi >= size:
        raise DimError(
            f"{op}: index {lo if lo < 0 else hi} is out of bounds for dimension {dim} with "
            f"size {size}"
        )


def sort_dim(op: str, shape: tuple[int, ...], dim: object) -> int:
    """The normalised dim of a sort-like op (a 0-d tensor accepts 0 and -1)."""
    return norm_dim(dim, max(len(shape), 1), op) if shape else 0


def index_select_shape(
    shape: tuple[int, ...], dim: object, index_shape: tuple[int, ...], index_dtype: np.dtype
) -> tuple[tuple[int, ...], int]:
    """``(output shape, dim)`` of ``index_select``."""
    op = "index_select"
    d = sort_dim(op, shape, dim)
    check_index_dtype(op, index_dtype)
    if len(index_shape) > 1:
        raise ShardingError(f"{op}(): Index is supposed to be a vector, got shape {index_shape}")
    n = int(np.prod(index_shape))
    if not shape:
        return (), d
    return shape[:d] + (n,) + shape[d + 1 :], d


def _check_not_larger(op: str, small: tuple, big: tuple, skip: int | None, what: str) -> None:
    for k, (a, b) in enumerate(zip(small, big)):
        if k != skip and a > b:
            apart = "" if skip is None else f" apart from dimension {skip}"
            raise ShardingError(
                f"{op}(): Size does not match at dimension {k} expected index {list(small)} "
                f"to be no larger than {what} {list(big)}{apart}"
            )


def gather_shape(
    shape: tuple[int, ...], dim: object, index_shape: tuple[int, ...], index_dtype: np.dtype
) -> tuple[tuple[int, ...], int]:
    """``(output shape, dim)`` of ``gather`` (the index's shape)."""
    op = "gather"
    d = sort_dim(op, shape, dim)
    check_index_dtype(op, index_dtype)
    if len(index_shape) != len(shape):
        raise ShardingError(
            f"{op}(): Index tensor must have the same number of dimensions as input tensor "
            f"(index {index_shape}, input {shape})"
        )
    _check_not_larger(op, index_shape, shape, d, "self")
    return tuple(index_shape), d


def scatter_check(
    op: str,
    shape: tuple[int, ...],
    dtype: np.dtype,
    dim: object,
    index_shape: tuple[int, ...],
    index_dtype: np.dtype,
    src_shape: tuple[int, ...] | None,
    src_dtype: np.dtype | None,
) -> int:
    """Check a ``scatter``/``scatter_add`` call (``src_shape`` None: a python scalar
    source); returns the normalised dim."""
    d = sort_dim(op, shape, dim)
    check_index_dtype(op, index_dtype)
    if len(index_shape) != len(shape):
        raise ShardingError(
            f"{op}(): Index tensor must have the same number of dimensions as self tensor "
            f"(index {index_shape}, self {shape})"
        )
    _check_not_larger(op, index_shape, shape, d, "self")
    if src_shape is not None:
        if len(src_shape) != len(shape):
            raise ShardingError(
                f"{op}(): Index tensor must have the same number of dimensions as src tensor "
                f"(index {index_shape}, src {src_shape})"
            )
        _check_not_larger(op, index_shape, src_shape, None, "src")
        if src_dtype != dtype:
            raise DTypeError(
                f"{op}(): Expected self.dtype to be equal to src.dtype (self {dtype}, src "
                f"{src_dtype})"
            )
    return d


def take_along_dim_shape(
    shape: tuple[int, ...], index_shape: tuple[int, ...], index_dtype: np.dtype, dim: object
) -> tuple[tuple[int, ...], int | None]:
    """``(output shape, dim)`` of ``take_along_dim`` (dim None: over the flattened input)."""
    op = "take_along_dim"
    check_index_dtype(op, index_dtype, "indices")
    if dim is None:
        return (int(np.prod(index_shape)),), None
    d = sort_dim(op, shape, dim)
    if len(index_shape) != len(shape):
        raise ShardingError(
            f"{op}(): input and indices should have the same number of dimensions, but got "
            f"{len(shape)} dimensions for input, and {len(index_shape)} dimensions for indices"
        )
    rest = broadcast_shapes(
        op, [shape[:d] + (1,) + shape[d + 1 :], index_shape[:d] + (1,) + index_shape[d + 1 :]]
    )
    return rest[:d] + (index_shape[d],) + rest[d + 1 :], d


def masked_fill_check(
    shape: tuple[int, ...],
    mask_shape: tuple[int, ...],
    mask_dtype: np.dtype,
    value_shape: tuple[int, ...],
) -> None:
    """Check ``masked_fill``: a bool mask that broadcasts to the input's shape, a 0-d value."""
    op = "masked_fill"
    if np.dtype(mask_dtype) != np.bool_:
        raise DTypeError(
            f"{op}: only supports boolean masks, but got mask with dtype "
            f"{np.dtype(mask_dtype).name}"
        )
    if broadcast_shapes(op, [shape, mask_shape]) != tuple(shape):
        raise ShardingError(
            f"{op}: the mask of shape {mask_shape} does not broadcast to the input's shape "
            f"{shape}"
        )
    if value_shape:
        raise ShardingError(
            f"{op}: only supports a 0-dimensional value tensor, but got a tensor with "
            f"{len(value_shape)} dimension(s)"
        )


def topk_shape(shape: tuple[int, ...], k: object, dim: object) -> tuple[tuple[int, ...], int]:
    """``(output shape, dim)`` of ``topk``."""
    op = "topk"
    d = sort_dim(op, shape, dim)
    n = shape[d] if shape else 1
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or not 0 <= k <= n:
        raise DimError(f"{op}: selected index k={k!r} out of range for dimension {d} of size {n}")
    return (shape[:d] + (int(k),) + shape[d + 1 :]) if shape else (), d


def kthvalue_shape(
    shape: tuple[int, ...], k: object, dim: object, keepdim: bool
) -> tuple[tuple[int, ...], int]:
    """``(output shape, dim)`` of ``kthvalue``."""
    op = "kthvalue"
    d = sort_dim(op, shape, dim)
    n = shape[d] if shape else 1
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or not 1 <= k <= n:
        raise DimError(
            f"{op}(): selected number k={k!r} out of range for dimension {d} of size {n}"
        )
    if not shape:
        return (), d
    return (shape[:d] + (1,) + shape[d + 1 :]) if keepdim else shape[:d] + shape[d + 1 :], d


def index_plan(
    shape: tuple[int, ...], index: object, op: str = "__getitem__"
) -> tuple[tuple[int, ...], dict[int, int], list[tuple[str, object, int, int | None]]]:
    """How ``x[index]`` indexes a tensor of ``shape`` (basic or advanced), on metadata.

    Index arrays (integer or bool; lists, ndarrays, tensors) are read: a bool mask's shape
    and number of True entries, an integer index's shape and range. With an index array
    present, the advanced entries (ints among them) broadcast together; their dims stand
    where the first of them stands when they are adjacent in ``index`` (a ``...`` separates),
    first otherwise.

    Returns
    -------
    (out_shape, kept, plan)
        The result's shape; the input dims kept whole ``{input dim: output dim}`` (under
        ``...`` or a slice of the whole dim); one entry per index entry (``...`` expanded
        to whole slices): ``(kind, value, first input dim, output dim)`` with kind
        ``"slice"``, ``"int"`` (value normalised to ``[0, size)``), ``"none"``,
        ``"array"`` or ``"mask"`` (ndarrays); the output dim of an advanced entry is where
        the broadcast index dims start, None for an int of basic indexing.

    Raises
    ------
    DTypeError
        An index array that is not of an integer or bool dtype.
    DimError
        An index out of range, a mask whose shape differs from the dims it covers, too many
        indices, two ellipses, an entry that is not an index; each message names ``op``,
        the index and the global shape.
    ArgumentError
        A slice step that is not positive.
    ShardingError
        Index arrays whose shapes do not broadcast.
    """
    where = f"(index {index!r} of a tensor of global shape {tuple(shape)})"
    entries, consumed = parse_index(index, len(shape), op, where, arrays=True)
    ndim = len(shape)
    has_arrays = any(k in ("mask", "array") for k, _ in entries)
    groups: list[tuple[int, ...]] = []
    adv_entries: list[int] = []  # positions in ``entries`` (a ``...`` separates, as in numpy)
    plan: list[list] = []  # [kind, value, first input dim, output dim]
    src = 0
    for pos, (kind, v) in enumerate(entries):
        if kind == "...":
            for _ in range(ndim - consumed):
                plan.append(["slice", slice(None), src, None])
                src += 1
            continue
        plan.append([kind, v, src, None])
        if kind in ("none", "slice"):
            src += kind == "slice"
            continue
        n = shape[src] if src < ndim else 0
        if kind == "mask":
            covered = shape[src : src + v.ndim]  # type: ignore[union-attr]
            if tuple(v.shape) != tuple(covered):  # type: ignore[union-attr]
                raise DimError(
                    f"{op}: the shape of the mask {tuple(v.shape)} at index {src} does not "  # type: ignore[union-attr]
                    f"match the shape of the indexed tensor {tuple(covered)} {where}"
                )
            groups.append((int(np.count_nonzero(v)),))
            src += v.ndim  # type: ignore[union-attr]
        else:
            vals = np.asarray(v)
            if vals.size and (int(vals.min()) < -n or int(vals.max()) >= n):
                bad = int(vals.min()) if int(vals.min()) < -n else int(vals.max())
                raise DimError(
                    f"{op}: index {bad} is out of bounds for dimension {src} with size {n} "
                    f"{where}"
                )
            if kind == "int":
                plan[-1][1] = v % n  # type: ignore[operator]
            groups.append(tuple(vals.shape))
            src += 1
        # Note: numpy's rule: with an index array present, an int is an advanced entry too
        # (PyTorch selects with it first; the two differ when a slice separates the int from
        # the arrays: x[0, :, [1, 2]] is (2, 4) here, (4, 2) in PyTorch; README lists it)
        if kind != "int" or has_arrays:
            adv_entries.append(pos)
    bshape = broadcast_shapes(op, groups) if has_arrays else ()
    adjacent = not adv_entries or adv_entries[-1] - adv_entries[0] + 1 == len(adv_entries)
    out: list[int] = [] if adjacent else list(bshape)
    kept: dict[int, int] = {}
    group_at = None if adjacent else 0
    for step in plan:
        kind, v, d, _ = step
        if kind == "none":
            step[3] = len(out)
            out.append(1)
        elif kind == "slice":
            n = shape[d]
            if _full_slice(v, n):  # type: ignore[arg-type]
                kept[d] = len(out)
            step[3] = len(out)
            out.append(len(range(*v.indices(n))))  # type: ignore[union-attr]
        elif kind != "int" or has_arrays:
            if group_at is None:
                group_at = len(out)
                out.extend(bshape)
            step[3] = group_at
    return tuple(out), kept, [tuple(p) for p in plan]  # type: ignore[misc]


def masked_index_dims(plan: list[tuple[str, object, int, int | None]]) -> tuple[int, ...]:
    """The input dims that the advanced entries of an index of :func:`index_plan`'s
    ``plan`` index, when it has an index array: the dim of each integer array, every dim a
    mask covers, the dim of each int (an int among index arrays broadcasts with them); ()
    for a basic index or one with a 0-d mask. Such dims may stay sharded under indexing:
    each shard keeps the result entries whose positions land in its block on every sharded
    one of them and zeros the others (local indexing with masking), giving a ``P(sum)``
    result."""
    adv = [p for p in plan if p[0] not in ("slice", "none")]
    if not any(p[0] in ("array", "mask") for p in adv):
        return ()
    dims: list[int] = []
    for kind, v, d, _ in adv:
        n = v.ndim if kind == "mask" else 1  # type: ignore[union-attr]
        if n == 0:
            return ()
        dims.extend(range(d, d + n))
    return tuple(dims)


def index_add_check(
    shape: tuple[int, ...],
    dtype: np.dtype,
    dim: object,
    index_shape: tuple[int, ...],
    index_dtype: np.dtype,
    source_shape: tuple[int, ...],
    source_dtype: np.dtype,
) -> int:
    """Check an ``index_add(input, dim, index, source)`` call: an integer index vector, a
    source of the input's shape except ``len(index)`` along ``dim``, of the input's dtype;
    returns the normalised dim."""
    op = "index_add"
    d = sort_dim(op, shape, dim)
    check_index_dtype(op, index_dtype)
    if len(index_shape) > 1:
        raise ShardingError(f"{op}(): Index is supposed to be a vector, got shape {index_shape}")
    n = int(np.prod(index_shape))
    want = shape[:d] + (n,) + shape[d + 1 :] if shape else (n,)
    if tuple(source_shape) != want and not (not shape and n == 1 and not source_shape):
        raise ShardingError(
            f"{op}(): source of shape {tuple(source_shape)} does not match the input of shape "
            f"{tuple(shape)} with an index of {n} entries along dimension {d} (expected "
            f"source shape {want})"
        )
    if np.dtype(source_dtype) != np.dtype(dtype):
        raise DTypeError(
            f"{op}(): self ({np.dtype(dtype).name}) and source ({np.dtype(source_dtype).name}) "
            "must have the same dtype"
        )
    return d


def index_put_index(indices: object) -> tuple:
    """The index ``x[index]`` that ``index_put``'s ``indices`` (a tuple or list of index
    tensors, None for a whole dim) stand for.

    Raises
    ------
    ArgumentError
        ``indices`` is not a tuple or list.
    """
    if not isinstance(indices, (tuple, list)):
        raise ArgumentError(
            f"index_put(): indices must be a tuple of tensors, got {type(indices).__name__}"
        )
    return tuple(slice(None) if i is None else i for i in indices)


def index_put_check(
    shape: tuple[int, ...],
    dtype: np.dtype,
    indices: object,
    value_shape: tuple[int, ...],
    value_dtype: np.dtype | None,
) -> tuple[tuple, tuple[int, ...], dict[int, int], list]:
    """Check an ``index_put(input, indices, values)`` call (``value_dtype`` None: a python
    scalar value): :func:`write_check`, and a tensor value of the input's dtype. Returns
    ``(index, region, kept, plan)``."""
    index = index_put_index(indices)
    region, kept, plan = write_check("index_put", shape, index, value_shape)
    if value_dtype is not None and np.dtype(value_dtype) != np.dtype(dtype):
        raise DTypeError(
            f"index_put(): Index put requires the source and destination dtypes match, got "
            f"{np.dtype(dtype).name} for the destination and {np.dtype(value_dtype).name} for "
            "the source"
        )
    return index, region, kept, plan


def write_check(
    op: str, shape: tuple[int, ...], index: object, value_shape: tuple[int, ...]
) -> tuple[tuple[int, ...], dict[int, int], list]:
    """Check a write of a value of ``value_shape`` through ``x[index]`` (``x[index] =
    value``, ``index_put``): :func:`index_plan`'s checks, and the value broadcasting to the
    indexed region. Returns :func:`index_plan`'s ``(region, kept, plan)``.

    Raises
    ------
    ShardingError
        The value does not broadcast to the region (and the errors of :func:`index_plan`).
    """
    region, kept, plan = index_plan(shape, index, op)
    try:
        fits = broadcast_shapes(op, [region, value_shape]) == region
    except ShardingError:
        fits = False
    if not fits:
        raise ShardingError(
            f"{op}: shape mismatch: value tensor of shape {tuple(value_shape)} cannot be "
            f"broadcast to indexing result of shape {region} (index {index!r}, global shape "
            f"{tuple(shape)})"
        )
    return region, kept, plan
