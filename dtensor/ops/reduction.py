"""Records of the reductions and scans (``sum``, ``mean``, ``amax``, ``var``, ``cumsum``...),
with their backward formulas.

Every reduction is a function and a method; its rule (:mod:`placements.rules.reduction`)
reads the reduced dims, ``keepdim`` and (where it has one) the accumulation ``dtype``.
``mean`` and the extrema compute differently on a shard (:mod:`dtensor.ops.shard_kernels`).
"""

from __future__ import annotations

import math

from placements.errors import AutogradError
from placements.meta import dtype_kind, norm_dim, norm_dims

from ..local import kernels as K
from ._grad import is_tensor
from .shard_kernels import extreme_local, mean_local
from .table import NOT_DIFFERENTIABLE, Backward, declare

__all__: list[str] = []


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


def _sum(g, v, o, need, fns):
    x, dim, keepdim = v[0], v[1], v[2]
    return (_back(g, x.shape, _dims("sum", dim, x.ndim), keepdim),)


def _mean(g, v, o, need, fns):
    x, dim, keepdim = v[0], v[1], v[2]
    dims = _dims("mean", dim, x.ndim)
    return (_back(g, x.shape, dims, keepdim) / max(_count(x.shape, dims), 1),)


def _prod(g, v, o, need, fns):
    x, dim, keepdim = v[0], v[1], v[2]
    dims = _dims("prod", dim, x.ndim)
    # Note: divides by the input (inf/nan gradients where an input is 0)
    return (_back(g * o, x.shape, dims, keepdim) / x,)


def _selected(g, x, o, dims, keepdim, nan=False):
    """The gradient of a value-selecting reduction (amax...): split evenly between the
    elements equal to the result (``nan``: a NaN result's between the NaN elements, as
    PyTorch's max/min give it; amax/amin's is NaN there, as PyTorch's)."""
    ob = _back(o, x.shape, dims, keepdim)
    eq = x == ob
    if nan and dtype_kind(x.dtype) == "f":
        eq = eq | (x.isnan() & ob.isnan())
    mask = eq.to(g.dtype)
    return _back(g, x.shape, dims, keepdim) * mask / mask.sum(dim=dims, keepdim=True)


def _extreme(name):
    def fn(g, v, o, need, fns):
        x, dim, keepdim = v[0], v[1], v[2]
        if name in ("max", "min"):
            if is_tensor(dim):  # max(input, other): the elementwise op
                raise AutogradError(f"{name}(input, other): use {name}imum to differentiate")
            g = g[0]  # of the values (max(input, dim) also returns the indices)
            if g is None:
                return (None,)
            dims = _dims(name, dim, x.ndim) if dim is not None else tuple(range(x.ndim))
            return (_selected(g, x, o, dims, keepdim if dim is not None else False, True),)
        return (_selected(g, x, o, _dims(name, dim, x.ndim), keepdim),)
    return fn


def _correction(unbiased, correction):
    if correction is not None:
        return correction
    return 0 if unbiased is False else 1


def _over(c, n):
    """``c / n``, inf where the degrees of freedom ``n`` are 0 (a correction equal to the
    count: PyTorch's double division gives inf there; python's raises)."""
    return c / n if n else math.inf


def _var(g, v, o, need, fns):
    x, dim, unbiased, keepdim, correction = v
    dims = _dims("var", dim, x.ndim)
    n = _count(x.shape, dims) - _correction(unbiased, correction)
    centered = x - x.mean(dim=dims, keepdim=True)
    return (_back(g, x.shape, dims, keepdim) * centered * _over(2.0, n),)


def _std(g, v, o, need, fns):
    x, dim, unbiased, keepdim, correction = v
    dims = _dims("std", dim, x.ndim)
    n = _count(x.shape, dims) - _correction(unbiased, correction)
    centered = x - x.mean(dim=dims, keepdim=True)
    return (_back(g / o, x.shape, dims, keepdim) * centered * _over(1.0, n),)


def _logsumexp(g, v, o, need, fns):
    x, dim, keepdim = v[0], v[1], v[2]
    dims = _dims("logsumexp", dim, x.ndim)
    return (_back(g, x.shape, dims, keepdim) * (x - _back(o, x.shape, dims, keepdim)).exp(),)


def _norm(g, v, o, need, fns):
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


def _cumprod(g, v, o, need, fns):
    x, dim = v[0], v[1]
    if not x.ndim:
        return (g,)
    d = norm_dim(dim, x.ndim, "cumprod")
    # Note: divides by the input (inf/nan gradients where an input is 0), as prod
    return ((g * o).flip(d).cumsum(d).flip(d) / x,)


def _cumsum(g, v, o, need, fns):
    x, dim = v[0], v[1]
    d = norm_dim(dim, x.ndim, "cumsum") if x.ndim else 0
    if not x.ndim:
        return (g,)
    return (g.flip(d).cumsum(d).flip(d),)


_INPUT = ("input",)  # the formula reads the input


def reduction(name: str, backward: Backward, samples: str = "reduce", **kw: object) -> None:
    """Declare the reduction (or scan, ``samples="scan"``) ``name`` over its kernel in
    :mod:`dtensor.local.kernels`, with its formula ``backward`` (compute class ``nn``).
    **Local**."""
    declare(name, getattr(K, name), samples=samples, backward=backward, cost="nn", **kw)


reduction("sum", Backward(_sum), raw="sum")
reduction("prod", Backward(_prod, _INPUT, out=True))
reduction("norm", Backward(_norm, _INPUT, out=True))
reduction("mean", Backward(_mean), local_fn=mean_local, raw="mean")
for _name in ("amax", "amin"):
    reduction(_name, Backward(_extreme(_name), _INPUT, out=True), local_fn=extreme_local,
              raw="extreme")
for _name in ("max", "min"):
    reduction(_name, Backward(_extreme(_name), _INPUT, out=True, multi=True),
              local_fn=extreme_local)
reduction("argmax", NOT_DIFFERENTIABLE)
reduction("argmin", NOT_DIFFERENTIABLE)
reduction("var", Backward(_var, _INPUT))
reduction("std", Backward(_std, _INPUT, out=True))
reduction("any", NOT_DIFFERENTIABLE)
reduction("all", NOT_DIFFERENTIABLE)
reduction("logsumexp", Backward(_logsumexp, _INPUT, out=True))
reduction("count_nonzero", NOT_DIFFERENTIABLE)
reduction("cumsum", Backward(_cumsum), samples="scan")
reduction("cumprod", Backward(_cumprod, _INPUT, out=True), samples="scan")
