"""The local math of :class:`~dtensor.Tensor`: the kernel functions, and the helpers that
make their in-place forms and python operators.

The kernels live in family modules (:mod:`.pointwise`, :mod:`.reduce`, :mod:`.linalg`,
:mod:`.join`, :mod:`.nn`, :mod:`.attention`; shared machinery in :mod:`.base`). Every kernel
is a **Local** plain function with PyTorch's name and argument names, so the distributed
dispatcher can call it on local shards. The op table (:mod:`dtensor.ops`) declares which
kernel serves which op, function, method, in-place form and operator; the unary elementwise
kernels are made there from :func:`.pointwise.unary_function`.
"""

from __future__ import annotations

from .attention import scaled_dot_product_attention, scaled_dot_product_attention_backward
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
    rms_norm,
    softmax,
)
from .pointwise import (
    add,
    addcdiv,
    addcmul,
    atan2,
    bitwise_and,
    bitwise_or,
    bitwise_xor,
    clamp,
    clip,
    div,
    eq,
    floor_divide,
    fmod,
    ge,
    gelu,
    gt,
    le,
    leaky_relu,
    lerp,
    logical_and,
    logical_or,
    logical_xor,
    lt,
    maximum,
    minimum,
    mul,
    ne,
    positive,
    pow,
    remainder,
    round,
    softplus,
    square,
    sub,
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
    "add", "addcdiv", "addcmul", "addmm", "all", "amax", "amin", "any", "argmax", "argmin",
    "atan2", "bitwise_and", "bitwise_or", "bitwise_xor", "bmm", "cat", "clamp", "clip",
    "concat", "count_nonzero", "cross_entropy", "cumprod", "cumsum", "div", "dot", "dropout",
    "einsum", "embedding", "eq", "flip", "floor_divide", "fmod", "ge", "gelu", "gt",
    "inplace_form", "inplace_operator", "layer_norm", "le", "leaky_relu", "lerp", "linear",
    "log_softmax", "logical_and", "logical_or", "logical_xor", "logsumexp", "lt", "matmul",
    "matmul_operator", "max", "maximum", "mean", "min", "minimum", "mm", "mse_loss", "mul",
    "ne", "norm", "outer", "positive", "pow", "prod", "remainder", "repeat", "rms_norm", "roll",
    "round", "scaled_dot_product_attention",
    "scaled_dot_product_attention_backward", "softmax", "softplus", "square", "stack", "std",
    "sub", "sum", "tensor_flip", "tile", "tril", "triu", "var", "where",
]


def inplace_form(fn):
    """The in-place form of an op with an ``out=`` argument: ``fn(self, ..., out=self)``.

    **Local.** Everything (result dtype castable to self's dtype, shapes, values such as
    integer division by zero) is validated before the first write, so a failing op leaves
    ``self`` unchanged. Writes go through ``self``'s view into its storage.
    """

    def method(self, *args, **kwargs):
        return fn(self, *args, out=self, **kwargs)

    method.__name__ = method.__qualname__ = fn.__name__ + "_"
    method.__doc__ = f"In-place :func:`{fn.__name__}` (writes into ``self``). **Local**."
    method.quiet = getattr(fn, "quiet", False)  # as fn (base.quiet_function)
    return method


def inplace_operator(fn, tag: str):
    """``t op= other`` (``__i<tag>__``): in place, or NotImplemented for an operand type we
    do not take. **Local**."""

    def method(self, other):
        try:
            operand(fn.__name__, other)
        except OperandTypeError:
            return NotImplemented
        return fn(self, other, out=self)

    method.__name__ = method.__qualname__ = f"__i{tag}__"
    method.quiet = getattr(fn, "quiet", False)
    return method


def tensor_flip(self, *dims):
    """``self.flip(0, 1)`` or ``self.flip((0, 1))``. **Local**."""
    return flip(self, _dims_arg(dims))


def matmul_operator(reflected: bool):
    """``t @ other`` (or ``other @ t``), NotImplemented for an operand type we do not take.
    **Local**."""

    def method(self, other):
        try:
            operand("matmul", other)
        except OperandTypeError:
            return NotImplemented
        return matmul(other, self) if reflected else matmul(self, other)

    method.__name__ = method.__qualname__ = "__rmatmul__" if reflected else "__matmul__"
    return method
