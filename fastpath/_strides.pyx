# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# cython: initializedcheck=False, nonecheck=False, infer_types=True, embedsignature=True
"""Compiled stride math: drop-in twins of the functions in ``dtensor.local.strides``.

Same names, signatures, results and errors as the pure-Python reference (whose
``infer_size`` is :func:`placements.meta.infer_size`); dtensor swaps these in at import
time (unless ``DTENSOR_FASTPATH=0``). Inputs are sequences of ints (tuples on the hot
path); outputs are tuples of Python ints, ``bool`` or ``None``. Every function is
**Local** (no communication). Arithmetic is done in 64-bit integers, like PyTorch's
``int64_t`` sizes and strides. Errors are dtensor's ``ViewError`` (a ``RuntimeError``),
as in the reference.
"""

from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM
from libc.stdint cimport INT64_MAX, int64_t

from placements.errors import ViewError
from placements.meta import infer_size as _meta_infer_size

__all__ = ["contiguous_strides", "compute_view_strides", "infer_size", "is_contiguous"]


cdef inline tuple _as_tuple(object seq):
    if type(seq) is tuple:
        return <tuple>seq
    return tuple(seq)


cdef inline void _set(tuple out, Py_ssize_t i, int64_t value):
    # PyTuple_SET_ITEM steals a reference: hand it one.
    cdef object item = value
    Py_INCREF(item)
    PyTuple_SET_ITEM(out, i, item)


cdef inline void _check_lengths(str op, tuple sizes, tuple strides) except *:
    if len(sizes) != len(strides):
        raise ValueError(
            f"{op}: sizes {sizes} and strides {strides} have different lengths"
        )


def contiguous_strides(sizes):
    """Row-major strides (in elements) of a tensor with ``sizes``, as PyTorch computes them.

    **Local.** Zero-size dims count as size 1, so ``(2, 0, 3)`` gives ``(3, 3, 1)``.

    Parameters
    ----------
    sizes : tuple of int

    Returns
    -------
    tuple of int
    """
    cdef tuple sz = _as_tuple(sizes)
    cdef Py_ssize_t n = len(sz)
    cdef tuple out = PyTuple_New(n)
    cdef int64_t acc = 1, s
    cdef Py_ssize_t d
    for d in range(n - 1, -1, -1):
        _set(out, d, acc)
        s = sz[d]
        if s > 1:
            acc *= s
    return out


def is_contiguous(sizes, strides):
    """Whether ``(sizes, strides)`` describe a C-contiguous tensor, by PyTorch's rule.

    **Local.** Dims of size 1 are ignored; a tensor with zero elements is contiguous.

    Parameters
    ----------
    sizes, strides : tuple of int
        Same length; strides in elements.

    Returns
    -------
    bool
    """
    cdef tuple sz = _as_tuple(sizes)
    cdef tuple st = _as_tuple(strides)
    _check_lengths("is_contiguous", sz, st)
    cdef Py_ssize_t n = len(sz), d
    cdef int64_t expected = 1, s
    for d in range(n):
        if <int64_t>sz[d] == 0:
            return True
    for d in range(n - 1, -1, -1):
        s = sz[d]
        if s != 1:
            if <int64_t>st[d] != expected:
                return False
            expected *= s
    return True


def compute_view_strides(sizes, strides, new_sizes):
    """Strides that view ``(sizes, strides)`` as ``new_sizes`` without a copy, or ``None``.

    **Local.** PyTorch's ``computeStride`` (``aten/src/ATen/TensorUtils.cpp``): the old
    dims are split into chunks that are contiguous with respect to each other, and every
    chunk must map onto a run of new dims with the same number of elements. Size-1 dims
    are free; for a tensor with zero elements the old strides are kept when the sizes do
    not change, else the strides are the contiguous strides of ``new_sizes``. The caller
    guarantees that both shapes hold the same number of elements (``infer_size``).

    Parameters
    ----------
    sizes, strides : tuple of int
        The current sizes and strides (in elements), same length.
    new_sizes : tuple of int
        The requested sizes, without ``-1``.

    Returns
    -------
    tuple of int or None
        The new strides, or ``None`` when the view is impossible (the caller then copies,
        as ``reshape`` does, or raises, as ``view`` does).
    """
    cdef tuple old = _as_tuple(sizes)
    cdef tuple ost = _as_tuple(strides)
    cdef tuple new = _as_tuple(new_sizes)
    _check_lengths("compute_view_strides", old, ost)
    cdef Py_ssize_t n_old = len(old), n_new = len(new), d, view_d, tensor_d
    cdef tuple out = PyTuple_New(n_new)
    cdef int64_t numel = 1, acc, chunk_base_stride, tensor_numel, view_numel, s

    if n_old == 0:
        for d in range(n_new):
            _set(out, d, 1)
        return out

    for d in range(n_old):
        numel *= <int64_t>old[d]
    if numel == 0:
        if old == new:
            return ost
        acc = 1
        for d in range(n_new - 1, -1, -1):
            _set(out, d, acc)
            s = new[d]
            if s > 1:
                acc *= s
        return out

    view_d = n_new - 1
    chunk_base_stride = ost[n_old - 1]
    tensor_numel = 1
    view_numel = 1
    for tensor_d in range(n_old - 1, -1, -1):
        tensor_numel *= <int64_t>old[tensor_d]
        # End of a chunk: the next outer dim is not a contiguous continuation of it.
        if tensor_d == 0 or (
            <int64_t>old[tensor_d - 1] != 1
            and <int64_t>ost[tensor_d - 1] != tensor_numel * chunk_base_stride
        ):
            while view_d >= 0 and (view_numel < tensor_numel or <int64_t>new[view_d] == 1):
                _set(out, view_d, view_numel * chunk_base_stride)
                view_numel *= <int64_t>new[view_d]
                view_d -= 1
            if view_numel != tensor_numel:
                return None
            if tensor_d > 0:
                chunk_base_stride = ost[tensor_d - 1]
                tensor_numel = 1
                view_numel = 1
    if view_d != -1:
        return None
    return out


def infer_size(shape, numel):
    """``shape`` with its one ``-1`` (if any) replaced so that it holds ``numel`` elements.

    **Local.** PyTorch's ``infer_size`` with its error messages: the compiled twin of
    :func:`placements.meta.infer_size` for sizes that are Python ints whose product fits
    in 64 bits. Any other shape (numpy integers, a value that is not an int, a product
    beyond 64 bits) is handed to the meta function, so results and errors are its own.

    Parameters
    ----------
    shape : tuple of int
        Sizes, each >= 0, at most one of them -1.
    numel : int
        The number of elements the shape must hold.

    Returns
    -------
    tuple of int

    Raises
    ------
    ViewError
        "only one dimension can be inferred", "invalid shape dimension -2",
        "shape '[3, 5]' is invalid for input of size 8", or, for ``-1`` with zero
        elements, "cannot reshape tensor of 0 elements into shape [-1, 0] because the
        unspecified dimension size -1 can be any value and is ambiguous".
    DTypeError
        A size that is not an int (from the meta function).
    """
    cdef tuple sh = _as_tuple(shape)
    cdef Py_ssize_t n = len(sh), d, infer_dim = -1
    cdef int64_t total = numel, newsize = 1, s
    cdef object v
    for v in sh:
        if type(v) is not int:
            return _meta_infer_size(sh, numel)
    for d in range(n):
        try:
            s = sh[d]
        except OverflowError:  # beyond 64 bits
            return _meta_infer_size(sh, numel)
        if s == -1:
            if infer_dim >= 0:
                raise ViewError("only one dimension can be inferred")
            infer_dim = d
        elif s >= 0:
            if s and newsize > INT64_MAX // s:
                return _meta_infer_size(sh, numel)
            newsize *= s
        else:
            raise ViewError(f"invalid shape dimension {s}")
    if total == newsize or (infer_dim >= 0 and newsize > 0 and total % newsize == 0):
        if infer_dim < 0:
            return sh
        if newsize == 0:
            raise ViewError(
                f"cannot reshape tensor of 0 elements into shape {_fmt(sh)} because the "
                "unspecified dimension size -1 can be any value and is ambiguous"
            )
        out = list(sh)
        out[infer_dim] = total // newsize
        return tuple(out)
    raise ViewError(f"shape '{_fmt(sh)}' is invalid for input of size {total}")


cdef str _fmt(tuple shape):
    return "[" + ", ".join([str(v) for v in shape]) + "]"
