"""Records of joins (``cat``, ``stack``), reorderings (``flip``, ``roll``, ``tril``,
``repeat``, ``tile``), copies (``clone``, ``copy_``, ``fill_``...) and casts (``to``,
``float``...)."""

from __future__ import annotations

from placements.rules.pointwise import unary_rule

from ..local import kernels as K
from .derivatives import JOIN as D
from .table import declare
from .table import declare_method as method

__all__: list[str] = []

# -- joins and reorderings ---------------------------------------------------------------------
for _name in ("cat", "concat", "stack"):
    declare(_name, getattr(K, _name), ("tensors",), variadic="tensors", method=False,
            samples="join", backward=D[_name])
declare("flip", K.flip, method=K.tensor_flip, samples="view", backward=D["flip"])
declare("roll", K.roll, samples="view", backward=D["roll"])
for _name in ("tril", "triu"):
    declare(_name, getattr(K, _name), samples="view", backward=D[_name])
declare("repeat", K.repeat, params=("input", "sizes"), samples="view", backward=D["repeat"])
declare("tile", K.tile, samples="view", backward=D["tile"])


# -- casts and copies (methods of the Tensor class) ----------------------------------------------
method("to", ("input", "dtype"), kernel=lambda input, dtype: input.to(dtype), samples="cast",
       backward=D["to"])
method("type_as", ("input", "other"), ("input", "other"), samples="cast",
       backward=D["type_as"])
for _name in ("float", "double", "half", "int", "long", "short", "char", "byte", "bool"):
    method(_name, samples="cast", backward=D[_name])
for _name in ("clone", "contiguous", "detach"):
    method(_name, rule=unary_rule("same", "copy"), samples="unary", backward=D[_name])
method("copy_", ("input", "src"), ("input", "src"), writes=True, samples="write",
       backward=D["copy_"])
method("fill_", ("input", "value"), ("input", "value"), writes=True, samples="write",
       backward=D["fill_"])
method("zero_", writes=True, samples="write", backward=D["zero_"])
