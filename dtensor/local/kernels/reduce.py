"""Reduction and scan local kernels: sum, mean, prod, max/min (with indices), amax/amin,
argmax/argmin, var/std, norm, any/all, logsumexp, cumsum/cumprod, count_nonzero.

All are **Local** plain functions with PyTorch's names and arguments. ``dim`` is None (every
dim), an int or a sequence of ints (negative dims count from the end); ``keepdim`` keeps
reduced dims as size 1. Dtypes follow PyTorch: sums and products of bool and integer
tensors are int64; mean, var, std and norm need floating (or complex) tensors. float16 and
bfloat16 sums, means, norms, variances, scans and logsumexp accumulate in float32 and round
the result (:func:`~dtensor.local.kernels.base.acc_dtype`), as PyTorch's CPU kernels do.

Sum, mean and amax of a contiguous float32 host array over its last dim or over every dim
run one compiled loop (``fastpath._kernels.reduce_lastdim``); numpy serves everything else.
Its sums add in float32 lanes with float64 block totals, an order that is not numpy's
pairwise one, so sum and mean run it wherever the extension is built, in both dispatch
modes (which then give identical bytes); without the extension numpy sums them, equal to
the compiled sums within float32 rounding (about 21 u sum(|x|)), not to the bit. amax
(numpy's result exactly) runs it only with the fast path enabled.
"""

from __future__ import annotations

import builtins
import math
from collections import namedtuple

import numpy as np

import fastpath as _fp
from placements.errors import DTypeError, NoRuleError, ShardingError
from placements.meta import (
    check_nonempty_reduction,
    dtype_kind,
    norm_dims,
    real_dtype,
    reduced_shape,
)

from ..dtypes import to_dtype
from ..tensor import Tensor, _norm_dim, wrap_array
from .base import (
    INT64,
    acc_dtype,
    as_array,
    float_dtype,
    out_buffer,
    tname,
    wrap,
    xp_of,
)
from .pointwise import maximum, minimum

# Results of max/min along a dim, like torch.return_types.max / .min.
MaxResult = namedtuple("max", ("values", "indices"))
MinResult = namedtuple("min", ("values", "indices"))
BOOL = np.dtype(np.bool_)
# compiled last-dim / whole-array reductions of contiguous float32 host arrays: the sums
# wherever the extension is built (both dispatch modes give the same bytes), amax with the
# fast path enabled
_SUMS = _fp.kernels
_KERNELS = _fp.kernels if _fp.ENABLED else None


def _reduce(fn, a, axes, keepdim: bool, dtype=None, result=None):
    """``fn(a, axis=axes, keepdims=keepdim[, dtype=dtype], out=...)`` as an array.

    The output comes from :func:`out_buffer` (pooled when large); ``dtype`` is the result
    dtype passed to ``fn``; ``result`` the result dtype of an ``fn`` that takes no dtype
    (``any``/``all``: bool). Both None: a dtype-preserving reduction.
    """
    kw = {} if dtype is None else {"dtype": dtype}
    rt = result if result is not None else a.dtype if dtype is None else dtype
    o = out_buffer(reduced_shape(a.shape, axes, keepdim), rt, a)
    r = fn(a, axis=axes, keepdims=keepdim, out=o, **kw)
    return np.asarray(r) if isinstance(r, np.generic) else r


def _sum_dtype(dt, dtype):
    """Result dtype of sum/prod/cumsum: ``dtype`` if given, int64 for bool/ints."""
    # Note: PyTorch sums every bool/integer dtype to int64; numpy sums unsigned ones to
    # uint64.
    if dtype is not None:
        return to_dtype(dtype)
    return INT64 if dt.kind in "biu" else dt


def _acc_reduce(fn, a, axes, keepdim, rt):
    """A sum-like reduction accumulated in :func:`acc_dtype` and returned in ``rt``."""
    acc = acc_dtype(rt)
    r = _reduce(fn, a, axes, keepdim, acc)
    return r if acc == rt else r.astype(rt)


def sum(input: Tensor, dim=None, keepdim: bool = False, *, dtype=None) -> Tensor:
    """Sum over ``dim``. **Local**.

    Parameters
    ----------
    input : Tensor
    dim : int, sequence of int or None
        None (or an empty sequence) reduces every dim.
    keepdim : bool
    dtype : dtype, optional
        Cast the input to this dtype first. Default: int64 for bool and integer inputs,
        else the input's dtype.

    Returns
    -------
    Tensor
    """
    a = as_array("sum", input)
    if _SUMS is not None:
        r = _SUMS.reduce_lastdim("sum", a, dim, keepdim, dtype, out_buffer)
        if r is not None:
            return wrap_array(r)
    axes = norm_dims("sum", dim, a.ndim)
    return wrap(_acc_reduce(xp_of(a).sum, a, axes, keepdim, _sum_dtype(a.dtype, dtype)))


def prod(input: Tensor, dim=None, keepdim: bool = False, *, dtype=None) -> Tensor:
    """Product over ``dim`` (int64 for bool and integer inputs). **Local**.

    Returns
    -------
    Tensor
    """
    a = as_array("prod", input)
    axes = norm_dims("prod", dim, a.ndim)
    return wrap(_acc_reduce(xp_of(a).prod, a, axes, keepdim, _sum_dtype(a.dtype, dtype)))


def _count(shape, axes) -> int:
    return math.prod(shape[i] for i in axes)


def mean(input: Tensor, dim=None, keepdim: bool = False, *, dtype=None) -> Tensor:
    """Mean over ``dim``. **Local**.

    Parameters
    ----------
    input : Tensor
        Floating or complex (or pass ``dtype``).
    dim, keepdim : see :func:`sum`
    dtype : dtype, optional
        Cast the input to this dtype first.

    Returns
    -------
    Tensor
        NaN where the reduced size is 0.

    Raises
    ------
    DTypeError
        For integer or bool inputs without ``dtype``.
    """
    a = as_array("mean", input)
    if _SUMS is not None:
        r = _SUMS.reduce_lastdim("mean", a, dim, keepdim, dtype, out_buffer)
        if r is not None:
            return wrap_array(r)
    # Note: like PyTorch (and unlike numpy, which gives float64), the mean of an integer
    # tensor raises unless a floating dtype is passed.
    rt = to_dtype(dtype) if dtype is not None else a.dtype
    if dtype_kind(rt) not in "fc":
        raise DTypeError(
            "mean(): could not infer output dtype. Input dtype must be either a floating "
            f"point or complex dtype. Got: {tname(rt)}"
        )
    axes = norm_dims("mean", dim, a.ndim)
    r = _reduce(xp_of(a).sum, a, axes, keepdim, acc_dtype(rt))
    r /= _count(a.shape, axes)
    return wrap(r.astype(rt, copy=False))


def _var(op, input, dim, unbiased, keepdim, correction):
    a = as_array(op, input)
    if dtype_kind(a.dtype) not in "fc":
        raise DTypeError(f"{op}: std and var only support floating point and complex dtypes, "
                         f"got {tname(a.dtype)}")
    # PyTorch's legacy overload var(input, unbiased: bool).
    if isinstance(dim, (bool, np.bool_)):
        dim, unbiased = None, dim
    if unbiased is not None and correction is not None:
        raise ShardingError(f"{op}: cannot pass both 'unbiased' and 'correction'")
    if correction is None:
        correction = 0 if unbiased is False else 1
    axes = norm_dims(op, dim, a.ndim)
    acc = acc_dtype(a.dtype)
    xp = xp_of(a)
    m = _reduce(xp.sum, a, axes, True, acc)
    m /= _count(a.shape, axes)
    d = xp.subtract(a, m, dtype=acc)
    d = xp.abs(d) if d.dtype.kind == "c" else d
    d *= d
    r = _reduce(xp.sum, d, axes, keepdim)
    r /= builtins.max(_count(a.shape, axes) - correction, 0)
    return r, real_dtype(a.dtype)


def var(
    input: Tensor, dim=None, unbiased=None, keepdim: bool = False, *, correction=None
) -> Tensor:
    """Variance over ``dim`` with Bessel's ``correction`` (default 1). **Local**.

    Parameters
    ----------
    input : Tensor
        Floating or complex.
    dim : int, sequence of int or None
        (A bool here is PyTorch's legacy ``var(input, unbiased)``.)
    unbiased : bool, optional
        ``False`` means ``correction=0``.
    keepdim : bool
    correction : int, optional
        The divisor is ``max(N - correction, 0)``.

    Returns
    -------
    Tensor
    """
    r, rt = _var("var", input, dim, unbiased, keepdim, correction)
    return wrap(r.astype(rt, copy=False))


def std(
    input: Tensor, dim=None, unbiased=None, keepdim: bool = False, *, correction=None
) -> Tensor:
    """Standard deviation: the square root of :func:`var` (same arguments). **Local**.

    Returns
    -------
    Tensor
    """
    r, rt = _var("std", input, dim, unbiased, keepdim, correction)
    r = xp_of(r).sqrt(r, out=r)
    return wrap(r.astype(rt, copy=False))


def _extreme(op: str, input: Tensor, dim, keepdim: bool) -> Tensor:
    """amax/amin of ``input`` over ``dim`` (every dim when empty); NaN propagates."""
    a = as_array(op, input)
    if op == "amax" and _KERNELS is not None:
        r = _KERNELS.reduce_lastdim("amax", a, dim, keepdim, None, out_buffer)
        if r is not None:
            return wrap_array(r)
    axes = norm_dims(op, dim, a.ndim)
    check_nonempty_reduction(op, a.shape, axes)
    xp = xp_of(a)
    return wrap(_reduce(xp.max if op == "amax" else xp.min, a, axes, keepdim))


def amax(input: Tensor, dim=(), keepdim: bool = False) -> Tensor:
    """Maximum over ``dim`` (default: every dim); NaN propagates. **Local**.

    Returns
    -------
    Tensor
    """
    return _extreme("amax", input, dim, keepdim)


def amin(input: Tensor, dim=(), keepdim: bool = False) -> Tensor:
    """Minimum over ``dim`` (default: every dim); NaN propagates. **Local**.

    Returns
    -------
    Tensor
    """
    return _extreme("amin", input, dim, keepdim)


def _arg(op, a, dim, keepdim, caller=None):
    """argmax/argmin indices (int64) of array ``a``; the first occurrence wins on ties.
    Errors name ``caller`` (max/min along a dim), default ``op``."""
    xp = xp_of(a)
    fn = xp.argmax if op == "argmax" else xp.argmin
    if dim is None:
        check_nonempty_reduction(caller or op, a.shape, None)
        # Note: with dim=None, keepdim=True keeps every dim as size 1 (numpy's behaviour).
        r = fn(a, axis=None, keepdims=keepdim) if keepdim else fn(a)
    else:
        d = _norm_dim(dim, a.ndim, op)
        if a.ndim == 0:
            return xp.zeros((), INT64)
        check_nonempty_reduction(caller or op, a.shape, (d,))
        r = fn(a, axis=d, keepdims=keepdim)
    r = np.asarray(r) if isinstance(r, np.generic) else r
    return r.astype(INT64, copy=False)


def argmax(input: Tensor, dim=None, keepdim: bool = False) -> Tensor:
    """Index of the maximum (flat index when ``dim`` is None). **Local**.

    Ties give the first occurrence; NaN counts as the maximum (first NaN).

    Returns
    -------
    Tensor
        int64.
    """
    return wrap(_arg("argmax", as_array("argmax", input), dim, keepdim))


def argmin(input: Tensor, dim=None, keepdim: bool = False) -> Tensor:
    """Index of the minimum (flat index when ``dim`` is None); first occurrence. **Local**.

    Returns
    -------
    Tensor
        int64.
    """
    return wrap(_arg("argmin", as_array("argmin", input), dim, keepdim))


def _max_min(op, input, dim, keepdim, pairwise, result):
    if dim is None:
        a = as_array(op, input)
        check_nonempty_reduction(op, a.shape, None)
        return wrap(_reduce(xp_of(a).max if op == "max" else xp_of(a).min, a, None, False))
    # Note: with a dim, max/min return the namedtuple (values, indices) like PyTorch's
    # torch.return_types.max (numpy's max has no indices).
    if not isinstance(dim, (int, np.integer)):
        # max(input, other): the elementwise maximum.
        return pairwise(input, dim)
    a = as_array(op, input)
    xp = xp_of(a)
    d = _norm_dim(dim, a.ndim, op)
    idx = _arg("argmax" if op == "max" else "argmin", a, d, True, op)
    if a.ndim == 0:
        return result(wrap(a.copy()), wrap(idx))
    values = xp.take_along_axis(a, idx, axis=d)
    if not keepdim:
        values, idx = values.squeeze(d), idx.squeeze(d)
    return result(wrap(values), wrap(idx))


def max(input: Tensor, dim=None, keepdim: bool = False) -> Tensor | tuple:
    """Maximum: of every element, along a dim with indices, or of two tensors. **Local**.

    ``max(input)`` -> 0-d Tensor; ``max(input, dim, keepdim=False)`` -> the namedtuple
    ``(values, indices)`` (indices of the first maximal element); ``max(input, other)``
    with a Tensor ``other`` -> :func:`maximum`.
    """
    return _max_min("max", input, dim, keepdim, maximum, MaxResult)


def min(input: Tensor, dim=None, keepdim: bool = False) -> Tensor | tuple:
    """Minimum: of every element, along a dim with indices, or of two tensors. **Local**.

    See :func:`max`; ``min(input, other)`` is :func:`minimum`.
    """
    return _max_min("min", input, dim, keepdim, minimum, MinResult)


def norm(input: Tensor, p="fro", dim=None, keepdim: bool = False, *, dtype=None) -> Tensor:
    """Vector p-norm over ``dim`` (every dim when None). **Local**.

    Parameters
    ----------
    input : Tensor
        Floating or complex (complex gives a real result).
    p : float, int, inf, -inf or 'fro'
        ``'fro'`` is the 2-norm over the given dims; ``inf``/``-inf`` the max/min absolute
        value; 0 the number of non-zeros; other p: ``sum(|x|**p) ** (1/p)``.
    dim, keepdim : see :func:`sum`
    dtype : dtype, optional
        Cast the input to this dtype first.

    Returns
    -------
    Tensor
    """
    a = as_array("norm", input)
    if dtype is not None:
        a = a.astype(to_dtype(dtype))
    if dtype_kind(a.dtype) not in "fc":
        raise DTypeError(f"norm(): input dtype should be either floating point or complex, "
                         f"got {tname(a.dtype)}")
    if p == "fro":
        p = 2
    elif isinstance(p, str):
        raise NoRuleError(f"norm: p={p!r} is not supported (vector norms and 'fro' only)")
    axes = norm_dims("norm", dim, a.ndim)
    xp = xp_of(a)
    x = xp.abs(a)
    rt = x.dtype
    if p == math.inf:
        return amax(wrap(x), axes, keepdim)
    if p == -math.inf:
        return amin(wrap(x), axes, keepdim)
    if p == 0:
        return wrap(_reduce(xp.sum, x != 0, axes, keepdim, rt))
    if p == 1:
        return wrap(_acc_reduce(xp.sum, x, axes, keepdim, rt))
    acc = acc_dtype(rt)
    if p == 2:
        r = xp.sqrt(_reduce(xp.sum, xp.multiply(x, x, dtype=acc), axes, keepdim))
    else:
        r = xp.power(_reduce(xp.sum, xp.power(x, p, dtype=acc), axes, keepdim), 1.0 / p)
    return wrap(r.astype(rt, copy=False))


def any(input: Tensor, dim=None, keepdim: bool = False) -> Tensor:
    """True where any element over ``dim`` is non-zero. **Local**. Returns a bool Tensor."""
    a = as_array("any", input)
    return wrap(_reduce(xp_of(a).any, a, norm_dims("any", dim, a.ndim), keepdim, result=BOOL))


def all(input: Tensor, dim=None, keepdim: bool = False) -> Tensor:
    """True where every element over ``dim`` is non-zero. **Local**. Returns a bool Tensor."""
    a = as_array("all", input)
    return wrap(_reduce(xp_of(a).all, a, norm_dims("all", dim, a.ndim), keepdim, result=BOOL))


def logsumexp(input: Tensor, dim, keepdim: bool = False) -> Tensor:
    """``log(sum(exp(input)))`` over ``dim``, computed stably (max subtracted). **Local**.

    Integer inputs compute in the default float dtype. Rows of ``-inf`` give ``-inf``.

    Returns
    -------
    Tensor
    """
    a = as_array("logsumexp", input)
    rt = float_dtype(a.dtype)
    a = a.astype(acc_dtype(rt), copy=False)
    axes = norm_dims("logsumexp", dim, a.ndim)
    xp = xp_of(a)
    if a.size == 0:
        return wrap(xp.log(_reduce(xp.sum, xp.exp(a), axes, keepdim)).astype(rt, copy=False))
    m = _reduce(xp.max, a, axes, True)
    m = xp.where(xp.isfinite(m), m, a.dtype.type(0))
    e = xp.exp(a - m)
    r = xp.log(_reduce(xp.sum, e, axes, True))
    r += m
    r = r if keepdim else r.reshape(reduced_shape(a.shape, axes, False))
    return wrap(r.astype(rt, copy=False))


def _scan(op, input, dim, dtype):
    a = as_array(op, input)
    d = _norm_dim(dim, a.ndim, op)
    rt = _sum_dtype(a.dtype, dtype)
    xp = xp_of(a)
    fn = xp.cumsum if op == "cumsum" else xp.cumprod
    if a.ndim == 0:
        return wrap(a.astype(rt))
    acc = acc_dtype(rt)
    if acc != rt:  # a running float16/bfloat16 total accumulates in float32
        return wrap(fn(a, axis=d, dtype=acc).astype(rt))
    return wrap(fn(a, axis=d, dtype=rt, out=out_buffer(a.shape, rt, a)))


def cumsum(input: Tensor, dim: int, *, dtype=None) -> Tensor:
    """Cumulative sum along ``dim`` (int64 for bool and integer inputs). **Local**.

    Returns
    -------
    Tensor
    """
    return _scan("cumsum", input, dim, dtype)


def cumprod(input: Tensor, dim: int, *, dtype=None) -> Tensor:
    """Cumulative product along ``dim`` (int64 for bool and integer inputs). **Local**.

    Returns
    -------
    Tensor
    """
    return _scan("cumprod", input, dim, dtype)


def count_nonzero(input: Tensor, dim=None) -> Tensor:
    """Number of non-zero elements over ``dim`` (int64). **Local**.

    Returns
    -------
    Tensor
    """
    a = as_array("count_nonzero", input)
    axes = norm_dims("count_nonzero", dim, a.ndim)
    xp = xp_of(a)
    return wrap(xp.asarray(xp.count_nonzero(a, axis=axes), dtype=INT64))

