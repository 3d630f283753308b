"""Records of the products: ``matmul`` (and ``@``), ``mm``, ``bmm``, ``dot``, ``outer``,
``addmm``, ``linear`` and ``einsum``."""

from __future__ import annotations

from ..local import kernels as K
from .derivatives import PRODUCT as D
from .table import Operator, declare

__all__: list[str] = []

declare("matmul", K.matmul, ("input", "other"), samples="product", backward=D["matmul"],
        operators=(
    Operator("__matmul__", "binary", K.matmul_operator(False)),
    Operator("__rmatmul__", "reflected", K.matmul_operator(True)),
))
declare("mm", K.mm, ("input", "mat2"), samples="product", backward=D["mm"])
declare("bmm", K.bmm, ("input", "mat2"), samples="product", backward=D["bmm"])
declare("dot", K.dot, ("input", "other"), samples="product", backward=D["dot"])
declare("outer", K.outer, ("input", "vec2"), samples="product", backward=D["outer"])
declare("addmm", K.addmm, ("input", "mat1", "mat2"), samples="product", backward=D["addmm"])
declare("linear", K.linear, ("input", "weight", "bias"), method=False, samples="product",
        backward=D["linear"])
declare("einsum", K.einsum, ("operands",), variadic="operands", method=False,
        samples="product", backward=D["einsum"])
