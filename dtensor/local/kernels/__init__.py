"""The local math of :class:`~dtensor.Tensor`: the public kernel functions, their in-place
forms, and their installation as Tensor methods and python operators.

The kernels live in family modules (``_math_pointwise``, ``_math_reduce``, ``_math_linalg``,
``_math_join``, ``_math_nn``; shared machinery in ``_math_base``). Every kernel is a
**Local** plain function with PyTorch's name and argument names, so the distributed
dispatcher can call it on local shards. This module gathers them, defines the in-place
variants (``add_``, ``exp_``... which write through views into ``self`` after validating
everything), and binds methods and operators onto ``Tensor`` at import.
"""

from __future__ import annotations

from ..tensor import Tensor
from .base import OperandTypeError, operand
from .join import _dims_arg, cat, concat, flip, repeat, roll, stack, tile, tril, triu
from .linalg import addmm, bmm, dot, einsum, linear, matmul, mm, outer
from .nn import (
    cross_entropy,
    dropout,
    embedding,
    layer_norm,
    log_softmax,
    mse_loss,
    softmax,
)
from .pointwise import (
    _add_op,
    _add_rop,
    _and_op,
    _and_rop,
    _div_op,
    _div_rop,
    _eq_op,
    _floordiv_op,
    _floordiv_rop,
    _ge_op,
    _gt_op,
    _le_op,
    _lt_op,
    _mod_op,
    _mod_rop,
    _mul_op,
    _mul_rop,
    _ne_op,
    _or_op,
    _or_rop,
    _pow_op,
    _pow_rop,
    _sub_op,
    _sub_rop,
    _xor_op,
    _xor_rop,
    abs,
    add,
    addcdiv,
    addcmul,
    atan2,
    bitwise_and,
    bitwise_not,
    bitwise_or,
    bitwise_xor,
    ceil,
    clamp,
    clip,
    cos,
    div,
    eq,
    erf,
    exp,
    expm1,
    floor,
    floor_divide,
    fmod,
    ge,
    gelu,
    gt,
    isfinite,
    isinf,
    isnan,
    le,
    leaky_relu,
    lerp,
    log,
    log1p,
    log2,
    logical_and,
    logical_not,
    logical_or,
    logical_xor,
    lt,
    maximum,
    minimum,
    mul,
    ne,
    neg,
    positive,
    pow,
    reciprocal,
    relu,
    remainder,
    round,
    rsqrt,
    sigmoid,
    sign,
    silu,
    sin,
    softplus,
    sqrt,
    square,
    sub,
    tan,
    tanh,
    trunc,
    where,
)
from .reduce import (
    all,
    amax,
    amin,
    any,
    argmax,
    argmin,
    count_nonzero,
    cumprod,
    cumsum,
    logsumexp,
    max,
    mean,
    min,
    norm,
    prod,
    std,
    sum,
    var,
)

__all__ = [
    "abs", "add", "addcdiv", "addcmul", "addmm", "all", "amax", "amin", "any", "argmax",
    "argmin", "atan2", "bitwise_and", "bitwise_not", "bitwise_or", "bitwise_xor", "bmm", "cat",
    "ceil", "clamp", "clip", "concat", "cos", "count_nonzero", "cross_entropy", "cumprod",
    "cumsum", "div", "dot", "dropout", "einsum", "embedding", "eq", "erf", "exp", "expm1",
    "flip", "floor", "floor_divide", "fmod", "ge", "gelu", "gt", "isfinite", "isinf", "isnan",
    "layer_norm", "le", "leaky_relu", "lerp", "linear", "log", "log1p", "log2", "log_softmax",
    "logical_and", "logical_not", "logical_or", "logical_xor", "logsumexp", "lt", "matmul",
    "max", "maximum", "mean", "min", "minimum", "mm", "mse_loss", "mul", "ne", "neg", "norm",
    "outer", "positive", "pow", "prod", "reciprocal", "relu", "remainder", "repeat", "roll",
    "round", "rsqrt", "sigmoid", "sign", "silu", "sin", "softmax", "softplus", "sqrt",
    "square", "stack", "std", "sub", "sum", "tan", "tanh", "tile", "tril", "triu", "trunc",
    "var", "where",
]


def _inplace(fn):
    """The in-place form of an op with an ``out=`` argument: ``fn(self, ..., out=self)``.

    Everything (result dtype castable to self's dtype, shapes, values such as integer
    division by zero) is validated before the first write, so a failing op leaves
    ``self`` unchanged. Writes go through ``self``'s view into its storage.
    """
    def method(self, *args, **kwargs):
        return fn(self, *args, out=self, **kwargs)

    method.__name__ = method.__qualname__ = fn.__name__ + "_"
    method.__doc__ = f"In-place :func:`{fn.__name__}` (writes into ``self``). **Local**."
    return method


# In-place kernels (also bound as Tensor methods below).
_INPLACE_OF = (
    abs, add, addcdiv, addcmul, bitwise_and, bitwise_not, bitwise_or, bitwise_xor, ceil,
    clamp, cos, div, erf, exp, expm1, floor, floor_divide, fmod, lerp, log, log1p, log2,
    logical_not, mul, neg, pow, reciprocal, relu, remainder, round, rsqrt, sigmoid, sign,
    sin, sqrt, square, sub, tan, tanh, trunc,
)
_INPLACE = {fn.__name__ + "_": _inplace(fn) for fn in _INPLACE_OF}
_INPLACE["clip_"] = _INPLACE["clamp_"]
# The in-place kernels are module attributes too (``dtensor.local.kernels.add_`` ...).
globals().update(_INPLACE)


def _inplace_operator(fn, name: str):
    """``t op= other``: in place, or NotImplemented for an operand type we do not take."""

    def method(self, other):
        try:
            operand(fn.__name__, other)
        except OperandTypeError:
            return NotImplemented
        return fn(self, other, out=self)

    method.__name__ = method.__qualname__ = name
    return method


def _tensor_where(self, condition, y):
    """``self.where(condition, y)`` is ``where(condition, self, y)``. **Local**."""
    return where(condition, self, y)


def _tensor_flip(self, *dims):
    """``self.flip(0, 1)`` or ``self.flip((0, 1))``. **Local**."""
    return flip(self, _dims_arg(dims))


def _matmul_operator(reflected: bool):
    """``t @ other`` (or ``other @ t``), NotImplemented for an operand type we do not take."""

    def method(self, other):
        try:
            operand("matmul", other)
        except OperandTypeError:
            return NotImplemented
        return matmul(other, self) if reflected else matmul(self, other)

    method.__name__ = method.__qualname__ = "__rmatmul__" if reflected else "__matmul__"
    return method


def _install() -> None:
    """Bind the kernels onto :class:`Tensor` as methods and python operators."""
    methods = {
        fn.__name__: fn
        for fn in (
            abs, add, addcdiv, addcmul, addmm, all, amax, amin, any, argmax, argmin, atan2,
            bitwise_and, bitwise_not, bitwise_or, bitwise_xor, bmm, ceil, clamp, cos,
            count_nonzero, cumprod, cumsum, div, dot, eq, erf, exp, expm1, floor,
            floor_divide, fmod, ge, gt, isfinite, isinf, isnan, le, lerp, log, log1p, log2,
            log_softmax, logical_and, logical_not, logical_or, logical_xor, logsumexp, lt,
            matmul, max, maximum, mean, min, minimum, mm, mul, ne, neg, norm, outer, positive,
            pow, prod, reciprocal, relu, remainder, repeat, roll, round, rsqrt, sigmoid, sign,
            sin, softmax, sqrt, square, std, sub, sum, tan, tanh, tile, tril, triu, trunc, var,
        )
    }
    methods.update(_INPLACE)
    methods.update(
        clip=clamp,
        negative=neg,
        where=_tensor_where,
        flip=_tensor_flip,
        __add__=_add_op, __radd__=_add_rop,
        __sub__=_sub_op, __rsub__=_sub_rop,
        __mul__=_mul_op, __rmul__=_mul_rop,
        __truediv__=_div_op, __rtruediv__=_div_rop,
        __floordiv__=_floordiv_op, __rfloordiv__=_floordiv_rop,
        __mod__=_mod_op, __rmod__=_mod_rop,
        __pow__=_pow_op, __rpow__=_pow_rop,
        __and__=_and_op, __rand__=_and_rop,
        __or__=_or_op, __ror__=_or_rop,
        __xor__=_xor_op, __rxor__=_xor_rop,
        __matmul__=_matmul_operator(False), __rmatmul__=_matmul_operator(True),
        __eq__=_eq_op, __ne__=_ne_op, __lt__=_lt_op, __le__=_le_op, __gt__=_gt_op,
        __ge__=_ge_op,
        __neg__=neg, __pos__=positive, __abs__=abs, __invert__=bitwise_not,
        # ``==`` returns a Tensor, so hashing is by identity (as in PyTorch).
        __hash__=object.__hash__,
    )
    for fn, name in (
        (add, "add"), (sub, "sub"), (mul, "mul"), (div, "truediv"), (floor_divide, "floordiv"),
        (remainder, "mod"), (pow, "pow"), (bitwise_and, "and"), (bitwise_or, "or"),
        (bitwise_xor, "xor"),
    ):
        methods[f"__i{name}__"] = _inplace_operator(fn, f"__i{name}__")
    for name, fn in methods.items():
        setattr(Tensor, name, fn)


_install()
