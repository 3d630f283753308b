"""Linear-algebra local kernels: matmul (``@``), mm, bmm, addmm, dot, outer, einsum, linear.

All are **Local** plain functions with PyTorch's names and arguments. As in PyTorch, the
operands of a product must share one dtype (no promotion) and bool is refused. float16 and
bfloat16 products multiply and sum in float32 (BLAS) and round the result once, as
PyTorch's CPU kernels accumulate them.
"""

from __future__ import annotations

import numpy as np

from placements.errors import DTypeError, ShardingError

from ..tensor import Tensor
from .base import (
    acc_dtype,
    as_array,
    broadcast_shapes,
    cast_scalar,
    check_out,
    out_buffer,
    store,
    tname,
    wrap,
    xp_of,
)
from .pointwise import mul

#: The dtypes whose products numpy computes in the dtype itself, as PyTorch does (float16
#: and bfloat16 accumulate in float32 instead; bool is refused).
DIRECT_DTYPES = frozenset(np.dtype(t) for t in "fdFDbBhHiIlLqQ")


def _same_dtype(op: str, *arrays):
    """The common dtype of a product's operands; mixed dtypes and bool are DTypeErrors."""
    # Note: numpy promotes mixed dtypes in matmul/einsum/dot; PyTorch refuses them, as here.
    dt = arrays[0].dtype
    for a in arrays[1:]:
        if a.dtype != dt:
            raise DTypeError(
                f"{op}: expected all operands to have the same dtype, but got "
                + " and ".join(tname(b.dtype) for b in arrays)
            )
    if dt.kind == "b":
        raise DTypeError(f"{op}: not supported for Bool tensors")
    return dt


def _matmul_shape(op: str, sa: tuple, sb: tuple) -> tuple:
    """Result shape of ``matmul`` (1-D, 2-D and broadcast batched operands)."""
    if not sa or not sb:
        raise ShardingError(
            f"{op}: both arguments need to be at least 1D, but they are {len(sa)}D and "
            f"{len(sb)}D"
        )
    k_a = sa[-1]
    k_b = sb[0] if len(sb) == 1 else sb[-2]
    if k_a != k_b:
        raise ShardingError(
            f"{op}: shapes {tuple(sa)} and {tuple(sb)} cannot be multiplied ({k_a} != {k_b})"
        )
    batch = broadcast_shapes(op, sa[:-2], sb[:-2])
    return batch + tuple(sa[-2:-1]) + (() if len(sb) == 1 else (sb[-1],))


def _matmul(op: str, a, b, out=None):
    sa, sb = a.shape, b.shape
    if (out is None and len(sb) == 2 and len(sa) >= 2 and sa[-1] == sb[0]
            and a.dtype is b.dtype and a.dtype in DIRECT_DTYPES):
        # a matrix of one dtype on the right (the common call): nothing to broadcast or check
        if len(sa) == 2:
            return xp_of(a).matmul(a, b, out=out_buffer((sa[0], sb[1]), a.dtype, a))
        if sa[-1] and a.flags.c_contiguous:
            # (..., m, k) @ (k, n) with a dense left operand: its batch dims fold into rows,
            # one BLAS call on (batch * m, k) (numpy runs one per batch entry, and with a
            # transposed right operand, as in ``linear``, 10-25 % slower in all).
            rows = a.size // sa[-1]
            r = xp_of(a).matmul(a.reshape(rows, sa[-1]), b,
                                out=out_buffer((rows, sb[1]), a.dtype, a))
            return r.reshape(sa[:-1] + (sb[1],))
    dt = _same_dtype(op, a, b)
    shape = _matmul_shape(op, a.shape, b.shape)
    o = out_buffer(shape, dt, a) if out is None else check_out(op, out, shape, dt)
    acc = acc_dtype(dt)
    if acc != dt:
        return store(o, xp_of(a).matmul(a.astype(acc), b.astype(acc)), dt)
    return xp_of(a).matmul(a, b, out=o)


def matmul(input: Tensor, other: Tensor, *, out=None) -> Tensor:
    """Matrix product with numpy/PyTorch ``matmul`` semantics. **Local**.

    1-D operands are vectors (a 1-D first operand is a row, a 1-D second operand a column;
    the added dim is removed from the result); batch dims (all but the last two) broadcast.

    Parameters
    ----------
    input, other : Tensor
        At least 1-D, same dtype (not bool).
    out : Tensor, optional

    Returns
    -------
    Tensor
    """
    r = _matmul("matmul", as_array("matmul", input), as_array("matmul", other), out)
    return out if out is not None else wrap(r)


def mm(input: Tensor, mat2: Tensor, *, out=None) -> Tensor:
    """Product of two matrices (2-D only, no broadcasting). **Local**.

    Returns
    -------
    Tensor
    """
    a, b = as_array("mm", input), as_array("mm", mat2)
    if a.ndim != 2 or b.ndim != 2:
        raise ShardingError(f"mm: expected 2-D tensors, got {a.ndim}-D and {b.ndim}-D")
    r = _matmul("mm", a, b, out)
    return out if out is not None else wrap(r)


def bmm(input: Tensor, mat2: Tensor, *, out=None) -> Tensor:
    """Batched product of 3-D tensors ``(b, n, m) @ (b, m, p)`` (no broadcasting). **Local**.

    Returns
    -------
    Tensor
    """
    a, b = as_array("bmm", input), as_array("bmm", mat2)
    if a.ndim != 3 or b.ndim != 3:
        raise ShardingError(f"bmm: expected 3-D tensors, got {a.ndim}-D and {b.ndim}-D")
    if a.shape[0] != b.shape[0]:
        raise ShardingError(
            f"bmm: batch sizes differ: {tuple(a.shape)} and {tuple(b.shape)}"
        )
    r = _matmul("bmm", a, b, out)
    return out if out is not None else wrap(r)


def addmm(input: Tensor, mat1: Tensor, mat2: Tensor, *, beta=1, alpha=1, out=None) -> Tensor:
    """``beta * input + alpha * (mat1 @ mat2)``. **Local**.

    Parameters
    ----------
    input : Tensor
        Broadcastable to the ``(n, p)`` product; ignored (NaN included) when ``beta`` is 0.
    mat1, mat2 : Tensor
        2-D, all three of one dtype.
    beta, alpha : python scalars

    Returns
    -------
    Tensor
    """
    c, a, b = (as_array("addmm", x) for x in (input, mat1, mat2))
    if a.ndim != 2 or b.ndim != 2:
        raise ShardingError(f"addmm: expected 2-D matrices, got {a.ndim}-D and {b.ndim}-D")
    dt = _same_dtype("addmm", c, a, b)
    shape = _matmul_shape("addmm", a.shape, b.shape)
    if broadcast_shapes("addmm", c.shape, shape) != shape:
        raise ShardingError(
            f"addmm: input of shape {tuple(c.shape)} does not broadcast to the product's "
            f"shape {shape}"
        )
    o = None if out is None else check_out("addmm", out, shape, dt)
    xp = xp_of(a)
    acc = acc_dtype(dt)  # float16/bfloat16: all of it in float32, rounded once
    c = c.astype(acc, copy=False)
    # The product goes to a fresh buffer: ``out`` may be ``input`` itself.
    r = _matmul("addmm", a.astype(acc, copy=False), b.astype(acc, copy=False))
    if alpha != 1:
        xp.multiply(r, cast_scalar(alpha, acc), out=r)
    if beta != 0:
        xp.add(r, c if beta == 1 else c * cast_scalar(beta, acc), out=r)
    r = store(o, r, dt)
    return wrap(r) if o is None else out


def dot(input: Tensor, other: Tensor) -> Tensor:
    """Inner product of two 1-D tensors of one size and dtype (0-d result). **Local**.

    Returns
    -------
    Tensor
    """
    a, b = as_array("dot", input), as_array("dot", other)
    if a.ndim != 1 or b.ndim != 1:
        raise ShardingError(f"dot: 1D tensors expected, but got {a.ndim}D and {b.ndim}D tensors")
    if a.shape != b.shape:
        raise ShardingError(
            f"dot: inconsistent tensor size, expected tensors to have the same number of "
            f"elements, but got {a.shape[0]} and {b.shape[0]} elements"
        )
    dt = _same_dtype("dot", a, b)
    acc = acc_dtype(dt)
    r = xp_of(a).dot(a.astype(acc, copy=False), b.astype(acc, copy=False))
    return wrap(xp_of(a).asarray(r).astype(dt, copy=False))


def outer(input: Tensor, vec2: Tensor) -> Tensor:
    """Outer product of two 1-D tensors (dtypes promote, as ``mul``). **Local**.

    Returns
    -------
    Tensor
    """
    a, b = as_array("outer", input), as_array("outer", vec2)
    if a.ndim != 1 or b.ndim != 1:
        raise ShardingError(f"outer: 1D tensors expected, but got {a.ndim}D and {b.ndim}D")
    return mul(wrap(a[:, None]), wrap(b))


# einsum: numpy's path optimisation (BLAS-backed pairwise contractions) pays off beyond
# this many elements in all operands; below it the direct loop is faster.
_EINSUM_OPTIMIZE_MIN = 4096


def einsum(equation: str, *operands) -> Tensor:
    """Einstein summation, as ``torch.einsum`` / ``numpy.einsum`` (``...`` allowed). **Local**.

    Parameters
    ----------
    equation : str
        For example ``"bij,bjk->bik"``.
    *operands : Tensor
        All of one dtype; a single list or tuple of tensors is accepted too.

    Returns
    -------
    Tensor
    """
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if not operands:
        raise ShardingError(f"einsum: equation {equation!r} needs at least one operand")
    arrays = [as_array("einsum", x) for x in operands]
    dt = _same_dtype("einsum", *arrays)
    acc = acc_dtype(dt)
    arrays = [a.astype(acc, copy=False) for a in arrays]
    xp = xp_of(arrays[0])
    optimize = len(arrays) > 1 and sum(a.size for a in arrays) >= _EINSUM_OPTIMIZE_MIN
    try:
        r = xp.einsum(equation, *arrays, optimize=optimize)
    except ValueError as exc:
        shapes = ", ".join(str(tuple(a.shape)) for a in arrays)
        raise ShardingError(f"einsum: {exc} (equation {equation!r}, shapes {shapes})") from exc
    return wrap(xp.asarray(r).astype(dt, copy=False))


def linear(input: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``input @ weight.T + bias``. **Local**.

    Parameters
    ----------
    input : Tensor
        ``(*, in_features)``.
    weight : Tensor
        ``(out_features, in_features)`` (or ``(in_features,)``).
    bias : Tensor, optional
        ``(out_features,)`` (or broadcastable to the output).

    Returns
    -------
    Tensor
        ``(*, out_features)``.
    """
    x, w = as_array("linear", input), as_array("linear", weight)
    if w.ndim not in (1, 2):
        raise ShardingError(f"linear: weight must be 1-D or 2-D, got {w.ndim}-D")
    dt = _same_dtype("linear", x, w)
    acc = acc_dtype(dt)  # float16/bfloat16: product and bias in float32, rounded once
    r = _matmul("linear", x.astype(acc, copy=False), w.T.astype(acc, copy=False))
    if bias is not None:
        b = as_array("linear", bias)
        _same_dtype("linear", x, b)
        if broadcast_shapes("linear", b.shape, r.shape) != r.shape:
            raise ShardingError(
                f"linear: bias of shape {tuple(b.shape)} does not broadcast to the output "
                f"shape {tuple(r.shape)}"
            )
        b = b.astype(acc, copy=False)
        r = xp_of(r).add(r, b, out=r) if r.ndim else r + b
    return wrap(r.astype(dt, copy=False))
