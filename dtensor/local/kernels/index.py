"""Indexing kernels: ``index_select``, ``gather``, ``scatter``, ``scatter_add``,
``take_along_dim``, ``masked_fill``, ``sort``, ``argsort``, ``topk``, ``kthvalue``,
``index_add``, ``index_put`` (and ``index_put_``), ``nonzero`` and ``masked_select``.

Argument shapes and dtypes are checked by :mod:`placements.index_meta` (the sharding rules
call the same checks); index values by :func:`placements.index_meta.check_index_values`.
Indices must lie in ``[0, size)`` (PyTorch's gather/scatter family refuses negative ones).
Sorts are stable, so that ties come out in one order on every rank and on every shard.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np

from placements.errors import DTypeError
from placements.index_meta import (
    check_index_values,
    gather_shape,
    index_add_check,
    index_put_check,
    index_select_shape,
    kthvalue_shape,
    masked_fill_check,
    scatter_check,
    sort_dim,
    take_along_dim_shape,
    topk_shape,
)

from ..tensor import Tensor
from .base import SCALAR_TYPES, as_array, broadcast_shapes, cast_scalar, operand, wrap, xp_of

__all__ = [
    "argsort",
    "gather",
    "index_add",
    "index_put",
    "index_put_",
    "index_select",
    "kthvalue",
    "masked_fill",
    "masked_select",
    "nonzero",
    "scatter",
    "scatter_add",
    "sort",
    "take_along_dim",
    "topk",
]

# Results like torch.return_types.sort / topk / kthvalue.
SortResult = namedtuple("sort", ("values", "indices"))
TopkResult = namedtuple("topk", ("values", "indices"))
KthvalueResult = namedtuple("kthvalue", ("values", "indices"))

_INT64 = np.dtype(np.int64)


def _range_check(op: str, idx, dim: int, size: int) -> None:
    if idx.size:
        xp = xp_of(idx)
        check_index_values(op, int(xp.min(idx)), int(xp.max(idx)), dim, size)


def index_select(input: Tensor, dim: int, index: Tensor) -> Tensor:
    """The entries of ``input`` at ``index`` (a vector) along ``dim``. **Local**."""
    a, idx = as_array("index_select", input), as_array("index_select", index)
    _, d = index_select_shape(a.shape, dim, idx.shape, idx.dtype)
    n = a.shape[d] if a.ndim else 1
    _range_check("index_select", idx, d, n)
    if not a.ndim:
        return wrap(a.copy())
    return wrap(xp_of(a).take(a, idx.reshape(-1), axis=d))


def _leading(shape: tuple, dim: int, like: tuple) -> tuple:
    """The slices that cut ``shape`` down to ``like`` on every dim but ``dim``."""
    return tuple(slice(None) if k == dim else slice(0, n) for k, n in enumerate(like))


def gather(input: Tensor, dim: int, index: Tensor) -> Tensor:
    """``out[i][j] = input[index[i][j]][j]`` (for ``dim`` 0), of the index's shape.
    **Local**."""
    a, idx = as_array("gather", input), as_array("gather", index)
    _, d = gather_shape(a.shape, dim, idx.shape, idx.dtype)
    if not a.ndim:
        _range_check("gather", idx, 0, 1)
        return wrap(a.copy())
    _range_check("gather", idx, d, a.shape[d])
    part = a[_leading(a.shape, d, idx.shape)]
    return wrap(xp_of(a).take_along_axis(part, idx.astype(_INT64, copy=False), axis=d))


def _scatter(op: str, input: Tensor, dim: int, index: Tensor, src, add: bool) -> Tensor:
    a, idx = as_array(op, input), as_array(op, index)
    s = operand(op, src)
    scalar = isinstance(s, SCALAR_TYPES)
    d = scatter_check(op, a.shape, a.dtype, dim, idx.shape, idx.dtype,
                      None if scalar else s.shape, None if scalar else s.dtype)
    xp = xp_of(a)
    out = a.copy()
    if not a.ndim:
        _range_check(op, idx, 0, 1)
        if idx.size:
            val = s if scalar else s.reshape(())
            out[()] = out[()] + val if add else val
        return wrap(out)
    _range_check(op, idx, d, a.shape[d])
    if not idx.size:
        return wrap(out)
    vals = cast_scalar(s, a.dtype, op) if scalar else s[_leading(s.shape, -1, idx.shape)]
    where = list(np.ogrid[tuple(slice(0, n) for n in idx.shape)])
    where[d] = idx
    where = tuple(xp.asarray(w) for w in where)
    if add:
        xp.add.at(out, where, xp.broadcast_to(vals, idx.shape))
    else:
        out[where] = vals
    return wrap(out)


def scatter(input: Tensor, dim: int, index: Tensor, src) -> Tensor:
    """A copy of ``input`` with ``out[index[i][j]][j] = src[i][j]`` (for ``dim`` 0);
    ``src`` may be a python scalar. Of duplicate indices the last write wins. **Local**."""
    return _scatter("scatter", input, dim, index, src, add=False)


def scatter_add(input: Tensor, dim: int, index: Tensor, src: Tensor) -> Tensor:
    """A copy of ``input`` with ``out[index[i][j]][j] += src[i][j]`` (for ``dim`` 0),
    duplicates accumulated. **Local**."""
    return _scatter("scatter_add", input, dim, index, src, add=True)


def take_along_dim(input: Tensor, indices: Tensor, dim: int | None = None) -> Tensor:
    """The entries of ``input`` at ``indices`` along ``dim`` (broadcasting the other dims),
    or of the flattened input when ``dim`` is None. **Local**."""
    op = "take_along_dim"
    a, idx = as_array(op, input), as_array(op, indices)
    out_shape, d = take_along_dim_shape(a.shape, idx.shape, idx.dtype, dim)
    xp = xp_of(a)
    if d is None:
        _range_check(op, idx, 0, a.size)
        return wrap(xp.take(a.reshape(-1), idx.reshape(-1)))
    if not a.ndim:
        _range_check(op, idx, 0, 1)
        return wrap(a.copy())
    _range_check(op, idx, d, a.shape[d])
    lead = out_shape[:d] + (a.shape[d],) + out_shape[d + 1 :]
    idx_b = xp.broadcast_to(idx, out_shape).astype(_INT64, copy=False)
    return wrap(xp.take_along_axis(xp.broadcast_to(a, lead), idx_b, axis=d))


def masked_fill(input: Tensor, mask: Tensor, value) -> Tensor:
    """A copy of ``input`` with ``value`` (a scalar or a 0-d tensor) where ``mask``
    (bool, broadcast to the input's shape) holds. **Local**."""
    op = "masked_fill"
    a, m = as_array(op, input), as_array(op, mask)
    v = operand(op, value)
    masked_fill_check(a.shape, m.shape, m.dtype, () if isinstance(v, SCALAR_TYPES) else v.shape)
    if not isinstance(v, SCALAR_TYPES):
        v = v.reshape(()).item()
    out = a.copy()
    xp_of(a).copyto(out, cast_scalar(v, a.dtype, op), where=m)
    return wrap(out)


def _stable_order(a, d: int, descending: bool):
    """Indices that sort ``a`` along ``d`` stably (descending: equal values keep their
    order too; NaN sorts as the largest value, as in PyTorch)."""
    xp = xp_of(a)
    if not descending:
        return xp.argsort(a, axis=d, kind="stable")
    n = a.shape[d]
    rev = xp.flip(xp.argsort(xp.flip(a, axis=d), axis=d, kind="stable"), axis=d)
    return (n - 1) - rev


def sort(input: Tensor, dim: int = -1, descending: bool = False, stable: bool = False):
    """``(values, indices)`` sorted along ``dim`` (always stable). **Local**."""
    a = as_array("sort", input)
    d = sort_dim("sort", a.shape, dim)
    if not a.ndim:
        return SortResult(wrap(a.copy()), wrap(np.zeros((), _INT64)))
    order = _stable_order(a, d, bool(descending)).astype(_INT64, copy=False)
    return SortResult(wrap(xp_of(a).take_along_axis(a, order, axis=d)), wrap(order))


def argsort(input: Tensor, dim: int = -1, descending: bool = False, stable: bool = False):
    """The indices that sort ``input`` along ``dim`` (always stable). **Local**."""
    return sort(input, dim, descending, stable).indices


def topk(input: Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):
    """``(values, indices)`` of the ``k`` largest (or smallest) entries along ``dim``, in
    order (ties: the earlier entry first). **Local**."""
    a = as_array("topk", input)
    _, d = topk_shape(a.shape, k, dim)
    if not a.ndim:
        return TopkResult(wrap(a[()].reshape(()).copy()), wrap(np.zeros((), _INT64)))
    order = _stable_order(a, d, bool(largest))
    order = order[tuple(slice(0, k) if j == d else slice(None) for j in range(a.ndim))]
    order = order.astype(_INT64, copy=False)
    return TopkResult(wrap(xp_of(a).take_along_axis(a, order, axis=d)), wrap(order))


def kthvalue(input: Tensor, k: int, dim: int = -1, keepdim: bool = False):
    """``(values, indices)`` of the ``k``-th smallest entry along ``dim`` (k from 1).
    **Local**."""
    a = as_array("kthvalue", input)
    _, d = kthvalue_shape(a.shape, k, dim, keepdim)
    if not a.ndim:
        return KthvalueResult(wrap(a.copy()), wrap(np.zeros((), _INT64)))
    order = _stable_order(a, d, False)
    pick = order[tuple(slice(k - 1, k) if j == d else slice(None) for j in range(a.ndim))]
    pick = pick.astype(_INT64, copy=False)
    vals = xp_of(a).take_along_axis(a, pick, axis=d)
    if not keepdim:
        vals, pick = vals.squeeze(d), pick.squeeze(d)
    return KthvalueResult(wrap(vals), wrap(pick))


def nonzero(input: Tensor, *, as_tuple: bool = False):
    """The indices of the non-zero entries: an int64 tensor ``(n, ndim)``, or with
    ``as_tuple`` one index vector per dim. **Local**."""
    a = as_array("nonzero", input)
    xp = xp_of(a)
    if as_tuple:
        return tuple(wrap(i.astype(_INT64, copy=False)) for i in xp.nonzero(a))
    return wrap(xp.argwhere(a).astype(_INT64, copy=False))


def masked_select(input: Tensor, mask: Tensor) -> Tensor:
    """The entries of ``input`` where ``mask`` (bool; both broadcast) holds, as a vector.
    **Local**."""
    op = "masked_select"
    a, m = as_array(op, input), as_array(op, mask)
    if m.dtype != np.bool_:
        raise DTypeError(f"{op}: expected a boolean mask, got dtype {m.dtype.name}")
    xp = xp_of(a)
    shape = broadcast_shapes(op, a.shape, m.shape)
    return wrap(xp.broadcast_to(a, shape)[xp.broadcast_to(m, shape)])


def index_add(input: Tensor, dim: int, index: Tensor, source: Tensor, *, alpha=1) -> Tensor:
    """A copy of ``input`` with ``alpha * source[..., i, ...]`` added at ``index[i]`` along
    ``dim`` (duplicates accumulated); ``index`` is a vector of indices in ``[0, size)``,
    ``source`` of the input's shape and dtype but ``len(index)`` along ``dim``. **Local**."""
    op = "index_add"
    a, idx, src = as_array(op, input), as_array(op, index), as_array(op, source)
    d = index_add_check(a.shape, a.dtype, dim, idx.shape, idx.dtype, src.shape, src.dtype)
    _range_check(op, idx, d, a.shape[d] if a.ndim else 1)
    xp = xp_of(a)
    out = a.copy()
    if alpha != 1:
        src = src * cast_scalar(alpha, a.dtype, op)
    if not a.ndim:
        if idx.size:
            out[()] = out[()] + src.reshape(())
        return wrap(out)
    xp.add.at(out, (slice(None),) * d + (idx.reshape(-1),), src)
    return wrap(out)


def index_put_(input: Tensor, indices, values, accumulate: bool = False) -> Tensor:
    """``input[indices] = values`` (``accumulate``: ``+=``, duplicate indices adding up),
    in place; ``indices`` is a tuple of index tensors (integer or bool; None for a whole
    dim), ``values`` a tensor of the input's dtype (or a python scalar) that broadcasts to
    the indexed region. Returns ``input``. **Local**."""
    op = "index_put"
    a = as_array(op, input)
    v = operand(op, values)
    scalar = isinstance(v, SCALAR_TYPES)
    key, region, _, _ = index_put_check(a.shape, a.dtype, indices, () if scalar else v.shape,
                                        None if scalar else v.dtype)
    if not accumulate:
        input[key] = values
        return input
    xp = xp_of(a)
    vals = cast_scalar(v, a.dtype, op) if scalar else v
    xp.add.at(a, input._index(key, op)[0], xp.broadcast_to(vals, region))
    return input


def index_put(input: Tensor, indices, values, accumulate: bool = False) -> Tensor:
    """A copy of ``input`` written as :func:`index_put_` writes it. **Local**."""
    return index_put_(input.clone(), indices, values, accumulate)
