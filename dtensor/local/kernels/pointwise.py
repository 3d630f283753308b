"""Elementwise local kernels: unary, binary (with broadcasting and python scalars), where,
clamp, lerp, addcmul/addcdiv and the erf-based activations, plus the python operators of
the binary ops.

Every op is a plain function (PyTorch's names and argument names) that takes Tensors and/or
python scalars and returns a Tensor; all are **Local**, and all accept ``out=`` (which the
in-place forms of :mod:`dtensor.local.kernels` use). An op's dtype handling follows PyTorch's type
promotion (see :func:`dtensor.local.kernels.base.result_type`). A spec object per op holds the
kernel and its dtype rules; one generic path serves every op of a family, and a short fast
path serves the common case (small tensors of one dtype, or a small tensor and a python
number). bfloat16 operands compute in float32 and round once on store (PyTorch's opmath,
:func:`~dtensor.local.kernels.base.opmath_dtype`); they take no short path. relu, erf and
gelu (and ``gelu_backward``, the fused gradient gelu's backward formula runs) run the
compiled loops of ``fastpath._kernels`` on contiguous float32/float64 host arrays when the compiled extension is enabled (their array-module
twins here serve everything else, and everything with ``DTENSOR_FASTPATH=0``).
"""

from __future__ import annotations

import math

import numpy as np

import fastpath as _fp
from placements.errors import ArgumentError, DTypeError, SignatureError
from placements.meta import dtype_kind, is_floating

from .. import allocator as _allocator
from ..tensor import Tensor, wrap_array
from .base import (
    BOOL,
    INT_RANGES,
    SCALAR_TYPES,
    OperandTypeError,
    TensorLike,
    as_array,
    broadcast_shapes,
    cast,
    cast_scalar,
    check_out,
    copy_to,
    float_dtype,
    new_array,
    operand,
    opmath_dtype,
    out_buffer,
    quiet_call,
    quiet_run,
    result_type,
    shape_of,
    store,
    tname,
    wrap,
    xp_of,
)

#: No dtype takes the short path (an operand type without a fast set).
NO_DTYPES: frozenset = frozenset()
#: Kinds of ops (UnarySpec, BinarySpec) in which numpy reports no floating-point error:
#: their short paths need not ignore them.
FP_ERROR_FREE = frozenset(("bool", "integral", "round", "compare", "logical", "bitwise"))
# Dtype sets of the kernels' short paths and dtype rules.
BOOLS = frozenset([BOOL])
INTS = frozenset(np.dtype(t) for t in "bBhHiIlLqQ")
FLOATS = frozenset(np.dtype(t) for t in (np.float16, np.float32, np.float64))
NUMERIC = INTS | FLOATS
REAL = NUMERIC | BOOLS


def fast_path_reference(fast: frozenset, limit: int, a, b=None) -> bool:
    """Whether an elementwise kernel takes its short path on arrays ``a`` (and ``b``): a
    dtype it takes as it is (``fast``), ``a`` not 0-d, and the operands below ``limit``
    bytes (the caller passes the allocator's pooling size), so that numpy allocates the
    output and the result is exactly the array module's. **Local**.

    The one statement of that condition: the local functions test it per call, and the
    dispatcher's compiled front decides its raw forms with it, once per cache entry, on
    stand-ins that carry the local shards' ``dtype``, ``ndim`` and ``nbytes``.
    :func:`fast_path` is its compiled twin when the extension is enabled, and
    :func:`short_binary` applies it to two arrays and runs the ufunc (the hot path of
    ``t + u`` then costs what the condition written inline cost).
    """
    if a.ndim == 0 or a.nbytes >= limit:
        return False
    if b is not None and b.nbytes >= limit:
        return False
    return a.dtype in fast


def short_binary_reference(ufunc, fast: frozenset, limit: int, a, b):
    """``ufunc(a, b)`` when two arrays of one dtype take the short path
    (:func:`fast_path_reference`), else None. **Local**."""
    if a.dtype is b.dtype and fast_path_reference(fast, limit, a, b):
        return ufunc(a, b)
    return None


if _fp.ENABLED:
    fast_path, short_binary = _fp.kernels.fast_path, _fp.kernels.short_binary
else:
    fast_path, short_binary = fast_path_reference, short_binary_reference


def _array_like(*operands):
    """First array among the operands (sets the device of the output)."""
    for x in operands:
        if not isinstance(x, SCALAR_TYPES):
            return x
    raise DTypeError("expected at least one Tensor argument, got only python scalars")


def _into(out, r):
    """``r`` written into ``out`` when an output buffer was given, else ``r``."""
    if out is None or r is out:
        return r
    xp_of(r).copyto(out, r)
    return out


# ----------------------------------------------------------------------------- unary


class UnarySpec:
    """One unary op: its kernel ``kernel(a, out)`` and its dtype rule.

    kind: ``"same"`` keeps the dtype; ``"float"`` computes integers and bools in the default
    float dtype; ``"floatonly"`` rejects them; ``"bool"`` returns bool; ``"integral"``
    accepts bool and integers only; ``"round"`` copies integers and bools unchanged.
    ``fast`` holds the dtypes the kernel takes directly; ``reject`` the dtype kinds refused.
    """

    __slots__ = ("fast", "hint", "kernel", "kind", "name", "reject")

    def __init__(self, name, kernel, kind, fast, reject="", hint=""):
        self.name, self.kernel, self.kind = name, kernel, kind
        self.fast, self.reject, self.hint = fast, reject, hint

    def compute(self, a, out):
        """The op on array ``a``; ``out`` is an ``out=`` Tensor or None. Returns an array.

        Runs with numpy's floating-point errors ignored (:func:`quiet_call`)."""
        return quiet_call(self._compute, a, out)

    def _compute(self, a, out):
        dt = a.dtype
        kind = self.kind
        dk = dtype_kind(dt)
        if dk in self.reject or (kind == "floatonly" and dk not in "fc") or (
            kind == "integral" and dk not in "biu"
        ):
            raise DTypeError(f"{self.name}: not supported for {tname(dt)} tensors{self.hint}")
        ct = float_dtype(dt) if kind == "float" else dt
        rt = BOOL if kind == "bool" else ct
        o = out_buffer(a.shape, rt, a) if out is None else check_out(self.name, out, a.shape, rt)
        if kind == "round" and dtype_kind(ct) in "biu":
            return copy_to(o, cast(a, ct))
        wt = opmath_dtype(ct)
        a = cast(a, wt)
        direct = wt == ct or rt == BOOL  # else computed in float32, rounded on store
        try:
            r = self.kernel(a, o if direct else None)
        except TypeError as exc:  # a dtype the array module has no loop for (e.g. complex)
            raise DTypeError(f"{self.name}: not supported for {tname(dt)} tensors") from exc
        return _into(o, r) if direct else store(o, r, rt)


def _unary_fn(spec: UnarySpec):
    """The public function of a unary spec: ``fn(input, *, out=None)``."""
    kernel, fast, name = spec.kernel, spec.fast, spec.name
    # its short path quietly (numpy's floating-point errors ignored) unless it returns bools
    # or rounds, which raise none
    quiet = spec.kind not in FP_ERROR_FREE

    def fn(input, *, out=None):
        if out is None:
            try:
                a = input._arr
            except AttributeError:
                pass
            else:
                if fast_path(fast, _allocator.POOL_MIN_BYTES, a):
                    if not quiet:
                        return wrap_array(kernel(a, None))
                    try:
                        return wrap_array(quiet_run(kernel, a, None))
                    except RuntimeError:  # another thread is in the shared quiet context
                        return wrap_array(quiet_call(kernel, a, None))
        r = spec.compute(as_array(name, input), out)
        return out if out is not None else wrap(r)

    fn.spec = spec
    fn.quiet = True
    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = f"""Elementwise ``{name}`` of a tensor. **Local**.

    Parameters
    ----------
    input : Tensor
    out : Tensor, optional
        Written in place (shape must match; the result dtype must be castable to it).

    Returns
    -------
    Tensor
    """
    return fn


def unary_function(
    name: str, kernel, kind: str, fast: frozenset, reject: str = "", hint: str = ""
):
    """The local function ``fn(input, *, out=None)`` of a unary elementwise op (its
    :class:`UnarySpec` is ``fn.spec``). **Local**."""
    return _unary_fn(UnarySpec(name, kernel, kind, fast, reject, hint))


def ufunc_kernel(ufunc):
    """The array kernel ``kernel(a, out)`` of a numpy/cupy ufunc. **Local**."""

    def kernel(a, out):
        return ufunc(a, out=out)

    return kernel


def rsqrt_kernel(a, out):
    xp = xp_of(a)
    r = xp.sqrt(a, out=out)
    return xp.reciprocal(r, out=r)


def sigmoid_kernel(a, out):
    # Stable for any x: exp(-|x|) never overflows; x >= 0: 1/(1+e), x < 0: e/(1+e).
    xp = xp_of(a)
    if a.dtype.kind == "c":
        e = xp.exp(-a)
        e += 1
        return xp.divide(a.dtype.type(1), e, out=out)
    e = xp.exp(-xp.abs(a))
    num = xp.where(a >= 0, a.dtype.type(1), e)
    e += 1
    return xp.divide(num, e, out=out)


def silu_kernel(a, out):
    return xp_of(a).multiply(a, sigmoid_kernel(a, None), out=out)


def relu_kernel(a, out):
    return xp_of(a).maximum(a, a.dtype.type(0), out=out)


def sign_kernel(a, out):
    # Note: sign(NaN) is NaN, as numpy gives it (PyTorch gives 0, an open PyTorch issue,
    # pytorch/pytorch#41245, that calls numpy's the expected answer).
    if a.dtype == BOOL:
        return copy_to(out, a)
    return xp_of(a).sign(a, out=out)


# --- erf: a vectorised, array-module-only implementation (numpy has no erf).
# |x| < 1: the Maclaurin series erf(x) = x * sum_n a_n x^(2n), a_n = 2/sqrt(pi) (-1)^n /
# (n! (2n+1)). |x| >= 1: erf(x) = 1 - exp(-x^2) g(x) with g = erfc * exp(x^2) (the scaled
# complementary error function), interpolated by a Chebyshev series in s = 1/|x| on
# [1/6, 1] (beyond |x| = 6, erfc < 2e-17). The Chebyshev coefficients are computed once, at
# import, from python's math.erfc. Each dtype keeps the terms its precision needs.
_S_LO, _S_HI = 1.0 / 6.0, 1.0
_CHEB_NODES = 48


def _erf_tables():
    series = [
        2.0 / math.sqrt(math.pi) * (-1) ** n / (math.factorial(n) * (2 * n + 1))
        for n in range(24)
    ]
    thetas = [math.pi * (j + 0.5) / _CHEB_NODES for j in range(_CHEB_NODES)]
    values = []
    for th in thetas:
        x = 1.0 / ((math.cos(th) + 1.0) / 2.0 * (_S_HI - _S_LO) + _S_LO)
        values.append(math.erfc(x) * math.exp(x * x))
    cheb = [
        2.0 / _CHEB_NODES * math.fsum(v * math.cos(k * th) for v, th in zip(values, thetas))
        for k in range(_CHEB_NODES)
    ]
    cheb[0] /= 2.0
    tables = {}
    for dtype, tol in ((np.dtype(np.float32), 1e-10), (np.dtype(np.float64), 1e-18)):
        n_series = next(i for i, c in enumerate(series) if math.fabs(c) < tol)
        n_cheb = max(i for i, c in enumerate(cheb) if math.fabs(c) >= tol) + 1
        tables[dtype] = (series[:n_series], cheb[:n_cheb])
    return tables


_ERF_TABLES = _erf_tables()


def erf_kernel(a, out):
    xp = xp_of(a)
    dt = a.dtype
    work = dt if dt in _ERF_TABLES else np.dtype(np.float32)  # float16 computes in float32
    series, cheb = _ERF_TABLES[work]
    one = work.type(1)
    x = a.astype(work, copy=False)
    ax = xp.abs(x)
    # Series branch (its input clipped to |x| <= 1; other elements are discarded).
    u = xp.minimum(ax, one)
    u *= u
    acc = xp.full_like(u, series[-1])
    for c in reversed(series[:-1]):
        acc *= u
        acc += work.type(c)
    acc *= x
    # Chebyshev branch on s = 1/|x| clipped to [1/6, 1].
    s = xp.divide(one, xp.maximum(ax, one))
    xp.maximum(s, work.type(_S_LO), out=s)
    t = (s - work.type((_S_HI + _S_LO) / 2)) * work.type(2 / (_S_HI - _S_LO))
    t2 = t + t
    b1 = xp.zeros_like(t)
    b2 = xp.zeros_like(t)
    for c in reversed(cheb[1:]):
        b1, b2 = t2 * b1 - b2 + work.type(c), b1
    g = t * b1 - b2 + work.type(cheb[0])
    big = xp.exp(-(ax * ax))
    big *= g
    xp.subtract(one, big, out=big)
    xp.copysign(big, x, out=big)
    r = xp.where(ax < one, acc, big)
    return _into(out, r.astype(dt, copy=False))


_SQRT1_2 = math.sqrt(0.5)
_SQRT_2_PI = math.sqrt(2.0 / math.pi)
_1_SQRT2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _gelu_erf(a, out):
    xp = xp_of(a)
    r = erf_kernel(a * a.dtype.type(_SQRT1_2), None)
    r += a.dtype.type(1)
    r *= a
    return xp.multiply(r, a.dtype.type(0.5), out=out)


def _gelu_tanh(a, out):
    xp = xp_of(a)
    one = a.dtype.type(1)
    inner = a * a
    inner *= a.dtype.type(0.044715)
    inner += one
    inner *= a
    inner *= a.dtype.type(_SQRT_2_PI)
    r = xp.tanh(inner, out=inner)
    r += one
    r *= a
    return xp.multiply(r, a.dtype.type(0.5), out=out)


def _compiled(kind: str, twin):
    """The compiled loop of ``kind`` falling back to ``twin``, or ``twin`` without it."""
    return _fp.kernels.Unary(kind, twin) if _fp.ENABLED else twin


relu_kernel = _compiled("relu", relu_kernel)
erf_kernel = _compiled("erf", erf_kernel)
_gelu_erf = _compiled("gelu", _gelu_erf)
_gelu_tanh = _compiled("gelu_tanh", _gelu_tanh)

_round0 = unary_function("round", ufunc_kernel(np.rint), "round", FLOATS)


def round(input: Tensor, *, decimals: int = 0, out=None) -> Tensor:
    """Round to the nearest integer (ties to even), or to ``decimals`` decimal places.

    **Local.** Integer and bool tensors are returned as copies (``decimals=0``).

    Parameters
    ----------
    input : Tensor
    decimals : int, optional
        Number of decimal places; floating tensors only when non-zero.
    out : Tensor, optional

    Returns
    -------
    Tensor
    """
    if decimals == 0:
        return _round0(input, out=out)
    a = as_array("round", input)
    dt = a.dtype
    if not is_floating(dt):
        raise DTypeError(f"round: decimals={decimals} is not supported for {tname(dt)} "
                         "tensors")
    o = out_buffer(a.shape, dt, a) if out is None else check_out("round", out, a.shape, dt)
    wt = opmath_dtype(dt)
    r = store(o, xp_of(a).round(cast(a, wt), decimals, out=o if wt == dt else None), dt)
    return out if out is not None else wrap(r)


def gelu(input: Tensor, approximate: str = "none", *, out=None) -> Tensor:
    """Gaussian error linear unit ``x * Phi(x)``. **Local**.

    Parameters
    ----------
    input : Tensor
        Floating tensor.
    approximate : {'none', 'tanh'}
        ``'none'``: ``0.5 x (1 + erf(x / sqrt(2)))``; ``'tanh'``: PyTorch's tanh
        approximation ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``.
    out : Tensor, optional

    Returns
    -------
    Tensor
    """
    fn = _GELU.get(approximate)
    if fn is None:
        raise ArgumentError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return fn(input, out=out)


# the unary functions of the two forms (with the short path of small arrays)
_GELU = {
    "none": unary_function("gelu", _gelu_erf, "floatonly", FLOATS),
    "tanh": unary_function("gelu", _gelu_tanh, "floatonly", FLOATS),
}


def _gelu_backward_twin(g, a, tanh_form: bool):
    """The array-module twin of ``fastpath._kernels.gelu_backward``: the gradient formula in
    separate array passes (float16/bfloat16 compute in float32)."""
    xp = xp_of(a)
    work = opmath_dtype(a.dtype)
    x = a.astype(work, copy=False)
    half = work.type(0.5)
    if tanh_form:
        k = work.type(_SQRT_2_PI)
        x2 = x * x
        inner = x2 * work.type(0.044715)
        inner += work.type(1)
        inner *= x
        inner *= k
        t = xp.tanh(inner, out=inner)
        d = t * t
        xp.subtract(work.type(1), d, out=d)
        d *= k
        d *= x2 * work.type(3 * 0.044715) + work.type(1)
        d *= x
        d *= half
        t += work.type(1)
        t *= half
        t += d
        r = t
    else:
        r = erf_kernel(x * work.type(_SQRT1_2), None)
        r += work.type(1)
        r *= half
        pdf = x * x
        pdf *= work.type(-0.5)
        xp.exp(pdf, out=pdf)
        pdf *= work.type(_1_SQRT2PI)
        pdf *= x
        r += pdf
    r *= g.astype(work, copy=False)
    return r.astype(a.dtype, copy=False)


def gelu_backward(grad: Tensor, input: Tensor, approximate: str = "none") -> Tensor:
    """The gradient of :func:`gelu` at ``input`` times ``grad`` (of ``input``'s shape), in
    ``input``'s dtype: PyTorch's ``aten::gelu_backward``. **Local**.

    A contiguous float32/float64 host pair of one dtype runs one compiled pass with the
    extension enabled (``fastpath._kernels.gelu_backward``); everything else (strides,
    other dtypes, cupy arrays, ``DTENSOR_FASTPATH=0``) the array-module twin, which computes
    the same terms in separate passes.
    """
    if approximate not in _GELU:
        raise ArgumentError(
            f"gelu_backward: approximate must be 'none' or 'tanh', got {approximate!r}")
    g = as_array("gelu_backward", grad)
    a = as_array("gelu_backward", input)
    for name, arr in (("grad", g), ("input", a)):
        if not is_floating(arr.dtype):
            raise DTypeError(f"gelu_backward: {name} must be floating, got {tname(arr.dtype)}")
    if g.shape != a.shape:
        raise ArgumentError(f"gelu_backward: grad of shape {list(g.shape)} does not match "
                            f"input of shape {list(a.shape)}")
    tanh_form = approximate == "tanh"
    if _fp.ENABLED:
        r = _fp.kernels.gelu_backward(g, a, tanh_form, out_buffer)
        if r is not None:
            return wrap_array(r)
    return wrap(_gelu_backward_twin(g, a, tanh_form))


def softplus(
    input: Tensor, beta: float = 1.0, threshold: float = 20.0, *, out=None
) -> Tensor:
    """``log(1 + exp(beta x)) / beta``, and ``x`` itself where ``beta x > threshold``.

    **Local.** Floating tensors only (as in PyTorch).

    Returns
    -------
    Tensor
    """

    def kernel(a, o):
        xp = xp_of(a)
        bx = a * a.dtype.type(beta)
        # exp of the clipped value: no overflow where x itself is returned.
        r = xp.log1p(xp.exp(xp.minimum(bx, a.dtype.type(threshold))))
        r /= a.dtype.type(beta)
        xp.copyto(r, a, where=bx > threshold)
        return r

    r = UnarySpec("softplus", kernel, "floatonly", FLOATS).compute(as_array("softplus", input), out)
    return out if out is not None else wrap(r)


def leaky_relu(input: Tensor, negative_slope: float = 0.01, *, out=None) -> Tensor:
    """``x`` where ``x > 0``, else ``negative_slope * x``. **Local**. Floating tensors only.

    Returns
    -------
    Tensor
    """

    def kernel(a, o):
        return xp_of(a).where(a > 0, a, a * a.dtype.type(negative_slope))

    r = UnarySpec("leaky_relu", kernel, "floatonly", FLOATS).compute(
        as_array("leaky_relu", input), out
    )
    return out if out is not None else wrap(r)


def square(input: Tensor, *, out=None) -> Tensor:
    """``input ** 2`` (bool squares to int64, as ``pow(bool, 2)`` does). **Local**."""
    return pow(input, 2, out=out)


def positive(input: Tensor) -> Tensor:
    """``input`` itself (``+t``); bool tensors are refused, as in PyTorch. **Local**."""
    a = as_array("positive", input)
    if a.dtype == BOOL:
        raise DTypeError("positive: the `+` operator on a bool tensor is not supported")
    return input


# ----------------------------------------------------------------------------- binary


def _check_int_divisor(name, a, b, ct):
    # Note: PyTorch raises on integer division by zero (numpy silently returns 0); we
    # raise ZeroDivisionError, before anything is written.
    if ct.kind in "iu" and not xp_of(b).all(b):
        raise ZeroDivisionError(f"{name}: integer division by zero")


def _check_int_power(name, a, b, ct):
    if ct.kind in "iu" and xp_of(b).any(b < 0):
        raise DTypeError(f"{name}: integers to negative integer powers are not allowed")


class BinarySpec:
    """One binary op: its kernel ``kernel(a, b, out)`` and its dtype rule.

    kind: ``"arith"`` computes in the promoted dtype; ``"float"`` also turns an integral
    promoted dtype into the default float dtype (true division); ``"compare"`` computes in
    the promoted dtype and returns bool; ``"logical"`` returns bool from any dtypes;
    ``"bitwise"`` accepts bool and integers only. ``fast`` holds the dtypes for which the
    kernel on two same-dtype arrays gives PyTorch's result; ``reject`` the dtype kinds
    refused; ``check(name, a, b, ct)`` validates values before anything is written.
    """

    __slots__ = ("check", "fast", "kernel", "kind", "name", "reject", "scalar_fast")

    def __init__(self, name, kernel, kind, fast, reject="", check=None):
        self.name, self.kernel, self.kind = name, kernel, kind
        self.fast, self.reject, self.check = fast, reject, check
        # With a python scalar operand: ints keep any integer or floating dtype, floats any
        # floating dtype (weak scalars: numpy and PyTorch agree there).
        self.scalar_fast = {int: fast - BOOLS, float: fast & FLOATS}

    def dtypes(self, x, y):
        """(computation dtype, result dtype) of the op on operands ``x`` and ``y``."""
        ct = result_type(x, y)
        kind = self.kind
        if kind == "float":
            ct = float_dtype(ct)
        dk = dtype_kind(ct)
        if dk in self.reject or (kind == "bitwise" and dk not in "biu"):
            raise DTypeError(f"{self.name}: not supported for {tname(ct)} tensors")
        return ct, (BOOL if kind in ("compare", "logical") else ct)

    def compute(self, x, y, out, alpha=None):
        """The op on operands (arrays or python scalars); ``out`` is a Tensor or None;
        ``alpha`` (add and sub) multiplies ``y`` in the computation dtype first.

        Runs with numpy's floating-point errors ignored (:func:`quiet_call`)."""
        return quiet_call(self._compute, x, y, out, alpha)

    def _compute(self, x, y, out, alpha):
        like = _array_like(x, y)
        ct, rt = self.dtypes(x, y)
        shape = broadcast_shapes(self.name, shape_of(x), shape_of(y))
        wt = opmath_dtype(ct)
        if self.kind != "logical" or wt != ct:
            x, y = cast(x, wt, self.name), cast(y, wt, self.name)
        if alpha is not None:
            _check_alpha(self.name, ct, alpha)
            y = y * cast_scalar(alpha, wt, self.name)
        if self.check is not None:
            self.check(self.name, x, y, ct)
        o = out_buffer(shape, rt, like) if out is None else check_out(self.name, out, shape, rt)
        direct = wt == ct or rt == BOOL  # else computed in float32, rounded on store
        try:
            r = self.kernel(x, y, o if direct else None)
        except TypeError as exc:  # a dtype the array module has no loop for (e.g. complex)
            raise DTypeError(f"{self.name}: not supported for {tname(ct)} tensors") from exc
        return _into(o, r) if direct else store(o, r, rt)


def _ufunc2(ufunc):
    def kernel(a, b, out):
        return ufunc(a, b, out=out)

    kernel.ufunc = ufunc
    return kernel


def _short_binary_quietly(uf, fast, a, b):
    """``short_binary`` through :func:`quiet_call` (when another thread is in the shared
    quiet context), None for shapes that do not broadcast."""
    try:
        return quiet_call(short_binary, uf, fast, _allocator.POOL_MIN_BYTES, a, b)
    except ValueError:
        return None


def _binary_fns(spec: BinarySpec):
    """(function, operator, reflected operator) of a binary spec.

    The function raises on unsupported operands; the operators return NotImplemented so
    that python tries the other operand (a DTensor, for instance).
    """
    uf, fast, name = getattr(spec.kernel, "ufunc", None), spec.fast, spec.name
    scalar_fast_dtypes = spec.scalar_fast

    # Note: numpy 2 compares an integer array with a python int it cannot hold exactly
    # (uint8 < -1 is False), where the other ufuncs raise OverflowError; PyTorch wraps the
    # int like a C cast (-1 is 255: True), as the slow path does (cast_scalar). Such an int
    # takes the slow path; one in range costs a range check (0..127 fits every dtype).
    bounded = spec.kind == "compare"
    # the short paths quietly (numpy's floating-point errors ignored) unless the op compares
    # or works on bits, which raise none
    quiet = spec.kind not in FP_ERROR_FREE

    def scalar_fast(a, s, swap):
        """The op on a small array and a python int/float, or None for the slow path."""
        if fast_path(scalar_fast_dtypes.get(type(s), NO_DTYPES), _allocator.POOL_MIN_BYTES, a):
            if bounded and type(s) is int and not 0 <= s <= 127:
                bounds = INT_RANGES.get(a.dtype)
                if bounds is not None and not bounds[0] <= s <= bounds[1]:
                    return None
            try:
                if not quiet:
                    return wrap_array(uf(s, a) if swap else uf(a, s))
                try:
                    return wrap_array(quiet_run(uf, s, a) if swap else quiet_run(uf, a, s))
                except RuntimeError:  # another thread is in the shared quiet context
                    return wrap_array(quiet_call(uf, s, a) if swap else quiet_call(uf, a, s))
            except OverflowError:  # an int that does not fit: the slow path wraps it
                return None
        return None

    # The tensor-tensor short path of ``fn`` and ``op`` (the hot path of ``a + b``): same
    # dtype (one PyTorch and numpy agree on) and :func:`fast_path` on both inputs.
    # (Only an output larger than both inputs, an outer broadcast of two small tensors, can
    # then exceed the pooling threshold without coming from the caching allocator.)
    def fn(input, other, *, out=None):
        if out is None:
            try:
                a = input._arr
            except AttributeError:
                pass
            else:
                try:
                    b = other._arr
                except AttributeError:
                    r = scalar_fast(a, other, False)
                    if r is not None:
                        return r
                else:
                    try:
                        r = (
                            quiet_run(short_binary, uf, fast, _allocator.POOL_MIN_BYTES, a, b)
                            if quiet
                            else short_binary(uf, fast, _allocator.POOL_MIN_BYTES, a, b)
                        )
                    except RuntimeError:  # another thread is in the shared quiet context
                        r = _short_binary_quietly(uf, fast, a, b)
                    except ValueError:  # shapes that do not broadcast: the slow path
                        r = None        # raises the error
                    if r is not None:
                        return wrap_array(r)
        r = spec.compute(operand(name, input), operand(name, other), out)
        return out if out is not None else wrap(r)

    def op(self, other):
        a = self._arr
        try:
            b = other._arr
        except AttributeError:
            r = scalar_fast(a, other, False)
            if r is not None:
                return r
            try:
                y = operand(name, other)
            except OperandTypeError:
                return NotImplemented
            return wrap(spec.compute(a, y, None))
        try:
            r = (
                quiet_run(short_binary, uf, fast, _allocator.POOL_MIN_BYTES, a, b)
                if quiet
                else short_binary(uf, fast, _allocator.POOL_MIN_BYTES, a, b)
            )
        except RuntimeError:
            r = _short_binary_quietly(uf, fast, a, b)
        except ValueError:
            r = None
        if r is not None:
            return wrap_array(r)
        return wrap(spec.compute(a, b, None))

    def rop(self, other):
        a = self._arr
        r = scalar_fast(a, other, True)
        if r is not None:
            return r
        try:
            y = operand(name, other)
        except OperandTypeError:
            return NotImplemented
        return wrap(spec.compute(y, a, None))

    fn.spec = spec
    fn.quiet = op.quiet = rop.quiet = True
    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = f"""Elementwise ``{name}`` with broadcasting. **Local**.

    Parameters
    ----------
    input, other : Tensor or python scalar
        At least one is a Tensor. Dtypes promote as in PyTorch (python scalars are weak).
    out : Tensor, optional
        Written in place (shape must be the broadcast shape; the result dtype must be
        castable to its dtype).

    Returns
    -------
    Tensor
    """
    return fn, op, rop


def _trunc_div(a, b, out):
    xp = xp_of(a, b)
    if a.dtype.kind in "fc":
        r = xp.divide(a, b, out=out)
        return xp.trunc(r, out=r)
    # Integers: floor division, moved one toward zero where the signs differ and the
    # division is inexact (computed before ``out``, which may alias ``a``, is written).
    fix = xp.logical_and(xp.remainder(a, b) != 0, (a < 0) != (b < 0))
    q = xp.floor_divide(a, b, out=out)
    return xp.add(q, fix, out=q, casting="unsafe")


_BINARY_SPECS = {
    "add": BinarySpec("add", _ufunc2(np.add), "arith", REAL),
    "sub": BinarySpec("sub", _ufunc2(np.subtract), "arith", NUMERIC, "b"),
    "mul": BinarySpec("mul", _ufunc2(np.multiply), "arith", REAL),
    "true_divide": BinarySpec("div", _ufunc2(np.true_divide), "float", FLOATS),
    "trunc_divide": BinarySpec("div", _trunc_div, "arith", frozenset(), "bc", _check_int_divisor),
    "floor_divide": BinarySpec(
        "floor_divide", _ufunc2(np.floor_divide), "arith", FLOATS, "bc", _check_int_divisor
    ),
    "remainder": BinarySpec(
        "remainder", _ufunc2(np.remainder), "arith", FLOATS, "bc", _check_int_divisor
    ),
    "fmod": BinarySpec("fmod", _ufunc2(np.fmod), "arith", FLOATS, "bc", _check_int_divisor),
    "pow": BinarySpec("pow", _ufunc2(np.power), "arith", FLOATS, "b", _check_int_power),
    # Ordering ops refuse complex (PyTorch does; numpy orders complex lexicographically).
    "maximum": BinarySpec("maximum", _ufunc2(np.maximum), "arith", REAL, "c"),
    "minimum": BinarySpec("minimum", _ufunc2(np.minimum), "arith", REAL, "c"),
    "atan2": BinarySpec("atan2", _ufunc2(np.arctan2), "float", FLOATS, "c"),
    "eq": BinarySpec("eq", _ufunc2(np.equal), "compare", REAL),
    "ne": BinarySpec("ne", _ufunc2(np.not_equal), "compare", REAL),
    "lt": BinarySpec("lt", _ufunc2(np.less), "compare", REAL, "c"),
    "le": BinarySpec("le", _ufunc2(np.less_equal), "compare", REAL, "c"),
    "gt": BinarySpec("gt", _ufunc2(np.greater), "compare", REAL, "c"),
    "ge": BinarySpec("ge", _ufunc2(np.greater_equal), "compare", REAL, "c"),
    "logical_and": BinarySpec("logical_and", _ufunc2(np.logical_and), "logical", REAL),
    "logical_or": BinarySpec("logical_or", _ufunc2(np.logical_or), "logical", REAL),
    "logical_xor": BinarySpec("logical_xor", _ufunc2(np.logical_xor), "logical", REAL),
    "bitwise_and": BinarySpec("bitwise_and", _ufunc2(np.bitwise_and), "bitwise", INTS | BOOLS),
    "bitwise_or": BinarySpec("bitwise_or", _ufunc2(np.bitwise_or), "bitwise", INTS | BOOLS),
    "bitwise_xor": BinarySpec("bitwise_xor", _ufunc2(np.bitwise_xor), "bitwise", INTS | BOOLS),
}

_FNS = {key: _binary_fns(spec) for key, spec in _BINARY_SPECS.items()}
#: The python operators of the binary ops: op name -> (operator, reflected operator).
OPERATORS = {
    ("div" if key == "true_divide" else key): fns[1:]
    for key, fns in _FNS.items() if key != "trunc_divide"
}
_add, _sub, _true_div, _trunc_div_fn = (
    _FNS[k][0] for k in ("add", "sub", "true_divide", "trunc_divide")
)
mul, floor_divide, remainder, fmod, pow, maximum, minimum, atan2 = (
    _FNS[k][0]
    for k in ("mul", "floor_divide", "remainder", "fmod", "pow", "maximum", "minimum", "atan2")
)
eq, ne, lt, le, gt, ge = (_FNS[k][0] for k in ("eq", "ne", "lt", "le", "gt", "ge"))
logical_and, logical_or, logical_xor, bitwise_and, bitwise_or, bitwise_xor = (
    _FNS[k][0]
    for k in ("logical_and", "logical_or", "logical_xor", "bitwise_and", "bitwise_or",
              "bitwise_xor")
)


def _check_alpha(name, ct, alpha, what="alpha"):
    """PyTorch's rules for the ``alpha``/``value`` scalar of an op computing in ``ct``."""
    if ct.kind in "iu" and isinstance(alpha, (float, complex, np.inexact)):
        raise DTypeError(
            f"{name}: for integral input tensors, argument {what} must not be a floating "
            "point number"
        )
    if ct.kind == "b" and not isinstance(alpha, (bool, np.bool_)):
        raise DTypeError(f"{name}: boolean {what} only supported for Boolean results")


def _with_alpha(op: str, input: TensorLike, other: TensorLike, alpha, out) -> Tensor:
    """``input op alpha * other`` for add/sub with an ``alpha`` other than 1 (quietly)."""
    x, y = operand(op, input), operand(op, other)
    r = _BINARY_SPECS[op].compute(x, y, out, alpha)
    return out if out is not None else wrap(r)


def add(input: TensorLike, other: TensorLike, *, alpha=1, out=None) -> Tensor:
    """``input + alpha * other`` with broadcasting. **Local**.

    Parameters
    ----------
    input, other : Tensor or python scalar
        At least one is a Tensor. Dtypes promote as in PyTorch (python scalars are weak:
        float32 tensor + 2.5 is float32; int64 tensor + 2.5 is the default float dtype).
    alpha : python scalar, optional
        Multiplier of ``other`` (an int for integral results, a bool for bool results).
    out : Tensor, optional

    Returns
    -------
    Tensor
    """
    if alpha == 1 and not isinstance(alpha, bool):
        return _add(input, other, out=out)
    return _with_alpha("add", input, other, alpha, out)


def sub(input: TensorLike, other: TensorLike, *, alpha=1, out=None) -> Tensor:
    """``input - alpha * other`` with broadcasting (not for bool tensors). **Local**.

    Parameters
    ----------
    input, other : Tensor or python scalar
    alpha : python scalar, optional
    out : Tensor, optional

    Returns
    -------
    Tensor
    """
    if alpha == 1 and not isinstance(alpha, bool):
        return _sub(input, other, out=out)
    return _with_alpha("sub", input, other, alpha, out)


# With alpha=1, add and sub compute their spec's op (the dispatcher's raw forms read it).
add.spec = _BINARY_SPECS["add"]
sub.spec = _BINARY_SPECS["sub"]


def div(input: TensorLike, other: TensorLike, *, rounding_mode=None, out=None) -> Tensor:
    """Division with broadcasting. **Local**.

    Parameters
    ----------
    input, other : Tensor or python scalar
    rounding_mode : {None, 'trunc', 'floor'}
        None: true division (integer inputs give the default float dtype, as in PyTorch);
        ``'trunc'``: rounded toward zero; ``'floor'``: rounded down (integers stay integers).
    out : Tensor, optional

    Returns
    -------
    Tensor

    Raises
    ------
    ZeroDivisionError
        For an integer division (``'trunc'``/``'floor'``) by zero.
    """
    # Note: true division of integer tensors gives the default float dtype (float32), as
    # in PyTorch; numpy gives float64.
    if rounding_mode is None:
        return _true_div(input, other, out=out)
    if rounding_mode == "trunc":
        return _trunc_div_fn(input, other, out=out)
    if rounding_mode == "floor":
        return floor_divide(input, other, out=out)
    raise ArgumentError(
        f"div: expected rounding_mode to be one of None, 'trunc', or 'floor' but found "
        f"{rounding_mode!r}"
    )


# These compute through the quiet paths of the binary ops (or not at all): they need no
# wrapper (base.quiet_function).
add.quiet = sub.quiet = div.quiet = square.quiet = positive.quiet = True


# ---------------------------------------------------------------------------- ternary


def where(condition: Tensor, input: TensorLike, other: TensorLike) -> Tensor:
    """Elements of ``input`` where ``condition`` holds, else of ``other``. **Local**.

    Parameters
    ----------
    condition : Tensor
        Bool tensor.
    input, other : Tensor or python scalar
        Promoted together as in PyTorch.

    Returns
    -------
    Tensor
        Of the broadcast shape of the three arguments.
    """
    c = operand("where", condition)
    if isinstance(c, SCALAR_TYPES) or c.dtype != BOOL:
        raise DTypeError(
            "where: expected condition to be a boolean tensor, but got "
            + (f"a tensor with dtype {tname(c.dtype)}" if not isinstance(c, SCALAR_TYPES)
               else type(c).__name__)
        )
    x, y = operand("where", input), operand("where", other)
    ct = result_type(x, y)
    shape = broadcast_shapes("where", c.shape, shape_of(x), shape_of(y))
    xp = xp_of(c)
    o = new_array(shape, ct, c)
    xp.copyto(o, cast(y, ct))
    xp.copyto(o, cast(x, ct), where=c)
    return wrap(o)


def clamp(
    input: Tensor, min: TensorLike | None = None, max: TensorLike | None = None, *, out=None
) -> Tensor:
    """Clamp to ``[min, max]``: ``minimum(maximum(input, min), max)``. **Local**.

    Parameters
    ----------
    input : Tensor
    min, max : Tensor or python scalar, optional
        At least one is given. Dtypes promote as in PyTorch (an int tensor clamped by a
        python float gives the default float dtype). NaN propagates.
    out : Tensor, optional

    Returns
    -------
    Tensor
    """
    if min is None and max is None:
        raise SignatureError("clamp: at least one of 'min' or 'max' must not be None")
    a = as_array("clamp", input)
    bounds = [operand("clamp", v) for v in (min, max) if v is not None]
    ct = result_type(a, *bounds)
    if ct == BOOL:
        raise DTypeError("clamp: not supported for Bool tensors")
    shape = broadcast_shapes("clamp", a.shape, *(shape_of(v) for v in bounds))
    wt = opmath_dtype(ct)
    lo = None if min is None else cast(operand("clamp", min), wt, "clamp")
    hi = None if max is None else cast(operand("clamp", max), wt, "clamp")
    o = out_buffer(shape, ct, a) if out is None else check_out("clamp", out, shape, ct)
    r = store(o, xp_of(a).clip(cast(a, wt), lo, hi, out=o if wt == ct else None), ct)
    return out if out is not None else wrap(r)


clip = clamp


def lerp(input: Tensor, end: TensorLike, weight: TensorLike, *, out=None) -> Tensor:
    """Linear interpolation ``input + weight * (end - input)``. **Local**.

    Computed as PyTorch does: from ``input`` for ``|weight| < 0.5``, else from ``end``
    (``end - (end - input) * (1 - weight)``), so that ``weight == 1`` gives ``end`` exactly.

    Parameters
    ----------
    input, end : Tensor
        Floating tensors.
    weight : Tensor or python float

    Returns
    -------
    Tensor
    """
    x, e, w = as_array("lerp", input), as_array("lerp", end), operand("lerp", weight)
    if dtype_kind(x.dtype) not in "fc":
        raise DTypeError(f"lerp: expected a floating point input, got {tname(x.dtype)}")
    ct = result_type(x, e, w)
    shape = broadcast_shapes("lerp", shape_of(x), shape_of(e), shape_of(w))
    wt = opmath_dtype(ct)
    x, e, w = cast(x, wt), cast(e, wt), cast(w, wt)
    o = out_buffer(shape, ct, x) if out is None else check_out("lerp", out, shape, ct)
    xp = xp_of(x, e)
    d = e - x
    r = store(o, xp.where(xp.abs(w) < 0.5, x + w * d, e - d * (wt.type(1) - w)), ct)
    return out if out is not None else wrap(r)


def _addc(name, input, tensor1, tensor2, value, out, divide):
    x, t1, t2 = (operand(name, v) for v in (input, tensor1, tensor2))
    ct = result_type(x, t1, t2)
    if divide and ct.kind in "biu":
        raise DTypeError(
            f"{name}: integer division is not supported; use a floating dtype for "
            "tensor1 and tensor2"
        )
    shape = broadcast_shapes(name, shape_of(x), shape_of(t1), shape_of(t2))
    wt = opmath_dtype(ct)
    x, t1, t2 = cast(x, wt), cast(t1, wt), cast(t2, wt)
    xp = xp_of(x, t1, t2)
    p = xp.divide(t1, t2) if divide else xp.multiply(t1, t2)
    if value != 1 or isinstance(value, bool):
        _check_alpha(name, ct, value, "value")
        p = p * cast_scalar(value, wt, name)
    o = out_buffer(shape, ct, x) if out is None else check_out(name, out, shape, ct)
    r = store(o, xp.add(x, p, out=o if wt == ct else None), ct)
    return out if out is not None else wrap(r)


def addcmul(
    input: Tensor, tensor1: TensorLike, tensor2: TensorLike, *, value=1, out=None
) -> Tensor:
    """``input + value * tensor1 * tensor2`` with broadcasting. **Local**.

    Returns
    -------
    Tensor
    """
    return _addc("addcmul", input, tensor1, tensor2, value, out, divide=False)


def addcdiv(
    input: Tensor, tensor1: TensorLike, tensor2: TensorLike, *, value=1, out=None
) -> Tensor:
    """``input + value * tensor1 / tensor2`` with broadcasting (floating only). **Local**.

    Returns
    -------
    Tensor
    """
    return _addc("addcdiv", input, tensor1, tensor2, value, out, divide=True)
