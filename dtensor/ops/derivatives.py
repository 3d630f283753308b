"""Backward formulas of the op table, by family (the ``backward=`` of the op records).

Each formula is a :class:`~dtensor.ops.table.Backward`: ``fn(g, v, out, need)`` returns one
gradient per tensor argument (see there). Formulas are ordinary tensor ops (methods; the
few public functions they need, such as ``cat`` and ``zeros_like``, come from
:data:`F`, which :mod:`dtensor.dispatch.install` fills with the dispatching functions), so
on DTensors the sharding rules place the gradients and the collectives they need show up
in CommDebugMode. Broadcasting and dtype are handled by the recorder (each gradient is
summed down to its argument's shape and cast to its dtype), so a formula may return the
broadcast gradient.
"""

from __future__ import annotations

import math
import string

import numpy as np

from placements import Replicate
from placements.errors import AutogradError, ShardingError
from placements.index_meta import index_put_index
from placements.meta import norm_dim, norm_dims

from ..distributed.dtensor import DTensor, distribute_tensor
from ..local.factory import from_numpy
from ..local.rng import get_rng_state, set_rng_state
from ..local.tensor import Tensor
from .table import NOT_DIFFERENTIABLE, Backward

__all__ = [
    "BINARY",
    "GELU",
    "INDEX",
    "JOIN",
    "LEAKY_RELU",
    "NN",
    "NOT_DIFFERENTIABLE",
    "PRODUCT",
    "REDUCTION",
    "SOFTPLUS",
    "TERNARY",
    "UNARY",
    "VIEW",
    "F",
    "use_functions",
]

#: The public dispatching functions formulas call (``F["cat"]``...), set at import of
#: :mod:`dtensor.dispatch.install`.
F: dict = {}


def use_functions(functions: dict) -> None:
    """Give the formulas the dispatching public functions (by op name). **Local**."""
    F.update(functions)


def _is_tensor(v: object) -> bool:
    return isinstance(v, (Tensor, DTensor))


def _bw(fn=None, save=(), out=False, multi=False, rng=False) -> Backward:
    return Backward(fn, tuple(save), out, multi, rng)


# -- unary ----------------------------------------------------------------------------------------
_LN2, _LN10 = math.log(2.0), math.log(10.0)
_2_SQRTPI = 2.0 / math.sqrt(math.pi)
_SQRT1_2 = 1.0 / math.sqrt(2.0)
_1_SQRT2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _zero(g, v, o, need):
    return (g * 0.0,)


#: The formulas of the unary elementwise ops, by name (None: not differentiable).
UNARY = {
    "neg": _bw(lambda g, v, o, n: (-g,)),
    "abs": _bw(lambda g, v, o, n: (g * v[0].sign(),), ("input",)),
    "exp": _bw(lambda g, v, o, n: (g * o,), out=True),
    "expm1": _bw(lambda g, v, o, n: (g * (o + 1.0),), out=True),
    "log": _bw(lambda g, v, o, n: (g / v[0],), ("input",)),
    "log1p": _bw(lambda g, v, o, n: (g / (v[0] + 1.0),), ("input",)),
    "log2": _bw(lambda g, v, o, n: (g / (v[0] * _LN2),), ("input",)),
    "log10": _bw(lambda g, v, o, n: (g / (v[0] * _LN10),), ("input",)),
    "sqrt": _bw(lambda g, v, o, n: (g * 0.5 / o,), out=True),
    "rsqrt": _bw(lambda g, v, o, n: (g * (o * o * o) * -0.5,), out=True),
    "sin": _bw(lambda g, v, o, n: (g * v[0].cos(),), ("input",)),
    "cos": _bw(lambda g, v, o, n: (-(g * v[0].sin()),), ("input",)),
    "tan": _bw(lambda g, v, o, n: (g * (o * o + 1.0),), out=True),
    "tanh": _bw(lambda g, v, o, n: (g * (1.0 - o * o),), out=True),
    "sigmoid": _bw(lambda g, v, o, n: (g * o * (1.0 - o),), out=True),
    "erf": _bw(lambda g, v, o, n: (g * _2_SQRTPI * (-(v[0] * v[0])).exp(),), ("input",)),
    "reciprocal": _bw(lambda g, v, o, n: (-(g * o * o),), out=True),
    "relu": _bw(lambda g, v, o, n: (g.where(o > 0, 0.0),), out=True),
    "silu": _bw(lambda g, v, o, n: (_silu_grad(g, v[0]),), ("input",)),
    "sign": _bw(_zero),
    "floor": _bw(_zero),
    "ceil": _bw(_zero),
    "trunc": _bw(_zero),
    "round": _bw(_zero),
    "logical_not": NOT_DIFFERENTIABLE,
    "isnan": NOT_DIFFERENTIABLE,
    "isinf": NOT_DIFFERENTIABLE,
    "isfinite": NOT_DIFFERENTIABLE,
    "bitwise_not": NOT_DIFFERENTIABLE,
    "square": _bw(lambda g, v, o, n: (g * v[0] * 2.0,), ("input",)),
    "positive": _bw(lambda g, v, o, n: (g,)),
}


def _silu_grad(g, x):
    s = x.sigmoid()
    return g * s * (x * (1.0 - s) + 1.0)


def _gelu(g, v, o, need):
    x, approximate = v[0], v[1]
    if approximate == "tanh":
        k = math.sqrt(2.0 / math.pi)
        x2 = x * x
        t = ((x + x2 * x * 0.044715) * k).tanh()
        right_d = (1.0 - t * t) * k * (x2 * (3 * 0.044715) + 1.0)
        return (g * ((t + 1.0) * 0.5 + x * 0.5 * right_d),)
    cdf = ((x * _SQRT1_2).erf() + 1.0) * 0.5
    pdf = (x * x * -0.5).exp() * _1_SQRT2PI
    return (g * (cdf + x * pdf),)


def _softplus(g, v, o, need):
    x, beta, threshold = v[0], v[1], v[2]
    bx = x * beta
    return ((g * bx.sigmoid()).where(bx <= threshold, g),)


GELU = _bw(_gelu, ("input",))
SOFTPLUS = _bw(_softplus, ("input",))
LEAKY_RELU = _bw(lambda g, v, o, n: (g.where(v[0] > 0, g * v[1]),), ("input",))


# -- binary ---------------------------------------------------------------------------------------
def _alpha(g, a):
    return g if a == 1 else g * a


def _div(g, v, o, need):
    a, b = v[0], v[1]
    ga = g / b
    gb = -(ga * a / b) if need[1] else None
    return (ga if need[0] else None, gb)


def _log_of(a):
    return a.log() if _is_tensor(a) else math.log(a)


def _pow(g, v, o, need):
    a, e = v[0], v[1]
    ga = gb = None
    if need[0]:
        ga = g * e * a ** (e - 1)
        if not _is_tensor(e) and e == 0:
            ga = g * 0.0
    if need[1]:
        gb = g * o * _log_of(a)
        if _is_tensor(a):
            gb = gb.where(a != 0, 0.0)
    return (ga, gb)


def _extremum(pick):
    def fn(g, v, o, need):
        a, b = v[0], v[1]
        half = g * 0.5
        ga = g.where(pick(a, b), 0.0) + half.where(a == b, 0.0)
        return (ga, g - ga if need[1] else None)
    return fn


BINARY = {
    "add": _bw(lambda g, v, o, n: (g, _alpha(g, v[2]))),
    "sub": _bw(lambda g, v, o, n: (g, -_alpha(g, v[2]))),
    "mul": _bw(lambda g, v, o, n: (g * v[1] if n[0] else None, g * v[0] if n[1] else None),
               ("input", "other")),
    "div": _bw(_div, ("input", "other")),
    "pow": _bw(_pow, ("input", "other"), out=True),
    "maximum": _bw(_extremum(lambda a, b: a > b), ("input", "other")),
    "minimum": _bw(_extremum(lambda a, b: a < b), ("input", "other")),
    "atan2": _bw(lambda g, v, o, n: _atan2(g, v[0], v[1]), ("input", "other")),
    "fmod": _bw(lambda g, v, o, n: (g, -(g * (v[0] / v[1]).trunc())), ("input", "other")),
    "remainder": _bw(lambda g, v, o, n: (g, -(g * (v[0] / v[1]).floor())),
                     ("input", "other")),
}
for _name in ("floor_divide", "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or",
              "logical_xor", "bitwise_and", "bitwise_or", "bitwise_xor"):
    BINARY[_name] = NOT_DIFFERENTIABLE


def _atan2(g, a, b):
    d = g / (a * a + b * b)
    return (d * b, -(d * a))


# -- ternary --------------------------------------------------------------------------------------
def _where(g, v, o, need):
    c = v[0]
    return (None, g.where(c, 0.0) if need[1] else None,
            g.where(c.logical_not(), 0.0) if need[2] else None)


def _clamp(g, v, o, need):
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


def _lerp(g, v, o, need):
    a, e, w = v[0], v[1], v[2]
    return (g * (1.0 - w), g * w, g * (e - a) if need[2] else None)


def _addcmul(g, v, o, need):
    t1, t2, value = v[1], v[2], v[3]
    gv = _alpha(g, value)
    return (g, gv * t2 if need[1] else None, gv * t1 if need[2] else None)


def _addcdiv(g, v, o, need):
    t1, t2, value = v[1], v[2], v[3]
    gv = _alpha(g, value) / t2
    return (g, gv if need[1] else None, -(gv * t1 / t2) if need[2] else None)


TERNARY = {
    "where": _bw(_where, ("condition",)),
    "clamp": _bw(_clamp, ("input", "min", "max")),
    "lerp": _bw(_lerp, ("input", "end", "weight")),
    "addcmul": _bw(_addcmul, ("tensor1", "tensor2")),
    "addcdiv": _bw(_addcdiv, ("tensor1", "tensor2")),
}
TERNARY["clip"] = TERNARY["clamp"]


# -- reductions -----------------------------------------------------------------------------------
def _dims(op, dim, ndim):
    return tuple(sorted(norm_dims(op, dim, ndim))) if ndim else ()


def _back(g, shape, dims, keepdim):
    """``g`` (a reduction's output gradient) with the reduced ``dims`` put back, expanded
    to ``shape``."""
    if not keepdim:
        for d in dims:
            g = g.unsqueeze(d)
    return g.expand(shape)


def _count(shape, dims):
    n = 1
    for d in dims:
        n *= shape[d]
    return n


def _sum(g, v, o, need):
    x, dim, keepdim = v[0], v[1], v[2]
    return (_back(g, x.shape, _dims("sum", dim, x.ndim), keepdim),)


def _mean(g, v, o, need):
    x, dim, keepdim = v[0], v[1], v[2]
    dims = _dims("mean", dim, x.ndim)
    return (_back(g, x.shape, dims, keepdim) / max(_count(x.shape, dims), 1),)


def _prod(g, v, o, need):
    x, dim, keepdim = v[0], v[1], v[2]
    dims = _dims("prod", dim, x.ndim)
    # Note: divides by the input (inf/nan gradients where an input is 0)
    return (_back(g * o, x.shape, dims, keepdim) / x,)


def _selected(g, x, o, dims, keepdim):
    """The gradient of a value-selecting reduction (amax...): split evenly between the
    elements equal to the result."""
    mask = (x == _back(o, x.shape, dims, keepdim)).to(g.dtype)
    return _back(g, x.shape, dims, keepdim) * mask / mask.sum(dim=dims, keepdim=True)


def _extreme(name):
    def fn(g, v, o, need):
        x, dim, keepdim = v[0], v[1], v[2]
        if name in ("max", "min"):
            if _is_tensor(dim):  # max(input, other): the elementwise op
                raise AutogradError(f"{name}(input, other): use {name}imum to differentiate")
            g = g[0]  # of the values (max(input, dim) also returns the indices)
            if g is None:
                return (None,)
            dims = _dims(name, dim, x.ndim) if dim is not None else tuple(range(x.ndim))
            return (_selected(g, x, o, dims, keepdim if dim is not None else False),)
        return (_selected(g, x, o, _dims(name, dim, x.ndim), keepdim),)
    return fn


def _correction(unbiased, correction):
    if correction is not None:
        return correction
    return 0 if unbiased is False else 1


def _var(g, v, o, need):
    x, dim, unbiased, keepdim, correction = v
    dims = _dims("var", dim, x.ndim)
    n = _count(x.shape, dims) - _correction(unbiased, correction)
    centered = x - x.mean(dim=dims, keepdim=True)
    return (_back(g, x.shape, dims, keepdim) * centered * (2.0 / n),)


def _std(g, v, o, need):
    x, dim, unbiased, keepdim, correction = v
    dims = _dims("std", dim, x.ndim)
    n = _count(x.shape, dims) - _correction(unbiased, correction)
    centered = x - x.mean(dim=dims, keepdim=True)
    return (_back(g / o, x.shape, dims, keepdim) * centered * (1.0 / n),)


def _logsumexp(g, v, o, need):
    x, dim, keepdim = v[0], v[1], v[2]
    dims = _dims("logsumexp", dim, x.ndim)
    return (_back(g, x.shape, dims, keepdim) * (x - _back(o, x.shape, dims, keepdim)).exp(),)


def _norm(g, v, o, need):
    x, p, dim, keepdim = v[0], v[1], v[2], v[3]
    dims = _dims("norm", dim, x.ndim)
    gb = _back(g, x.shape, dims, keepdim)
    ob = _back(o, x.shape, dims, keepdim)
    if p in ("fro", 2, 2.0, None):
        return ((gb * x / ob).where(ob != 0, 0.0),)
    if p == 1:
        return (gb * x.sign(),)
    if p in (math.inf, -math.inf):
        return (_selected(g, x.abs(), o, dims, keepdim) * x.sign(),)
    if not isinstance(p, (int, float)):
        raise AutogradError(f"norm: the derivative for p={p!r} is not implemented")
    ax = x.abs()
    return ((gb * x.sign() * ax ** (p - 1) / ob ** (p - 1)).where(ob != 0, 0.0),)


def _cumprod(g, v, o, need):
    x, dim = v[0], v[1]
    if not x.ndim:
        return (g,)
    d = norm_dim(dim, x.ndim, "cumprod")
    # Note: divides by the input (inf/nan gradients where an input is 0), as prod
    return ((g * o).flip(d).cumsum(d).flip(d) / x,)


def _cumsum(g, v, o, need):
    x, dim = v[0], v[1]
    d = norm_dim(dim, x.ndim, "cumsum") if x.ndim else 0
    if not x.ndim:
        return (g,)
    return (g.flip(d).cumsum(d).flip(d),)


REDUCTION = {
    "sum": _bw(_sum),
    "mean": _bw(_mean),
    "prod": _bw(_prod, ("input",), out=True),
    "amax": _bw(_extreme("amax"), ("input",), out=True),
    "amin": _bw(_extreme("amin"), ("input",), out=True),
    "max": _bw(_extreme("max"), ("input",), out=True, multi=True),
    "min": _bw(_extreme("min"), ("input",), out=True, multi=True),
    "var": _bw(_var, ("input",)),
    "std": _bw(_std, ("input",), out=True),
    "logsumexp": _bw(_logsumexp, ("input",), out=True),
    "norm": _bw(_norm, ("input",), out=True),
    "cumsum": _bw(_cumsum),
    "cumprod": _bw(_cumprod, ("input",), out=True),
}
for _name in ("argmax", "argmin", "any", "all", "count_nonzero"):
    REDUCTION[_name] = NOT_DIFFERENTIABLE


# -- products -------------------------------------------------------------------------------------
def _matmul(g, v, o, need):
    a, b = v[0], v[1]
    if a.ndim == 1 and b.ndim == 1:
        return (g * b if need[0] else None, g * a if need[1] else None)
    a1 = a.unsqueeze(0) if a.ndim == 1 else a
    b1 = b.unsqueeze(-1) if b.ndim == 1 else b
    g1 = g.unsqueeze(-2) if a.ndim == 1 else g
    g1 = g1.unsqueeze(-1) if b.ndim == 1 else g1
    ga = gb = None
    if need[0]:
        ga = g1 @ b1.mT
        ga = ga.squeeze(-2) if a.ndim == 1 else ga
    if need[1]:
        gb = a1.mT @ g1
        gb = gb.squeeze(-1) if b.ndim == 1 else gb
    return (ga, gb)


def _outer(g, v, o, need):
    a, b = v[0], v[1]
    return (g @ b if need[0] else None, a @ g if need[1] else None)


def _addmm(g, v, o, need):
    m1, m2, beta, alpha = v[1], v[2], v[3], v[4]
    return (
        _alpha(g, beta) if need[0] else None,
        _alpha(g @ m2.mT, alpha) if need[1] else None,
        _alpha(m1.mT @ g, alpha) if need[2] else None,
    )


def _linear(g, v, o, need):
    x, w = v[0], v[1]
    gx = g @ w if need[0] else None
    gw = None
    if need[1]:
        g2 = g.reshape(-1, w.shape[0])
        x2 = x.reshape(-1, w.shape[1])
        gw = g2.mT @ x2
    return (gx, gw, g if need[2] else None)


def _einsum_letters(equation, ndims):
    """``equation``'s terms and output with ``...`` spelled out in fresh letters (right
    aligned, as numpy broadcasts them) and the implicit output made explicit; and an
    iterator of further unused letters."""
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    fresh = (c for c in string.ascii_letters if c not in eq)
    spans = [nd - (len(t) - 3) if "..." in t else 0 for t, nd in zip(terms, ndims)]
    ell = "".join(next(fresh) for _ in range(max(spans, default=0)))
    terms = [t.replace("...", ell[len(ell) - k:]) if "..." in t else t
             for t, k in zip(terms, spans)]
    if arrow:
        rhs = rhs.replace("...", ell)
    else:  # the broadcast dims, then the letters that occur once, sorted
        rhs = ell + "".join(sorted(c for c in set(lhs) if c.isalpha() and lhs.count(c) == 1))
    return terms, rhs, fresh


def _eye(n, like):
    """The ``n`` x ``n`` identity in ``like``'s dtype (on its mesh, Replicate)."""
    ar = _arange(n, like)
    return (ar.unsqueeze(-1) == ar).to(like.dtype)


def _einsum(g, v, o, need):
    equation, operands = v[0], list(v[1])
    terms, rhs, fresh = _einsum_letters(equation, [x.ndim for x in operands])
    out = []
    for i, (term, x) in enumerate(zip(terms, operands)):
        if not need[i]:
            out.append(None)
            continue
        others = [t for j, t in enumerate(terms) if j != i]
        avail = set(rhs).union(*others)
        uniq = "".join(dict.fromkeys(term))  # a repeated letter once (its diagonal)
        sizes = {c: x.shape[p] for p, c in enumerate(term)}
        spec = ",".join([rhs, *others]) + "->" + "".join(c for c in uniq if c in avail)
        gi = F["einsum"](spec, g, *[operands[j] for j in range(len(terms)) if j != i])
        for pos, c in enumerate(uniq):
            if c not in avail:  # summed by the forward: every element gets the gradient
                gi = gi.unsqueeze(pos)
            elif sizes[c] == 1 and gi.shape[pos] != 1:  # broadcast by the forward
                gi = gi.sum(dim=pos, keepdim=True)
        gi = gi.expand(tuple(sizes[c] for c in uniq))
        if uniq != term:  # put the gradient on the diagonal of each repeated letter
            seen, full, eyes = set(), "", []
            for c in term:
                if c in seen:
                    f = next(fresh)
                    eyes.append(c + f)
                    full += f
                else:
                    seen.add(c)
                    full += c
            spec = ",".join([uniq, *eyes]) + "->" + full
            gi = F["einsum"](spec, gi, *[_eye(sizes[e[0]], g) for e in eyes])
        out.append(gi)
    return tuple(out)


PRODUCT = {
    "matmul": _bw(_matmul, ("input", "other")),
    "mm": _bw(_matmul, ("input", "mat2")),
    "bmm": _bw(_matmul, ("input", "mat2")),
    "dot": _bw(_matmul, ("input", "other")),
    "outer": _bw(_outer, ("input", "vec2")),
    "addmm": _bw(_addmm, ("mat1", "mat2")),
    "linear": _bw(_linear, ("input", "weight")),
    "einsum": _bw(_einsum, ("operands",)),
}


# -- views, joins, copies -------------------------------------------------------------------------
def _like_input(g, v, o, need):
    return (g.reshape(v[0].shape),)


def _permute(g, v, o, need):
    x, dims = v[0], v[1]
    dims = [norm_dim(d, x.ndim, "permute") for d in dims]
    inv = [0] * len(dims)
    for i, d in enumerate(dims):
        inv[d] = i
    return (g.permute(*inv),)


def _zeros(x):
    return F["zeros_like"](x)


def _embed(g, x, dim, start):
    """``g`` placed at ``start`` along ``dim`` of a zero gradient shaped like ``x``."""
    d = norm_dim(dim, x.ndim, "narrow")
    n = g.shape[d]
    parts = []
    if start:
        parts.append(_zeros(x.narrow(d, 0, start)))
    parts.append(g)
    rest = x.shape[d] - start - n
    if rest:
        parts.append(_zeros(x.narrow(d, start + n, rest)))
    return F["cat"](parts, d) if len(parts) > 1 else g


def _narrow(g, v, o, need):
    x, dim, start = v[0], v[1], v[2]
    d = norm_dim(dim, x.ndim, "narrow")
    start = start + x.shape[d] if start < 0 else start
    return (_embed(g, x, d, start),)


def _select(g, v, o, need):
    x, dim, index = v[0], v[1], v[2]
    d = norm_dim(dim, x.ndim, "select")
    index = index + x.shape[d] if index < 0 else index
    return (_embed(g.unsqueeze(d), x, d, index),)


def _getitem(g, v, o, need):
    x, idx = v[0], v[1]
    if isinstance(x, Tensor) and not g.requires_grad:  # (numpy: not recorded)
        z = x.new_zeros(x.shape)
        index, basic, _ = x._index(idx, "__getitem__")
        if basic:
            z._arr[index] = g._arr
        else:
            np.add.at(z._arr, index, g._arr)
        return (z,)
    items = idx if type(idx) is tuple else (idx,)
    if any(not (type(i) is int or i is None or i is Ellipsis or (type(i) is slice and (
            i.step in (None, 1)))) for i in items):
        return (_getitem_put(g, x, items, idx),)
    return (_getitem_dtensor(g, x, idx),)


def _index_values(i):
    """An index entry's values as a numpy array (a DTensor's when Replicate: every rank
    holds them), or None (a DTensor laid out otherwise)."""
    if isinstance(i, DTensor):
        if any(not p.is_replicate() for p in i.placements):
            return None
        i = i.to_local()
    if isinstance(i, Tensor):
        return i.numpy()
    return np.asarray(i)


def _getitem_put(g, x, items, idx):
    """The gradient of an index with stepped slices, masks or integer arrays: ``g``
    written at the index into zeros (a recorded ``setitem``). Integer arrays that name
    one element twice (read there twice) add up instead: one array along one dim as
    ``index_select``'s gradient; otherwise refused."""
    z = F["zeros_like"](x)
    arrays = []  # (position in items, dim of x, values) of the integer array entries
    dim = 0
    consumed = sum(_index_dims(i) for i in items)
    for k, i in enumerate(items):
        if i is Ellipsis:
            dim += x.ndim - consumed
            continue
        if not (i is None or type(i) in (int, slice, bool)) and _index_kind(i)[0] != "b":
            arrays.append((k, dim, _index_values(i)))
        dim += _index_dims(i)
    if arrays:
        known = [vals for _, _, vals in arrays if vals is not None]
        if len(known) != len(arrays):
            raise AutogradError(
                f"getitem: the derivative of index {idx!r} is not implemented (an integer "
                "DTensor index that is not Replicate)"
            )
        keys = np.stack([(b % x.shape[d]).ravel() for b, (_, d, _) in
                         zip(np.broadcast_arrays(*known), arrays)])
        if np.unique(keys, axis=1).shape[1] != keys.shape[1]:
            k, d, vals = arrays[0]
            whole = all(i is Ellipsis or type(i) is slice and i == slice(None)
                        for j, i in enumerate(items) if j != k)
            if len(arrays) != 1 or vals.ndim != 1 or not whole:
                raise AutogradError(
                    f"getitem: the derivative of index {idx!r}, which names an element "
                    "twice, is not implemented (one integer array along one dim is)"
                )
            index = items[k]
            if isinstance(x, DTensor) and not isinstance(index, DTensor):
                mesh = x.device_mesh
                index = distribute_tensor(np.array(vals), mesh, [Replicate()] * mesh.ndim,
                                          src_data_rank=None)
            elif not isinstance(index, (Tensor, DTensor)):
                index = from_numpy(np.array(vals))
            return _spread(x, d, _along(index, d, g.shape), g)
    try:
        z[idx] = g
    except ShardingError:  # (raised on every rank alike: the rule decides)
        mesh = x.device_mesh  # no strategy writes the index into x's layout: Replicate
        z = F["zeros"](tuple(x.shape), dtype=x.dtype, device_mesh=mesh,
                       placements=[Replicate()] * mesh.ndim)
        z[idx] = g
    return z


def _index_dims(i):
    """How many dims of the indexed tensor an index entry consumes."""
    if i is None or i is Ellipsis or type(i) is bool:
        return 0
    if type(i) in (int, slice):
        return 1
    kind, ndim = _index_kind(i)
    return ndim if kind == "b" else 1


def _index_kind(i):
    """(dtype kind, ndim) of an array-like index entry."""
    if not hasattr(i, "dtype"):
        i = np.asarray(i)
    return i.dtype.kind, i.ndim


def _getitem_dtensor(g, x, idx):
    """The gradient of a basic index (ints, slices of step 1, None, one Ellipsis) of a
    DTensor, or of a Tensor under ``create_graph``, undone dim by dim with select/narrow
    backwards (table ops)."""
    items = idx if type(idx) is tuple else (idx,)
    consumed = sum(1 for i in items if i is not None and i is not Ellipsis)
    steps = []  # (kind, input dim, output dim, start) over the input's dims
    src = dst = 0
    for i in items:
        if i is Ellipsis:
            span = x.ndim - consumed
            src += span
            dst += span
        elif i is None:
            steps.append(("new", None, dst, 0))
            dst += 1
        elif type(i) is int:
            steps.append(("int", src, dst, i % x.shape[src]))
            src += 1
        else:
            start, stop, _ = i.indices(x.shape[src])
            steps.append(("slice", src, dst, start, max(stop - start, 0)))
            src += 1
            dst += 1
    # remove the new dims (from the last), put back the int dims (in order), then embed
    for s in reversed(steps):
        if s[0] == "new":
            g = g.squeeze(s[2])
    for s in steps:
        if s[0] == "int":
            g = g.unsqueeze(s[1])
    # embed the last indexed dim first, each into the part of x the earlier indexed dims
    # select (so that the zero pieces have the gradient's extent in those dims)
    picked = [(s[1], s[3], 1 if s[0] == "int" else s[4]) for s in steps if s[0] != "new"]
    for j in reversed(range(len(picked))):
        ref = x
        for d, start, n in picked[:j]:
            ref = ref.narrow(d, start, n)
        g = _embed(g, ref, picked[j][0], picked[j][1])
    return g


def _pieces(x, v_split, dim, name):
    """The views ``x`` was cut into by split/chunk/unbind (for zero gradients)."""
    return getattr(x, name)(*v_split, dim) if name != "unbind" else x.unbind(dim)


def _split_like(name):
    def fn(grads, v, o, need):
        x = v[0]
        dim = v[-1]
        parts = _pieces(x, v[1:-1], dim, name)
        gs = [g if g is not None else _zeros(p) for g, p in zip(grads, parts)]
        d = norm_dim(dim, x.ndim, name)
        return (F["stack"](gs, d) if name == "unbind" else F["cat"](gs, d),)
    return _bw(fn, multi=True)


def _cat(g, v, o, need):
    tensors, dim = list(v[0]), v[1]
    ref = next(t for t in tensors if _is_tensor(t) and t.ndim)
    d = norm_dim(dim, ref.ndim, "cat")
    sizes = [t.shape[d] if t.ndim else 0 for t in tensors]
    pieces = g.split(sizes, d)
    return tuple(p if n else None for p, n in zip(pieces, need))


def _stack(g, v, o, need):
    tensors, dim = list(v[0]), v[1]
    d = norm_dim(dim, tensors[0].ndim + 1, "stack")
    return tuple(g.unbind(d))


def _roll(g, v, o, need):
    shifts, dims = v[1], v[2]
    neg = -shifts if isinstance(shifts, int) else tuple(-s for s in shifts)
    return (g.roll(neg, dims),)


def _repeat(g, v, o, need):
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


_IDENTITY = _bw(lambda g, v, o, n: (g,))
_FIRST = _bw(lambda g, v, o, n: (g, None))

VIEW = {
    "view": _bw(_like_input),
    "reshape": _bw(_like_input),
    "expand": _IDENTITY,  # the recorder sums the gradient down to the input's shape
    "expand_as": _FIRST,
    "flatten": _bw(_like_input),
    "unflatten": _bw(_like_input),
    "permute": _bw(_permute),
    "transpose": _bw(lambda g, v, o, n: (g.transpose(v[1], v[2]),)),
    "t": _bw(lambda g, v, o, n: (g.t(),)),
    "movedim": _bw(lambda g, v, o, n: (g.movedim(v[2], v[1]),)),
    "squeeze": _bw(_like_input),
    "unsqueeze": _bw(_like_input),
    "narrow": _bw(_narrow),
    "select": _bw(_select),
    "getitem": _bw(_getitem),
    "split": _split_like("split"),
    "chunk": _split_like("chunk"),
    "unbind": _split_like("unbind"),
}
for _a, _b in (("swapaxes", "transpose"), ("swapdims", "transpose"), ("moveaxis", "movedim")):
    VIEW[_a] = VIEW[_b]

JOIN = {
    "cat": _bw(_cat),
    "concat": _bw(_cat),
    "stack": _bw(_stack),
    "flip": _bw(lambda g, v, o, n: (g.flip(v[1]),)),
    "roll": _bw(_roll),
    "tril": _bw(lambda g, v, o, n: (g.tril(v[1]),)),
    "triu": _bw(lambda g, v, o, n: (g.triu(v[1]),)),
    "repeat": _bw(_repeat),
    "tile": _bw(_repeat),
    # casts: the recorder casts the gradient back to the input's dtype
    "to": _IDENTITY,
    "type_as": _FIRST,
    "float": _IDENTITY,
    "double": _IDENTITY,
    "half": _IDENTITY,
    "clone": _IDENTITY,
    "contiguous": _IDENTITY,
    "detach": NOT_DIFFERENTIABLE,
    "copy_": _bw(lambda g, v, o, n: (None, g)),
    "fill_": _bw(lambda g, v, o, n: (None, g.sum() if n[1] else None)),
    "zero_": _bw(lambda g, v, o, n: (None,)),
}
for _name in ("int", "long", "short", "char", "byte", "bool"):
    JOIN[_name] = NOT_DIFFERENTIABLE


# -- nn -------------------------------------------------------------------------------------------
def _softmax(g, v, o, need):
    dim = v[1]
    return (o * (g - (g * o).sum(dim=dim, keepdim=True)),)


def _log_softmax(g, v, o, need):
    dim = v[1]
    return (g - o.exp() * g.sum(dim=dim, keepdim=True),)


def _layer_norm(g, v, o, need):
    x, normalized_shape, w, eps = v[0], v[1], v[2], v[4]
    k = 1 if isinstance(normalized_shape, int) else len(tuple(normalized_shape))
    dims = tuple(range(x.ndim - k, x.ndim))
    mu = x.mean(dim=dims, keepdim=True)
    xc = x - mu
    rstd = ((xc * xc).mean(dim=dims, keepdim=True) + eps).rsqrt()
    xhat = xc * rstd
    gxhat = g * w if w is not None else g
    gx = None
    if need[0]:
        gx = rstd * (gxhat - gxhat.mean(dim=dims, keepdim=True)
                     - xhat * (gxhat * xhat).mean(dim=dims, keepdim=True))
    gw = g * xhat if need[1] else None
    return (gx, gw, g if need[2] else None)


def _arange(n, like):
    """``arange(n)`` on ``like``'s mesh (Replicate) or as a local tensor."""
    if isinstance(like, DTensor):
        mesh = like.device_mesh
        return F["arange"](n, device_mesh=mesh, placements=[Replicate()] * mesh.ndim)
    return F["arange"](n)


def _one_hot(idx, n, dtype, class_dim):
    """A float one-hot of the integer ``idx`` over ``n`` classes, classes at ``class_dim``."""
    ar = _arange(n, idx)
    hot = idx.unsqueeze(-1) == ar
    if class_dim != hot.ndim - 1:
        hot = hot.movedim(-1, class_dim)
    return hot.to(dtype)


def _embedding(g, v, o, need):
    idx, w, padding_idx = v[0], v[1], v[2]
    n, d = w.shape
    hot = _one_hot(idx, n, g.dtype, idx.ndim)
    if padding_idx is not None:
        keep = (_arange(n, idx) != (padding_idx % n)).to(g.dtype)
        hot = hot * keep
    return (None, hot.reshape(-1, n).mT @ g.reshape(-1, d))


def _cross_entropy(g, v, o, need):
    x, target, weight = v[0], v[1], v[2]
    ignore_index, reduction, smoothing = v[3], v[4], v[5]
    cdim = 0 if x.ndim == 1 else 1
    c = x.shape[cdim]
    p = x.softmax(cdim)
    wshape = [1] * x.ndim
    wshape[cdim] = c
    wb = weight.reshape(wshape) if weight is not None else None
    if target.dtype.kind in "fc":  # class probabilities
        q = target * (1.0 - smoothing) + smoothing / c if smoothing else target
        a = q * wb if wb is not None else q
        denom = x.numel() // c if reduction == "mean" else 1
    else:
        valid = (target != ignore_index).to(x.dtype)
        safe = target.where(target != ignore_index, 0)
        hot = _one_hot(safe, c, x.dtype, cdim)
        a = hot * (1.0 - smoothing) + smoothing / c if smoothing else hot
        if wb is not None:
            a = a * wb
            wt = (hot * wb).sum(dim=cdim)
        else:
            wt = None
        a = a * valid.unsqueeze(cdim)
        if reduction == "mean":
            denom = (wt * valid).sum() if wt is not None else valid.sum()
        else:
            denom = 1
    grad = p * a.sum(dim=cdim, keepdim=True) - a
    if reduction == "none":
        grad = grad * g.unsqueeze(cdim)
    else:
        grad = grad * (g / denom)
    return (grad, None, None)


def _mse(g, v, o, need):
    x, t, reduction = v[0], v[1], v[2]
    d = (x - t) * 2.0
    if reduction == "mean":
        d = d * (g / max(x.numel(), 1))
    else:
        d = d * g
    return (d if need[0] else None, -d if need[1] else None)


def _dropout(g, v, state, need):
    x, p, training = v[0], v[1], v[2]
    now = get_rng_state()
    set_rng_state(state)  # the same random numbers: the same mask
    try:
        mask = F["dropout"](F["ones_like"](x), p, training)
    finally:
        set_rng_state(now)
    return (g * mask,)


NN = {
    "softmax": _bw(_softmax, out=True),
    "log_softmax": _bw(_log_softmax, out=True),
    "layer_norm": _bw(_layer_norm, ("input", "weight")),
    "embedding": _bw(_embedding, ("input",)),
    "cross_entropy": _bw(_cross_entropy, ("input", "target", "weight")),
    "mse_loss": _bw(_mse, ("input", "target")),
    "dropout": _bw(_dropout, rng=True),
}


# -- indexing ---------------------------------------------------------------------------------
def _spread(x, dim, index, g):
    """The gradient of a gather of ``x`` along ``dim`` at ``index`` (of ``g``'s shape): ``g``
    added back at the gathered positions, zeros elsewhere."""
    return F["zeros_like"](x).scatter_add(dim, index, g)


def _along(index, dim, shape):
    """A 1-D ``index`` along ``dim`` as a full index of ``shape`` (``index_select``'s)."""
    view = [1] * len(shape)
    view[dim] = -1
    return index.reshape(view).expand(shape)


def _index_select(g, v, o, need):
    x, dim, index = v
    d = norm_dim(dim, x.ndim) if x.ndim else 0
    return (_spread(x, d, _along(index, d, g.shape), g) if x.ndim else g, None)


def _take_along_dim(g, v, o, need):
    x, index, dim = v
    if dim is None:  # along the flattened input
        flat = _spread(x.reshape(-1), 0, index.reshape(-1), g.reshape(-1))
        return (flat.reshape(x.shape), None)
    d = norm_dim(dim, x.ndim)
    shape = list(g.shape)
    return (_spread(x, d, index.expand(shape), g), None)


def _winners(x, dim, index):
    """Where several entries of ``index`` name one position, the entry whose value a
    scatter into ``x`` keeps (the kernel's last write): a bool tensor of ``index``'s shape,
    True for the entries whose value survives. Every rank builds the same entry numbers,
    so a DTensor index takes its layout of them without communicating."""
    ids = np.arange(math.prod(index.shape), dtype=np.int64).reshape(tuple(index.shape))
    if isinstance(index, DTensor):
        ids = distribute_tensor(ids, index.device_mesh, index.placements, src_data_rank=None)
    else:
        ids = from_numpy(ids)
    written = F["zeros_like"](x, dtype=np.int64).scatter(dim, index, ids)
    return written.gather(dim, index) == ids


def _scattered(g, dim, index, src, x=None):
    """The gradient of a scatter's ``src``: ``g`` gathered at ``index`` (for a scatter that
    overwrites, ``x`` given: only at the entries whose value was kept), in the leading block
    of ``src``'s shape that the index covers (zeros in the rest)."""
    taken = g.gather(dim, index)
    if x is not None:
        taken = taken.where(_winners(x, dim, index), 0.0)
    if tuple(index.shape) == tuple(src.shape):
        return taken
    z = F["zeros_like"](src)
    z[tuple(slice(0, n) for n in index.shape)] = taken
    return z


def _scatter(g, v, o, need):
    dim, index, src = v[1], v[2], v[3]
    gx = g.scatter(dim, index, 0.0) if need[0] else None  # overwritten: no gradient
    gs = None
    if len(need) > 2 and need[2] and _is_tensor(src):
        gs = _scattered(g, dim, index, src, v[0])
    return (gx, None, gs)


def _scatter_add(g, v, o, need):
    dim, index = v[1], v[2]
    return (g, None, _scattered(g, dim, index, v[3]) if need[2] else None)


def _masked_fill(g, v, o, need):
    mask = v[1]
    gv = g.where(mask, 0.0).sum() if len(need) > 2 and need[2] else None
    return (g.masked_fill(mask, 0.0), None, gv)


def _sort(g, v, o, need):
    """sort(input, dim, descending, stable): the values' gradient back where the sort
    took them from (the indices, computed again from the saved input)."""
    x, dim = v[0], v[1]
    if g[0] is None or not x.ndim:
        return (g[0],)
    return (_spread(x, norm_dim(dim, x.ndim), x.sort(dim, v[2], v[3])[1], g[0]),)


def _topk(g, v, o, need):
    """topk(input, k, dim, largest, sorted): as :func:`_sort`."""
    x, dim = v[0], v[2]
    if g[0] is None or not x.ndim:
        return (g[0],)
    return (_spread(x, norm_dim(dim, x.ndim), x.topk(v[1], dim, v[3], v[4])[1], g[0]),)


def _kthvalue(g, v, o, need):
    """kthvalue(input, k, dim, keepdim): as :func:`_sort`, the reduced dim put back."""
    x, dim = v[0], v[2]
    if g[0] is None or not x.ndim:
        return (g[0],)
    d = norm_dim(dim, x.ndim)
    gv = g[0] if v[3] else g[0].unsqueeze(d)
    return (_spread(x, d, x.kthvalue(v[1], dim, True)[1], gv),)


def _setitem(g, v, o, need):
    idx = v[1]
    gx = None
    if need[0]:
        gx = g.clone()
        gx[idx] = 0.0  # overwritten: no gradient
    gv = g[idx] if len(need) > 1 and need[1] else None
    return (gx, gv)


def _index_add(g, v, o, need):
    """index_add(input, dim, index, source, alpha): the source's rows of the gradient are
    the ones its index added them to."""
    x, dim, index, alpha = v[0], v[1], v[2], v[4]
    gs = None
    if len(need) > 2 and need[2]:
        gs = g.index_select(norm_dim(dim, x.ndim), index) if x.ndim else g
        if alpha != 1:
            gs = gs * alpha
    return (g, None, gs)


def _index_put(g, v, o, need):
    """index_put(input, indices, values, accumulate): as ``x[indices] = values`` (as
    :func:`_setitem`), the input's gradient kept where the values were added."""
    indices, accumulate = v[1], v[3]
    gx = None
    if need[0]:
        gx = g if accumulate else g.index_put(indices, 0.0)  # overwritten: no gradient
    gv = g[index_put_index(indices)] if len(need) > 1 and need[1] else None
    return (gx, gv)


#: The formulas of the indexing ops (:mod:`dtensor.ops.index`), by name.
INDEX = {
    "index_select": _bw(_index_select),
    "gather": _bw(lambda g, v, o, n: (_spread(v[0], norm_dim(v[1], v[0].ndim), v[2], g)
                                      if v[0].ndim else g, None)),
    "take_along_dim": _bw(_take_along_dim),
    "scatter": _bw(_scatter),
    "scatter_add": _bw(_scatter_add),
    "masked_fill": _bw(_masked_fill),
    "sort": _bw(_sort, ("input",), multi=True),
    "argsort": NOT_DIFFERENTIABLE,
    "topk": _bw(_topk, ("input",), multi=True),
    "kthvalue": _bw(_kthvalue, ("input",), multi=True),
    "setitem": _bw(_setitem),
    "index_add": _bw(_index_add),
    "index_put": _bw(_index_put),
}
