"""Stride arithmetic of the local strided tensor (pure-Python reference).

This module owns the three stride functions that the view machinery of
:mod:`dtensor.local.tensor` is built on. They follow PyTorch's definitions exactly
(``c10::contiguous_strides``, ``is_contiguous`` and ``at::detail::computeStride``).
``infer_size`` (``at::infer_size``) is :func:`placements.meta.infer_size`, re-exported
here so that this module and the compiled ``fastpath.strides`` offer the same four
functions. Sizes, strides and results are plain tuples of ``int`` in *elements*, so a
compiled module with the same names and signatures can replace these functions at
import time; callers reach them through the module attribute.
"""

from __future__ import annotations

from placements.meta import infer_size

__all__ = ["compute_view_strides", "contiguous_strides", "infer_size", "is_contiguous"]


def contiguous_strides(sizes: tuple) -> tuple:
    """Row-major strides of a dense tensor of ``sizes``.

    **Local.** Size-0 dims count as 1 (as in PyTorch), so every stride is >= 1.

    Parameters
    ----------
    sizes : tuple of int

    Returns
    -------
    tuple of int
        ``strides[d] == prod(max(s, 1) for s in sizes[d + 1:])``.
    """
    strides = [1] * len(sizes)
    acc = 1
    for d in range(len(sizes) - 1, -1, -1):
        strides[d] = acc
        size = sizes[d]
        if size > 1:
            acc *= size
    return tuple(strides)


def is_contiguous(sizes: tuple, strides: tuple) -> bool:
    """PyTorch's contiguity rule.

    **Local.** Dims of size 1 are ignored (their stride may be anything) and a tensor
    with no elements is contiguous.

    Parameters
    ----------
    sizes, strides : tuple of int
        Sizes and strides in elements.

    Returns
    -------
    bool
    """
    if 0 in sizes:
        return True
    expected = 1
    for d in range(len(sizes) - 1, -1, -1):
        size = sizes[d]
        if size != 1:
            if strides[d] != expected:
                return False
            expected *= size
    return True


def compute_view_strides(sizes: tuple, strides: tuple, new_sizes: tuple) -> tuple | None:
    """Strides of ``view(new_sizes)`` on a tensor of ``sizes``/``strides``, if one exists.

    **Local.** This is PyTorch's ``computeStride``: the old dims are cut into chunks of
    memory-contiguous dims and each chunk must be covered exactly by consecutive new dims.

    Parameters
    ----------
    sizes, strides : tuple of int
        The input's sizes and strides in elements.
    new_sizes : tuple of int
        The requested sizes (already inferred; same number of elements).

    Returns
    -------
    tuple of int or None
        The view's strides, or ``None`` when no view is possible (a copy is needed).
    """
    if not sizes:
        return (1,) * len(new_sizes)
    numel = 1
    for size in sizes:
        numel *= size
    if numel == 0:
        if tuple(sizes) == tuple(new_sizes):
            return tuple(strides)
        # Arbitrary in PyTorch; it uses the strides a fresh resize would give.
        return contiguous_strides(new_sizes)

    new_strides = [0] * len(new_sizes)
    view_d = len(new_sizes) - 1
    chunk_base_stride = strides[-1]
    tensor_numel = 1
    view_numel = 1
    for tensor_d in range(len(sizes) - 1, -1, -1):
        tensor_numel *= sizes[tensor_d]
        if tensor_d == 0 or (
            sizes[tensor_d - 1] != 1 and strides[tensor_d - 1] != tensor_numel * chunk_base_stride
        ):
            while view_d >= 0 and (view_numel < tensor_numel or new_sizes[view_d] == 1):
                new_strides[view_d] = view_numel * chunk_base_stride
                view_numel *= new_sizes[view_d]
                view_d -= 1
            if view_numel != tensor_numel:
                return None
            if tensor_d > 0:
                chunk_base_stride = strides[tensor_d - 1]
                tensor_numel = 1
                view_numel = 1
    if view_d != -1:
        return None
    return tuple(new_strides)
