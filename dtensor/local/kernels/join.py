"""Joining and rearranging local kernels that copy: cat (concat), stack, flip, roll, tril,
triu, repeat, tile.

All are **Local** plain functions with PyTorch's names and arguments; every result is a
new tensor (never a view of an input).
"""

from __future__ import annotations

from placements.errors import ShardingError
from placements.meta import norm_dims

from ..tensor import Tensor, _norm_dim
from .base import (
    as_array,
    new_array,
    promote_types,
    wrap,
    xp_of,
)


def _tensor_list(op: str, tensors) -> list:
    if not isinstance(tensors, (list, tuple)):
        raise ShardingError(f"{op}: expected a list or tuple of Tensors, got "
                            f"{type(tensors).__name__}")
    if not tensors:
        raise ShardingError(f"{op}: expected a non-empty list of Tensors")
    return [as_array(op, t) for t in tensors]


def _promoted(arrays):
    dt = None
    for a in arrays:
        dt = promote_types(dt, a.dtype)
    return dt


def cat(tensors, dim: int = 0) -> Tensor:
    """Concatenate tensors along an existing dim. **Local**.

    Parameters
    ----------
    tensors : sequence of Tensor
        Same number of dims and equal sizes except along ``dim``. Dtypes promote as in
        PyTorch. Legacy rule kept from PyTorch: 1-D empty tensors (shape ``(0,)``) are
        skipped, whatever the other tensors' shapes.
    dim : int

    Returns
    -------
    Tensor
    """
    arrays = _tensor_list("cat", tensors)
    dt = _promoted(arrays)
    # Note: PyTorch's legacy rule (numpy has none): 1-D empty tensors are skipped.
    kept = [a for a in arrays if not (a.ndim == 1 and a.size == 0)]
    if not kept:
        return wrap(new_array((0,), dt, arrays[0]))
    first = kept[0]
    d = _norm_dim(dim, first.ndim, "cat")
    if first.ndim == 0:
        raise ShardingError("cat: zero-dimensional tensor cannot be concatenated")
    for i, a in enumerate(kept):
        if a.ndim != first.ndim:
            raise ShardingError(
                f"cat: tensors must have same number of dimensions: got {first.ndim} and "
                f"{a.ndim}"
            )
        for k in range(a.ndim):
            if k != d and a.shape[k] != first.shape[k]:
                raise ShardingError(
                    f"cat: sizes of tensors must match except in dimension {d}. Expected "
                    f"size {first.shape[k]} but got size {a.shape[k]} for tensor number {i} "
                    "in the list"
                )
    shape = list(first.shape)
    shape[d] = sum(a.shape[d] for a in kept)
    o = new_array(tuple(shape), dt, first)
    return wrap(xp_of(first).concatenate(kept, axis=d, out=o))


concat = cat


def stack(tensors, dim: int = 0) -> Tensor:
    """Stack equal-shaped tensors along a new dim. **Local**.

    Parameters
    ----------
    tensors : sequence of Tensor
        All of one shape; dtypes promote as in PyTorch.
    dim : int
        In ``[-(ndim + 1), ndim]``.

    Returns
    -------
    Tensor
    """
    arrays = _tensor_list("stack", tensors)
    first = arrays[0]
    for i, a in enumerate(arrays):
        if a.shape != first.shape:
            raise ShardingError(
                f"stack: expects each tensor to be equal size, but got {list(first.shape)} at "
                f"entry 0 and {list(a.shape)} at entry {i}"
            )
    d = _norm_dim(dim, first.ndim + 1, "stack")
    shape = first.shape[:d] + (len(arrays),) + first.shape[d:]
    o = new_array(shape, _promoted(arrays), first)
    return wrap(xp_of(first).stack(arrays, axis=d, out=o))


def _dims_arg(dims) -> tuple:
    """Dims given as varargs ``f(0, 1)`` or as one sequence / int ``f((0, 1))``."""
    if len(dims) == 1 and not isinstance(dims[0], int):
        return tuple(dims[0])
    return tuple(dims)


def flip(input: Tensor, dims) -> Tensor:
    """Reverse the order of elements along ``dims`` (a copy, as in PyTorch). **Local**.

    Parameters
    ----------
    input : Tensor
    dims : int or sequence of int

    Returns
    -------
    Tensor
    """
    a = as_array("flip", input)
    # Note: numpy's flip is a view; PyTorch's (and this) is a copy.
    dims = (dims,) if hasattr(dims, "__index__") else tuple(dims)
    axes = norm_dims("flip", dims, a.ndim) if dims else ()  # no dims: nothing flipped
    o = new_array(a.shape, a.dtype, a)
    xp = xp_of(a)
    xp.copyto(o, xp.flip(a, axis=axes) if axes else a)
    return wrap(o)


def roll(input: Tensor, shifts, dims=None) -> Tensor:
    """Roll elements along ``dims`` (the flattened tensor when None). **Local**.

    Parameters
    ----------
    input : Tensor
    shifts : int or sequence of int
    dims : int, sequence of int, or None
        As many dims as shifts.

    Returns
    -------
    Tensor
    """
    a = as_array("roll", input)
    xp = xp_of(a)
    if dims is None:
        if not isinstance(shifts, int) and len(shifts) != 1:
            raise ShardingError(f"roll: shifts {list(shifts)} need dims (one per shift)")
        return wrap(xp.roll(a.reshape(-1), shifts).reshape(a.shape))
    shifts_t = (shifts,) if isinstance(shifts, int) else tuple(shifts)
    dims_t = (dims,) if isinstance(dims, int) else tuple(dims)
    if len(shifts_t) != len(dims_t):
        raise ShardingError(
            f"roll: shifts and dimensions must align. shifts: {len(shifts_t)}, dims: "
            f"{len(dims_t)}"
        )
    axes = tuple(_norm_dim(d, a.ndim, "roll") for d in dims_t)
    if a.ndim == 0:
        return wrap(a.copy())
    return wrap(xp.roll(a, shifts_t, axis=axes))


def _triangle(op, input, diagonal):
    a = as_array(op, input)
    if a.ndim < 2:
        raise ShardingError(f"{op}: input tensor must have at least 2 dimensions, got {a.ndim}")
    xp = xp_of(a)
    return wrap((xp.tril if op == "tril" else xp.triu)(a, diagonal))


def tril(input: Tensor, diagonal: int = 0) -> Tensor:
    """Lower triangle of the last two dims (others zeroed), above ``diagonal`` excluded.

    **Local.**

    Returns
    -------
    Tensor
    """
    return _triangle("tril", input, diagonal)


def triu(input: Tensor, diagonal: int = 0) -> Tensor:
    """Upper triangle of the last two dims (others zeroed), below ``diagonal`` excluded.

    **Local.**

    Returns
    -------
    Tensor
    """
    return _triangle("triu", input, diagonal)


def repeat(input: Tensor, *sizes) -> Tensor:
    """``Tensor.repeat``: tile ``input`` ``sizes[i]`` times along dim ``i``. **Local**.

    ``sizes`` (varargs or one sequence) has at least ``input.ndim`` entries; extra leading
    entries add new leading dims.

    Returns
    -------
    Tensor
    """
    a = as_array("repeat", input)
    reps = _dims_arg(sizes)
    if len(reps) < a.ndim:
        raise ShardingError(
            f"repeat: number of dimensions of repeat dims ({len(reps)}) can not be smaller "
            f"than number of dimensions of tensor ({a.ndim})"
        )
    return wrap(xp_of(a).tile(a, reps))


def tile(input: Tensor, dims) -> Tensor:
    """Tile ``input`` ``dims[i]`` times along dim ``i``; missing leading dims count 1.

    **Local.** Unlike :func:`repeat`, ``dims`` may be shorter than ``input.ndim``.

    Returns
    -------
    Tensor
    """
    a = as_array("tile", input)
    reps = (dims,) if isinstance(dims, int) else tuple(dims)
    return wrap(xp_of(a).tile(a, reps))

