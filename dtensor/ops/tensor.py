"""Records of joins (``cat``, ``stack``), reorderings (``flip``, ``roll``, ``tril``,
``repeat``, ``tile``), copies (``clone``, ``copy_``, ``fill_``...) and casts (``to``,
``float``...)."""

from __future__ import annotations

from placements.rules.pointwise import unary_rule

from ..local import kernels as K
from ..local.tensor import Tensor
from .table import declare

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
def method(name: str, kernel=None, tensors=("input",), params=("input",), defaults=None,
           inplace=False, **kw) -> None:
    """Declare a method the Tensor class defines (``kernel`` defaults to it)."""
    declare(name, kernel or getattr(Tensor, name), tensors, params=params, defaults=defaults,
            function=False, writes=inplace, **kw)


method("to", lambda input, dtype: input.to(dtype), params=("input", "dtype"), samples="cast")
method("type_as", tensors=("input", "other"), params=("input", "other"), samples="cast")
for _name in ("float", "double", "half", "int", "long", "short", "char", "byte", "bool"):
    method(_name, samples="cast")
for _name in ("clone", "contiguous", "detach"):
    method(_name, rule=unary_rule("same", "copy"), samples="unary")
method("copy_", tensors=("input", "src"), params=("input", "src"), inplace=True, samples="write")
method("fill_", tensors=("input", "value"), params=("input", "value"), inplace=True,
       samples="write")
method("zero_", inplace=True, samples="write")
