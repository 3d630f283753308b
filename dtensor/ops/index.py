"""Records of the indexing ops: ``index_select``, ``gather``, ``scatter``,
``scatter_add``, ``take_along_dim``, ``masked_fill``, ``sort``, ``argsort``, ``topk``,
``kthvalue``, ``index_add`` and ``index_put`` (functions and methods; ``masked_fill_``,
``scatter_``, ``scatter_add_``, ``index_add_`` and ``index_put_`` in place), and
``x[idx] = value`` (``setitem``). Their rules are :mod:`placements.rules.index`; the ops
that take an index with the data sharded on another dim cut the index to the shard
(:func:`.shard_kernels.index_local`), the writes through an index and ``index_add`` on a
sharded indexed dim keep the entries that land in the shard
(:func:`.shard_kernels.write_index_local`, :func:`.shard_kernels.index_add_local`). Their backward
formulas are here too.
"""

from __future__ import annotations

import math

import numpy as np

from placements.index_meta import index_put_index
from placements.meta import norm_dim

from ..distributed.dtensor import DTensor, distribute_tensor
from ..local.factory import from_numpy
from ..local.kernels import index as K
from ..local.tensor import Tensor
from ._grad import along, is_tensor, spread
from .shard_kernels import index_add_local, index_local, write_index_local
from .table import NOT_DIFFERENTIABLE, Backward, Operator, declare, declare_method

__all__: list[str] = []


def _index_select(g, v, o, need, fns):
    x, dim, index = v
    d = norm_dim(dim, x.ndim) if x.ndim else 0
    return (spread(x, d, along(index, d, g.shape), g, fns) if x.ndim else g, None)


def _gather(g, v, o, need, fns):
    x, dim, index = v[0], v[1], v[2]
    return (spread(x, norm_dim(dim, x.ndim), index, g, fns) if x.ndim else g, None)


def _take_along_dim(g, v, o, need, fns):
    x, index, dim = v
    if dim is None:  # along the flattened input
        flat = spread(x.reshape(-1), 0, index.reshape(-1), g.reshape(-1), fns)
        return (flat.reshape(x.shape), None)
    d = norm_dim(dim, x.ndim)
    shape = list(g.shape)
    return (spread(x, d, index.expand(shape), g, fns), None)


def _winners(x, dim, index, fns):
    """Where several entries of ``index`` name one position, the entry whose value a
    scatter into ``x`` keeps (the kernel's last write): a bool tensor of ``index``'s shape,
    True for the entries whose value survives. Every rank builds the same entry numbers,
    so a DTensor index takes its layout of them without communicating."""
    ids = np.arange(math.prod(index.shape), dtype=np.int64).reshape(tuple(index.shape))
    if isinstance(index, DTensor):
        ids = distribute_tensor(ids, index.device_mesh, index.placements, src_data_rank=None)
    else:
        ids = from_numpy(ids)
    written = fns.zeros_like(x, dtype=np.int64).scatter(dim, index, ids)
    return written.gather(dim, index) == ids


def _scattered(g, dim, index, src, fns, x=None):
    """The gradient of a scatter's ``src``: ``g`` gathered at ``index`` (for a scatter that
    overwrites, ``x`` given: only at the entries whose value was kept), in the leading block
    of ``src``'s shape that the index covers (zeros in the rest)."""
    taken = g.gather(dim, index)
    if x is not None:
        taken = taken.where(_winners(x, dim, index, fns), 0.0)
    if tuple(index.shape) == tuple(src.shape):
        return taken
    z = fns.zeros_like(src)
    z[tuple(slice(0, n) for n in index.shape)] = taken
    return z


def _scatter(g, v, o, need, fns):
    dim, index, src = v[1], v[2], v[3]
    gx = g.scatter(dim, index, 0.0) if need[0] else None  # overwritten: no gradient
    gs = None
    if len(need) > 2 and need[2] and is_tensor(src):
        gs = _scattered(g, dim, index, src, fns, v[0])
    return (gx, None, gs)


def _scatter_add(g, v, o, need, fns):
    dim, index = v[1], v[2]
    return (g, None, _scattered(g, dim, index, v[3], fns) if need[2] else None)


def _masked_fill(g, v, o, need, fns):
    mask = v[1]
    gv = g.where(mask, 0.0).sum() if len(need) > 2 and need[2] else None
    return (g.masked_fill(mask, 0.0), None, gv)


def _sort(g, v, o, need, fns):
    """sort(input, dim, descending, stable): the values' gradient back where the sort
    took them from (the indices, computed again from the saved input)."""
    x, dim = v[0], v[1]
    if g[0] is None or not x.ndim:
        return (g[0],)
    return (spread(x, norm_dim(dim, x.ndim), x.sort(dim, v[2], v[3])[1], g[0], fns),)


def _topk(g, v, o, need, fns):
    """topk(input, k, dim, largest, sorted): as :func:`_sort`."""
    x, dim = v[0], v[2]
    if g[0] is None or not x.ndim:
        return (g[0],)
    return (spread(x, norm_dim(dim, x.ndim), x.topk(v[1], dim, v[3], v[4])[1], g[0], fns),)


def _kthvalue(g, v, o, need, fns):
    """kthvalue(input, k, dim, keepdim): as :func:`_sort`, the reduced dim put back."""
    x, dim = v[0], v[2]
    if g[0] is None or not x.ndim:
        return (g[0],)
    d = norm_dim(dim, x.ndim)
    gv = g[0] if v[3] else g[0].unsqueeze(d)
    return (spread(x, d, x.kthvalue(v[1], dim, True)[1], gv, fns),)


def _setitem_grad(g, v, o, need, fns):
    idx = v[1]
    gx = None
    if need[0]:
        gx = g.clone()
        gx[idx] = 0.0  # overwritten: no gradient
    gv = g[idx] if len(need) > 1 and need[1] else None
    return (gx, gv)


def _index_add(g, v, o, need, fns):
    """index_add(input, dim, index, source, alpha): the source's rows of the gradient are
    the ones its index added them to."""
    x, dim, index, alpha = v[0], v[1], v[2], v[4]
    gs = None
    if len(need) > 2 and need[2]:
        gs = g.index_select(norm_dim(dim, x.ndim), index) if x.ndim else g
        if alpha != 1:
            gs = gs * alpha
    return (g, None, gs)


def _index_put(g, v, o, need, fns):
    """index_put(input, indices, values, accumulate): as ``x[indices] = values`` (as
    :func:`_setitem_grad`), the input's gradient kept where the values were added."""
    indices, accumulate = v[1], v[3]
    gx = None
    if need[0]:
        gx = g if accumulate else g.index_put(indices, 0.0)  # overwritten: no gradient
    gv = g[index_put_index(indices)] if len(need) > 1 and need[1] else None
    return (gx, gv)


def _inplace(fn):
    """The in-place form of an indexing kernel: computes the new values, then writes them
    into ``self`` (every check happens before the write)."""

    def method(self, *args, **kwargs):
        return self.copy_(fn(self, *args, **kwargs))

    method.__name__ = method.__qualname__ = fn.__name__ + "_"
    method.__doc__ = f"In-place :func:`{fn.__name__}` (writes into ``self``). **Local**."
    return method


declare("index_select", K.index_select, ("input", "index"), samples="index",
        backward=Backward(_index_select))
declare("gather", K.gather, ("input", "index"), local_fn=index_local, samples="index",
        backward=Backward(_gather))
declare("take_along_dim", K.take_along_dim, ("input", "indices"), local_fn=index_local,
        samples="index", backward=Backward(_take_along_dim))
for _name, _formula in (("scatter", _scatter), ("scatter_add", _scatter_add)):
    _fn = getattr(K, _name)
    declare(_name, _fn, ("input", "index", "src"), local_fn=index_local, samples="index",
            backward=Backward(_formula))
    # the in-place form cuts the index to the shard too (a record of its own for that)
    declare(_name + "_", _inplace(_fn), ("input", "index", "src"), local_fn=index_local,
            params=("input", "dim", "index", "src"), function=False, writes=True,
            samples="index", backward=Backward(_formula))
declare("masked_fill", K.masked_fill, ("input", "mask", "value"),
        inplace=_inplace(K.masked_fill), samples="index", backward=Backward(_masked_fill))
declare("sort", K.sort, samples="index", backward=Backward(_sort, ("input",), multi=True))
declare("argsort", K.argsort, samples="index", backward=NOT_DIFFERENTIABLE)
declare("topk", K.topk, samples="index", backward=Backward(_topk, ("input",), multi=True))
declare("kthvalue", K.kthvalue, samples="index",
        backward=Backward(_kthvalue, ("input",), multi=True))
_INDEX_ADD = Backward(_index_add)
_INDEX_PUT = Backward(_index_put)


def _index_add_(input: Tensor, dim: int, index: Tensor, source: Tensor, alpha=1) -> Tensor:
    """In-place :func:`index_add` (writes into ``input``). **Local**."""
    return input.copy_(K.index_add(input, dim, index, source, alpha=alpha))


declare("index_add", K.index_add, ("input", "index", "source"), local_fn=index_add_local,
        samples="index", backward=_INDEX_ADD)
declare("index_add_", _index_add_, ("input", "index", "source"), local_fn=index_add_local,
        function=False, writes=True, samples="index", backward=_INDEX_ADD)
# the indices are static (every rank holds them whole, as for x[idx] = value)
declare("index_put", K.index_put, ("input", "values"), local_fn=write_index_local,
        samples="index", backward=_INDEX_PUT)
declare("index_put_", K.index_put_, ("input", "values"), local_fn=write_index_local,
        function=False, writes=True, samples="index", backward=_INDEX_PUT)


def _setitem(input: Tensor, idx: object, value: object) -> Tensor:
    """``input[idx] = value``, returning ``input`` (the op table's kernel form). **Local**."""
    input[idx] = value
    return input


# x[idx] = value: the index is static (every rank holds it whole, as for x[idx])
declare_method("setitem", ("input", "idx", "value"), ("input", "value"), kernel=_setitem,
               writes=True, local_fn=write_index_local, samples="index",
               backward=Backward(_setitem_grad),
               operators=(Operator("__setitem__", "method", Tensor.__setitem__),))
