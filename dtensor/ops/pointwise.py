"""Records of the elementwise ops: unary, binary, ternary, and their in-place forms.

A unary op is one :func:`unary` line: its name, the array kernel, its dtype rule, the dtypes
the kernel takes as they are, how its sharding rule treats Partial inputs, and whether it
has an in-place form; that line makes the local function, the in-place kernel, the rule
and the op records. Binary ops are declared over the local kernels of
:mod:`dtensor.local.kernels.pointwise` (which other kernels use too).
"""

from __future__ import annotations

import numpy as np

from placements.rules.pointwise import unary_rule

from ..local import kernels as K
from ..local.kernels import pointwise as P
from .derivatives import BINARY, GELU, LEAKY_RELU, SOFTPLUS, TERNARY, UNARY
from .table import Operator, declare

__all__ = ["unary"]


def unary(
    name: str,
    kernel,
    kind: str,
    fast: frozenset,
    partials: str = "none",
    *,
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
        kernel = P.ufunc_kernel(kernel)
    fn = P.unary_function(name, kernel, kind, fast, reject, hint)
    ops = (Operator(operator, "unary", fn),) if operator else ()
    return declare(
        name, fn, rule=unary_rule(kind, partials), method=method, aliases=aliases,
        operators=ops, inplace=K.inplace_form(fn) if inplace else None, samples="unary",
        backward=UNARY[name],
    )


# the dtypes a kernel takes as they are: floats, numeric (ints and floats), real (numeric and
# bool), ints, bools
F, N, R, I, B = P.FLOATS, P.NUMERIC, P.REAL, P.INTS, P.BOOLS

# -- unary ---------------------------------------------------------------------------------
unary("neg", np.negative, "same", N, "linear", reject="b", operator="__neg__", inplace=True,
      aliases=("negative",), hint=" (use ~ or logical_not() to invert a mask)")
unary("abs", np.absolute, "same", N, reject="b", operator="__abs__", inplace=True)
unary("exp", np.exp, "float", F, "monotone", inplace=True)
unary("expm1", np.expm1, "float", F, "monotone", inplace=True)
unary("log", np.log, "float", F, inplace=True)
unary("log1p", np.log1p, "float", F, inplace=True)
unary("log2", np.log2, "float", F, inplace=True)
unary("log10", np.log10, "float", F, inplace=True)
unary("sqrt", np.sqrt, "float", F, inplace=True)
unary("rsqrt", P.rsqrt_kernel, "float", F, inplace=True)
unary("sin", np.sin, "float", F, inplace=True)
unary("cos", np.cos, "float", F, inplace=True)
unary("tan", np.tan, "float", F, inplace=True)
unary("tanh", np.tanh, "float", F, "monotone", inplace=True)
unary("sigmoid", P.sigmoid_kernel, "float", F, "monotone", inplace=True)
unary("erf", P.erf_kernel, "float", F, "monotone", inplace=True)
unary("reciprocal", np.reciprocal, "float", F, inplace=True)
unary("relu", P.relu_kernel, "same", N, "monotone", reject="b", inplace=True)
unary("silu", P.silu_kernel, "floatonly", F, method=False)
unary("sign", P.sign_kernel, "same", N, "monotone", inplace=True)
unary("floor", np.floor, "round", F, "monotone", inplace=True)
unary("ceil", np.ceil, "round", F, "monotone", inplace=True)
unary("trunc", np.trunc, "round", F, "monotone", inplace=True)
unary("logical_not", np.logical_not, "bool", R, "logical_not", inplace=True)
unary("isnan", np.isnan, "bool", R)
unary("isinf", np.isinf, "bool", R)
unary("isfinite", np.isfinite, "bool", R)
unary("bitwise_not", np.invert, "integral", I | B, "anti", operator="__invert__", inplace=True)

declare("round", P.round, rule=unary_rule("round", "monotone"),
        inplace=K.inplace_form(P.round), samples="unary", backward=UNARY["round"])
declare("square", P.square, rule=unary_rule("square", "none"),
        inplace=K.inplace_form(P.square), samples="unary", backward=UNARY["square"])
declare("positive", P.positive, rule=unary_rule("same", "copy"),
        operators=(Operator("__pos__", "unary", P.positive),), samples="unary",
        backward=UNARY["positive"])
declare("gelu", P.gelu, rule=unary_rule("floatonly", "none"), method=False, samples="unary",
        backward=GELU)
declare("softplus", P.softplus, rule=unary_rule("floatonly", "monotone"), method=False,
        samples="unary", backward=SOFTPLUS)
declare("leaky_relu", P.leaky_relu, rule=unary_rule("floatonly", "leaky_relu"),
        static=("negative_slope",), method=False, samples="unary", backward=LEAKY_RELU)


# -- binary ----------------------------------------------------------------------------------
def binary(name: str, operator: str | None = None, inplace: bool = False,
           compare: bool = False) -> None:
    """Declare the binary op ``name`` over its local kernel (and python operator ``operator``:
    ``"add"`` serves ``__add__``, ``__radd__`` and, with ``inplace``, ``__iadd__``)."""
    fn = getattr(P, name)
    ops, iops = (), ()
    if operator is not None:
        op, rop = P.OPERATORS[name]
        if compare:
            ops = (Operator(f"__{operator}__", "compare", op),)
        else:
            ops = (Operator(f"__{operator}__", "binary", op),
                   Operator(f"__r{operator}__", "reflected", rop))
        if inplace:
            iops = (Operator(f"__i{operator}__", "binary", K.inplace_operator(fn, operator)),)
    declare(name, fn, ("input", "other"), operators=ops,
            inplace=K.inplace_form(fn) if inplace else None, inplace_operators=iops,
            samples="binary", backward=BINARY[name])


binary("add", "add", inplace=True)
binary("sub", "sub", inplace=True)
binary("mul", "mul", inplace=True)
binary("div", "truediv", inplace=True)
binary("floor_divide", "floordiv", inplace=True)
binary("remainder", "mod", inplace=True)
binary("fmod", inplace=True)
binary("pow", "pow", inplace=True)
binary("maximum")
binary("minimum")
binary("atan2")
for _name in ("eq", "ne", "lt", "le", "gt", "ge"):
    binary(_name, _name, compare=True)
for _name in ("logical_and", "logical_or", "logical_xor"):
    binary(_name)
binary("bitwise_and", "and", inplace=True)
binary("bitwise_or", "or", inplace=True)
binary("bitwise_xor", "xor", inplace=True)

# -- ternary ---------------------------------------------------------------------------------
declare("where", P.where, ("condition", "input", "other"), method_args=(1, 0, 2),
        samples="ternary", backward=TERNARY["where"])
for _name in ("clamp", "clip"):
    declare(_name, P.clamp, ("input", "min", "max"), inplace=K.inplace_form(P.clamp),
            samples="ternary", backward=TERNARY[_name])
declare("lerp", P.lerp, ("input", "end", "weight"), inplace=K.inplace_form(P.lerp),
        samples="ternary", backward=TERNARY["lerp"])
for _name in ("addcmul", "addcdiv"):
    _fn = getattr(P, _name)
    declare(_name, _fn, ("input", "tensor1", "tensor2"), inplace=K.inplace_form(_fn),
            samples="ternary", backward=TERNARY[_name])
