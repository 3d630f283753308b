"""Records of joins (``cat``, ``stack``), reorderings (``flip``, ``roll``, ``tril``,
``repeat``, ``tile``), copies (``clone``, ``copy_``, ``fill_``...) and casts (``to``,
``float``...), with their backward formulas."""

from __future__ import annotations

from placements.meta import norm_dim
from placements.rules.pointwise import unary_rule

from ..local import kernels as K
from ._grad import FIRST, IDENTITY, zeros
from .table import NOT_DIFFERENTIABLE, Backward, declare
from .table import declare_method as method

__all__: list[str] = []


# -- joins and reorderings ---------------------------------------------------------------------
def _legacy_empty(t) -> bool:
    """Whether ``t`` is a 1-D empty tensor, which cat skips (PyTorch's legacy rule)."""
    return t.ndim == 1 and t.shape[0] == 0


def _cat(g, v, o, need, fns):
    tensors, dim = list(v[0]), v[1]
    if _legacy_empty(g):  # only legacy empties: a plain 1-D cat
        return tuple(g if n else None for n in need)
    d = norm_dim(dim, g.ndim, "cat")
    # a skipped legacy empty gets a gradient of its own shape (0,), as in PyTorch
    kept = [not _legacy_empty(t) for t in tensors]
    pieces = iter(g.split([t.shape[d] for t, k in zip(tensors, kept) if k], d))
    out = []
    for k, n in zip(kept, need):
        piece = next(pieces) if k else None
        out.append(None if not n else piece if k else zeros((0,), g, fns))
    return tuple(out)


def _stack(g, v, o, need, fns):
    tensors, dim = list(v[0]), v[1]
    d = norm_dim(dim, tensors[0].ndim + 1, "stack")
    return tuple(g.unbind(d))


def _roll(g, v, o, need, fns):
    shifts, dims = v[1], v[2]
    neg = -shifts if isinstance(shifts, int) else tuple(-s for s in shifts)
    return (g.roll(neg, dims),)


def _repeat(g, v, o, need, fns):
    x, sizes = v[0], v[1]
    reps = tuple(sizes) if not isinstance(sizes, int) else (sizes,)
    if len(reps) < x.ndim:  # tile pads its dims with leading ones
        reps = (1,) * (x.ndim - len(reps)) + reps
    xs = (1,) * (len(reps) - x.ndim) + tuple(x.shape)
    inter = []
    for r, s in zip(reps, xs):
        inter += [r, s]
    summed = g.reshape(inter).sum(dim=tuple(range(0, 2 * len(reps), 2)))
    return (summed.reshape(x.shape),)


for _name in ("cat", "concat"):
    declare(_name, getattr(K, _name), ("tensors",), variadic="tensors", method=False,
            samples="join", backward=Backward(_cat))
declare("stack", K.stack, ("tensors",), variadic="tensors", method=False, samples="join",
        backward=Backward(_stack))
# reorderings: priced as views (a copy, no arithmetic)
declare("flip", K.flip, method=K.tensor_flip, samples="view", cost="view",
        backward=Backward(lambda g, v, o, n, fns: (g.flip(v[1]),)))
declare("roll", K.roll, samples="view", cost="view", backward=Backward(_roll))
declare("tril", K.tril, samples="view", cost="view",
        backward=Backward(lambda g, v, o, n, fns: (g.tril(v[1]),)))
declare("triu", K.triu, samples="view", cost="view",
        backward=Backward(lambda g, v, o, n, fns: (g.triu(v[1]),)))
declare("repeat", K.repeat, params=("input", "sizes"), samples="view", cost="view",
        backward=Backward(_repeat))
declare("tile", K.tile, samples="view", cost="view", backward=Backward(_repeat))


# -- casts and copies (methods of the Tensor class) ----------------------------------------------
# casts: the recorder casts the gradient back to the input's dtype
method("to", ("input", "dtype"), kernel=lambda input, dtype: input.to(dtype), samples="cast",
       backward=IDENTITY)
method("type_as", ("input", "other"), ("input", "other"), samples="cast", backward=FIRST)
for _name in ("float", "double", "half", "bfloat16"):
    method(_name, samples="cast", backward=IDENTITY)
for _name in ("int", "long", "short", "char", "byte", "bool"):
    method(_name, samples="cast", backward=NOT_DIFFERENTIABLE)
for _name in ("clone", "contiguous"):
    method(_name, rule=unary_rule("same", "copy"), samples="unary", backward=IDENTITY,
           raw="copy")
method("detach", rule=unary_rule("same", "copy"), samples="unary", backward=NOT_DIFFERENTIABLE)
method("copy_", ("input", "src"), ("input", "src"), writes=True, samples="write",
       backward=Backward(lambda g, v, o, n, fns: (None, g)))
method("fill_", ("input", "value"), ("input", "value"), writes=True, samples="write",
       backward=Backward(lambda g, v, o, n, fns: (None, g.sum() if n[1] else None)))
method("zero_", writes=True, samples="write",
       backward=Backward(lambda g, v, o, n, fns: (None,)))
