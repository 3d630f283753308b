"""Records of the elementwise ops: unary, binary, ternary, and their in-place forms, with
their backward formulas.

A unary op is one :func:`unary` line: its name, the array kernel, its dtype rule, the dtypes
the kernel takes as they are, how its sharding rule treats Partial inputs, whether it has an
in-place form, and its gradient; that line makes the local function, the in-place kernel,
the rule, the op records and the backward formula. Binary ops are declared over the local
kernels of :mod:`dtensor.local.kernels.pointwise` (which other kernels use too).
"""

from __future__ import annotations

import inspect
import math

import numpy as np

from placements.errors import SignatureError
from placements.rules.pointwise import unary_rule

from ..local import kernels as K
from ..local.grad_engine import is_grad_enabled
from ..local.kernels import pointwise as pw
from ..local.kernels.pointwise import BOOLS, FLOATS, INTS, NUMERIC, REAL
from ._grad import is_tensor, scaled
from .table import NOT_DIFFERENTIABLE, Backward, Operator, declare

__all__ = ["elementwise_grad", "unary"]


def elementwise_grad(grad) -> Backward:
    """The backward formula of a one-input elementwise op from its gradient ``grad``.
    **Local**.

    ``grad``'s parameters say what it reads: the output's gradient ``g`` first, then ``x``
    (the input) and/or ``out`` (the output), in that order; the node keeps (saves) exactly
    those. ``lambda g: -g``, ``lambda g, x: g / x``, ``lambda g, out: g * out``. A
    :class:`Backward` (:data:`NOT_DIFFERENTIABLE`) is returned as it is.

    Raises
    ------
    SignatureError
        For other parameters.
    """
    if isinstance(grad, Backward):
        return grad
    reads = tuple(inspect.signature(grad).parameters)
    if reads == ("g",):
        return Backward(lambda g, v, o, n, fns: (grad(g),))
    if reads == ("g", "x"):
        return Backward(lambda g, v, o, n, fns: (grad(g, v[0]),), ("input",))
    if reads == ("g", "out"):
        return Backward(lambda g, v, o, n, fns: (grad(g, o),), out=True)
    if reads == ("g", "x", "out"):
        return Backward(lambda g, v, o, n, fns: (grad(g, v[0], o),), ("input",), out=True)
    raise SignatureError(
        f"op table: a unary gradient takes (g), (g, x), (g, out) or (g, x, out), not {reads}"
    )


def unary(
    name: str,
    kernel,
    kind: str,
    fast: frozenset,
    partials: str = "none",
    *,
    grad,
    reject: str = "",
    hint: str = "",
    inplace: bool = False,
    method: bool = True,
    operator: str | None = None,
    aliases: tuple[str, ...] = (),
):
    """Declare the unary elementwise op ``name``. **Local**.

    Parameters
    ----------
    name : str
    kernel : callable or numpy ufunc
        ``kernel(a, out)`` on arrays, or a ufunc (then ``ufunc(a, out=out)``).
    kind : str
        The dtype rule (:class:`dtensor.local.kernels.pointwise.UnarySpec`): ``"same"``,
        ``"float"``, ``"floatonly"``, ``"bool"``, ``"integral"`` or ``"round"``.
    fast : frozenset of dtype
        The dtypes the kernel takes as they are (its short path).
    partials : str
        How its sharding rule maps Partial inputs (a key of
        :data:`placements.rules.pointwise.UNARY_PARTIALS`: ``"monotone"``, ``"none"``...).
    grad : callable or Backward
        Its gradient, written with tensor ops: a function of the output's gradient ``g``
        and what it reads, ``x`` (the input) and/or ``out`` (the output), named by its
        parameters (:func:`elementwise_grad`): ``grad=lambda g, out: g * out`` for ``exp``;
        or :data:`NOT_DIFFERENTIABLE`.
    reject, hint : str
        Dtype kinds refused, and a hint added to that error.
    inplace : bool
        Also declare ``name_``.
    method : bool
        Give Tensor and DTensor a method ``name`` (PyTorch has no ``Tensor.gelu``...).
    operator : str, optional
        The unary python operator it serves (``"__neg__"``).
    aliases : tuple of str
        Other method names.
    """
    if isinstance(kernel, np.ufunc):
        kernel = pw.ufunc_kernel(kernel)
    fn = pw.unary_function(name, kernel, kind, fast, reject, hint)
    ops = (Operator(operator, "unary", fn),) if operator else ()
    return declare(
        name, fn, rule=unary_rule(kind, partials), method=method, aliases=aliases,
        operators=ops, inplace=K.inplace_form(fn) if inplace else None, samples="unary",
        backward=elementwise_grad(grad),
    )


def _silu_grad(g, x):
    s = x.sigmoid()
    return g * s * (x * (1.0 - s) + 1.0)


def _zero(g):
    return g * 0.0


_LN2, _LN10 = math.log(2.0), math.log(10.0)
_2_SQRTPI = 2.0 / math.sqrt(math.pi)
_SQRT1_2 = 1.0 / math.sqrt(2.0)
_1_SQRT2PI = 1.0 / math.sqrt(2.0 * math.pi)

# the dtypes a kernel takes as they are (its short path): FLOATS, NUMERIC (ints and floats),
# REAL (numeric and bool), INTS, BOOLS

# -- unary ---------------------------------------------------------------------------------
unary("neg", np.negative, "same", NUMERIC, "linear", reject="b", operator="__neg__", inplace=True,
      aliases=("negative",), hint=" (use ~ or logical_not() to invert a mask)",
      grad=lambda g: -g)
unary("abs", np.absolute, "same", NUMERIC, reject="b", operator="__abs__", inplace=True,
      grad=lambda g, x: g * x.sign())
unary("exp", np.exp, "float", FLOATS, "monotone", inplace=True, grad=lambda g, out: g * out)
unary("expm1", np.expm1, "float", FLOATS, "monotone", inplace=True,
      grad=lambda g, out: g * (out + 1.0))
unary("log", np.log, "float", FLOATS, inplace=True, grad=lambda g, x: g / x)
unary("log1p", np.log1p, "float", FLOATS, inplace=True, grad=lambda g, x: g / (x + 1.0))
unary("log2", np.log2, "float", FLOATS, inplace=True, grad=lambda g, x: g / (x * _LN2))
unary("log10", np.log10, "float", FLOATS, inplace=True, grad=lambda g, x: g / (x * _LN10))
unary("sqrt", np.sqrt, "float", FLOATS, inplace=True, grad=lambda g, out: g * 0.5 / out)
unary("rsqrt", pw.rsqrt_kernel, "float", FLOATS, inplace=True,
      grad=lambda g, out: g * (out * out * out) * -0.5)
unary("sin", np.sin, "float", FLOATS, inplace=True, grad=lambda g, x: g * x.cos())
unary("cos", np.cos, "float", FLOATS, inplace=True, grad=lambda g, x: -(g * x.sin()))
unary("tan", np.tan, "float", FLOATS, inplace=True, grad=lambda g, out: g * (out * out + 1.0))
unary("tanh", np.tanh, "float", FLOATS, "monotone", inplace=True,
      grad=lambda g, out: g * (1.0 - out * out))
unary("sigmoid", pw.sigmoid_kernel, "float", FLOATS, "monotone", inplace=True,
      grad=lambda g, out: g * out * (1.0 - out))
unary("erf", pw.erf_kernel, "float", FLOATS, "monotone", inplace=True,
      grad=lambda g, x: g * _2_SQRTPI * (-(x * x)).exp())
unary("reciprocal", np.reciprocal, "float", FLOATS, inplace=True,
      grad=lambda g, out: -(g * out * out))
unary("relu", pw.relu_kernel, "same", NUMERIC, "monotone", reject="b", inplace=True,
      grad=lambda g, out: g.masked_fill(out <= 0, 0.0))  # (NaN passes, as in PyTorch)
unary("silu", pw.silu_kernel, "floatonly", FLOATS, method=False, grad=_silu_grad)
unary("sign", pw.sign_kernel, "same", NUMERIC, "monotone", inplace=True, grad=_zero)
unary("floor", np.floor, "round", FLOATS, "monotone", inplace=True, grad=_zero)
unary("ceil", np.ceil, "round", FLOATS, "monotone", inplace=True, grad=_zero)
unary("trunc", np.trunc, "round", FLOATS, "monotone", inplace=True, grad=_zero)
unary("logical_not", np.logical_not, "bool", REAL, "logical_not", inplace=True,
      grad=NOT_DIFFERENTIABLE)
unary("isnan", np.isnan, "bool", REAL, grad=NOT_DIFFERENTIABLE)
unary("isinf", np.isinf, "bool", REAL, grad=NOT_DIFFERENTIABLE)
unary("isfinite", np.isfinite, "bool", REAL, grad=NOT_DIFFERENTIABLE)
unary("bitwise_not", np.invert, "integral", INTS | BOOLS, "anti", operator="__invert__",
      inplace=True, grad=NOT_DIFFERENTIABLE)

declare("round", pw.round, rule=unary_rule("round", "monotone"),
        inplace=K.inplace_form(pw.round), samples="unary", backward=elementwise_grad(_zero))
declare("square", pw.square, rule=unary_rule("square", "none"),
        inplace=K.inplace_form(pw.square), samples="unary",
        backward=elementwise_grad(lambda g, x: g * x * 2.0))
declare("positive", pw.positive, rule=unary_rule("same", "copy"),
        operators=(Operator("__pos__", "unary", pw.positive),), samples="unary",
        backward=elementwise_grad(lambda g: g))


def _gelu(g, v, o, need, fns):
    x, approximate = v[0], v[1]
    if not is_grad_enabled():  # one fused pass; the composite below when it is recorded
        return (fns._gelu_backward(g, x, approximate),)
    if approximate == "tanh":
        k = math.sqrt(2.0 / math.pi)
        x2 = x * x
        t = ((x + x2 * x * 0.044715) * k).tanh()
        right_d = (1.0 - t * t) * k * (x2 * (3 * 0.044715) + 1.0)
        return (g * ((t + 1.0) * 0.5 + x * 0.5 * right_d),)
    cdf = ((x * _SQRT1_2).erf() + 1.0) * 0.5
    pdf = (x * x * -0.5).exp() * _1_SQRT2PI
    return (g * (cdf + x * pdf),)


def _softplus(g, v, o, need, fns):
    x, beta, threshold = v[0], v[1], v[2]
    bx = x * beta
    return (g.where(bx > threshold, g * bx.sigmoid()),)  # (a NaN input: NaN, as in PyTorch)


declare("gelu", pw.gelu, rule=unary_rule("floatonly", "none"), method=False, samples="unary",
        backward=Backward(_gelu, ("input",)))
# the fused gradient of gelu (PyTorch's aten::gelu_backward) that gelu's formula runs; its rule
# is in placements.rules.nn. Not differentiable itself: under a recorded backward
# (create_graph) gelu's formula uses the composite form instead.
declare("_gelu_backward", pw.gelu_backward, ("grad", "input"), method=False, samples="nn",
        backward=NOT_DIFFERENTIABLE)
declare("softplus", pw.softplus, rule=unary_rule("floatonly", "monotone"), method=False,
        samples="unary", backward=Backward(_softplus, ("input",)))
declare("leaky_relu", pw.leaky_relu, rule=unary_rule("floatonly", "leaky_relu"),
        static=("negative_slope",), method=False, samples="unary",
        backward=Backward(lambda g, v, o, n, fns: (g.where(v[0] > 0, g * v[1]),), ("input",)))


# -- binary ----------------------------------------------------------------------------------
def _div(g, v, o, need, fns):
    a, b, rounding_mode = v[0], v[1], v[2]
    if rounding_mode is not None:  # a rounded quotient is piecewise constant (PyTorch: zeros)
        zero = g * 0.0
        return (zero if need[0] else None, zero if need[1] else None)
    ga = g / b
    gb = -(ga * a / b) if need[1] else None
    return (ga if need[0] else None, gb)


def _log_of(a):
    return a.log() if is_tensor(a) else math.log(a)


def _pow(g, v, o, need, fns):
    a, e = v[0], v[1]
    ga = gb = None
    if need[0]:
        ga = g * e * a ** (e - 1)
        if not is_tensor(e) and e == 0:
            ga = g * 0.0
    if need[1]:
        gb = g * o * _log_of(a)
        if is_tensor(a):
            gb = gb.where(a != 0, 0.0)
    return (ga, gb)


def _extremum(loses):
    """maximum/minimum's formula (PyTorch's): the gradient goes to the winning argument, half
    to each of a tie, and whole to both where either is NaN (``loses(a, b)``: where ``a`` is
    not picked)."""

    def fn(g, v, o, need, fns):
        a, b = v[0], v[1]
        share = g.where(a != b, g * 0.5)
        return (share.masked_fill(loses(a, b), 0.0) if need[0] else None,
                share.masked_fill(loses(b, a), 0.0) if need[1] else None)
    return fn


def _atan2(g, v, o, need, fns):
    a, b = v[0], v[1]
    d = g / (a * a + b * b)
    return (d * b, -(d * a))


def binary(name: str, operator: str | None = None, inplace: bool = False,
           compare: bool = False, *, backward: Backward) -> None:
    """Declare the binary op ``name`` over its local kernel (and python operator ``operator``:
    ``"add"`` serves ``__add__``, ``__radd__`` and, with ``inplace``, ``__iadd__``), with its
    formula ``backward``. **Local**."""
    fn = getattr(pw, name)
    ops, iops = (), ()
    if operator is not None:
        op, rop = pw.OPERATORS[name]
        if compare:
            ops = (Operator(f"__{operator}__", "compare", op),)
        else:
            ops = (Operator(f"__{operator}__", "binary", op),
                   Operator(f"__r{operator}__", "reflected", rop))
        if inplace:
            iops = (Operator(f"__i{operator}__", "binary", K.inplace_operator(fn, operator)),)
    declare(name, fn, ("input", "other"), operators=ops,
            inplace=K.inplace_form(fn) if inplace else None, inplace_operators=iops,
            samples="binary", backward=backward)


_BOTH = ("input", "other")  # the formula reads both arguments
binary("add", "add", inplace=True,
       backward=Backward(lambda g, v, o, n, fns: (g, scaled(g, v[2]))))
binary("sub", "sub", inplace=True,
       backward=Backward(lambda g, v, o, n, fns: (g, -scaled(g, v[2]))))
binary("mul", "mul", inplace=True, backward=Backward(
    lambda g, v, o, n, fns: (g * v[1] if n[0] else None, g * v[0] if n[1] else None), _BOTH))
binary("div", "truediv", inplace=True, backward=Backward(_div, _BOTH))
binary("floor_divide", "floordiv", inplace=True, backward=NOT_DIFFERENTIABLE)
binary("remainder", "mod", inplace=True, backward=Backward(
    lambda g, v, o, n, fns: (g, -(g * (v[0] / v[1]).floor())), _BOTH))
binary("fmod", inplace=True, backward=Backward(
    lambda g, v, o, n, fns: (g, -(g * (v[0] / v[1]).trunc())), _BOTH))
binary("pow", "pow", inplace=True, backward=Backward(_pow, _BOTH, out=True))
binary("maximum", backward=Backward(_extremum(lambda a, b: a < b), _BOTH))
binary("minimum", backward=Backward(_extremum(lambda a, b: a > b), _BOTH))
binary("atan2", backward=Backward(_atan2, _BOTH))
for _name in ("eq", "ne", "lt", "le", "gt", "ge"):
    binary(_name, _name, compare=True, backward=NOT_DIFFERENTIABLE)
for _name in ("logical_and", "logical_or", "logical_xor"):
    binary(_name, backward=NOT_DIFFERENTIABLE)
binary("bitwise_and", "and", inplace=True, backward=NOT_DIFFERENTIABLE)
binary("bitwise_or", "or", inplace=True, backward=NOT_DIFFERENTIABLE)
binary("bitwise_xor", "xor", inplace=True, backward=NOT_DIFFERENTIABLE)


# -- ternary ---------------------------------------------------------------------------------
def _where(g, v, o, need, fns):
    c = v[0]
    return (None, g.where(c, 0.0) if need[1] else None,
            g.where(c.logical_not(), 0.0) if need[2] else None)


def _clamp(g, v, o, need, fns):
    # clamp is min(max(x, lo), hi): the gradient goes to whichever value it returns
    x, lo, hi = v[0], v[1], v[2]
    m = x if lo is None else x.clamp(lo, None)
    gi = g
    if lo is not None:
        gi = gi.where(x >= lo, 0.0)
    if hi is not None:
        gi = gi.where(m <= hi, 0.0)
    glo = ghi = None
    if need[1]:
        glo = g.where(x < lo, 0.0)
        glo = glo if hi is None else glo.where(m <= hi, 0.0)
    if need[2]:
        ghi = g.where(m > hi, 0.0)
    return (gi, glo, ghi)


def _lerp(g, v, o, need, fns):
    a, e, w = v[0], v[1], v[2]
    return (g * (1.0 - w), g * w, g * (e - a) if need[2] else None)


def _addcmul(g, v, o, need, fns):
    t1, t2, value = v[1], v[2], v[3]
    gv = scaled(g, value)
    return (g, gv * t2 if need[1] else None, gv * t1 if need[2] else None)


def _addcdiv(g, v, o, need, fns):
    t1, t2, value = v[1], v[2], v[3]
    gv = scaled(g, value) / t2
    return (g, gv if need[1] else None, -(gv * t1 / t2) if need[2] else None)


declare("where", pw.where, ("condition", "input", "other"), method_args=(1, 0, 2),
        samples="ternary", backward=Backward(_where, ("condition",)))
for _name in ("clamp", "clip"):
    declare(_name, pw.clamp, ("input", "min", "max"), inplace=K.inplace_form(pw.clamp),
            samples="ternary", backward=Backward(_clamp, ("input", "min", "max")))
declare("lerp", pw.lerp, ("input", "end", "weight"), inplace=K.inplace_form(pw.lerp),
        samples="ternary", backward=Backward(_lerp, ("input", "end", "weight")))
declare("addcmul", pw.addcmul, ("input", "tensor1", "tensor2"),
        inplace=K.inplace_form(pw.addcmul), samples="ternary",
        backward=Backward(_addcmul, ("tensor1", "tensor2")))
declare("addcdiv", pw.addcdiv, ("input", "tensor1", "tensor2"),
        inplace=K.inplace_form(pw.addcdiv), samples="ternary",
        backward=Backward(_addcdiv, ("tensor1", "tensor2")))
