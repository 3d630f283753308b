"""Records of joins (``cat``, ``stack``), reorderings (``flip``, ``roll``, ``tril``,
``repeat``, ``tile``), copies (``clone``, ``copy_``, ``fill_``...) and casts (``to``,
``float``...)."""

from __future__ import annotations

from placements.rules.pointwise import unary_rule

from ..local import kernels as K
from .table import declare
from .table import declare_method as method

__all__: list[str] = []

# -- joins and reorderings ---------------------------------------------------------------------
for _name in ("cat", "concat", "stack"):
    declare(_name, getattr(K, _name), ("tensors",), variadic="tensors", method=False,
            samples="join")
declare("flip", K.flip, method=K.tensor_flip, samples="view")
declare("roll", K.roll, samples="view")
for _name in ("tril", "triu"):
    declare(_name, getattr(K, _name), samples="view")
declare("repeat", K.repeat, params=("input", "sizes"), samples="view")
declare("tile", K.tile, samples="view")


# -- casts and copies (methods of the Tensor class) ----------------------------------------------
method("to", ("input", "dtype"), kernel=lambda input, dtype: input.to(dtype), samples="cast")
method("type_as", ("input", "other"), ("input", "other"), samples="cast")
for _name in ("float", "double", "half", "int", "long", "short", "char", "byte", "bool"):
    method(_name, samples="cast")
for _name in ("clone", "contiguous", "detach"):
    method(_name, rule=unary_rule("same", "copy"), samples="unary")
method("copy_", ("input", "src"), ("input", "src"), writes=True, samples="write")
method("fill_", ("input", "value"), ("input", "value"), writes=True, samples="write")
method("zero_", writes=True, samples="write")
