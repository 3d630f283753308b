"""Records of the indexing ops: ``index_select``, ``gather``, ``scatter``,
``scatter_add``, ``take_along_dim``, ``masked_fill``, ``sort``, ``argsort``, ``topk``,
``kthvalue``, ``index_add`` and ``index_put`` (functions and methods; ``masked_fill_``,
``scatter_``, ``scatter_add_``, ``index_add_`` and ``index_put_`` in place), and
``x[idx] = value`` (``setitem``). Their rules are :mod:`placements.rules.index`; the ops
that take an index with the data sharded on another dim cut the index to the shard
(:func:`.local_fns.index_local`), the writes through an index and ``index_add`` on a
sharded indexed dim keep the entries that land in the shard
(:func:`.local_fns.write_index_local`, :func:`.local_fns.index_add_local`).
"""

from __future__ import annotations

from ..local.kernels import index as K
from ..local.tensor import Tensor
from .derivatives import INDEX as D
from .local_fns import index_add_local, index_local, write_index_local
from .table import Operator, declare, declare_method

__all__: list[str] = []


def _inplace(fn):
    """The in-place form of an indexing kernel: computes the new values, then writes them
    into ``self`` (every check happens before the write)."""

    def method(self, *args, **kwargs):
        return self.copy_(fn(self, *args, **kwargs))

    method.__name__ = method.__qualname__ = fn.__name__ + "_"
    method.__doc__ = f"In-place :func:`{fn.__name__}` (writes into ``self``). **Local**."
    return method


declare("index_select", K.index_select, ("input", "index"), samples="index",
        backward=D["index_select"])
declare("gather", K.gather, ("input", "index"), local_fn=index_local, samples="index",
        backward=D["gather"])
declare("take_along_dim", K.take_along_dim, ("input", "indices"), local_fn=index_local,
        samples="index", backward=D["take_along_dim"])
for _name in ("scatter", "scatter_add"):
    _fn = getattr(K, _name)
    declare(_name, _fn, ("input", "index", "src"), local_fn=index_local, samples="index",
            backward=D[_name])
    # the in-place form cuts the index to the shard too (a record of its own for that)
    declare(_name + "_", _inplace(_fn), ("input", "index", "src"), local_fn=index_local,
            params=("input", "dim", "index", "src"), function=False, writes=True,
            samples="index", backward=D[_name])
declare("masked_fill", K.masked_fill, ("input", "mask", "value"),
        inplace=_inplace(K.masked_fill), samples="index", backward=D["masked_fill"])
for _name in ("sort", "argsort", "topk", "kthvalue"):
    declare(_name, getattr(K, _name), samples="index", backward=D[_name])


def _index_add_(input: Tensor, dim: int, index: Tensor, source: Tensor, alpha=1) -> Tensor:
    """In-place :func:`index_add` (writes into ``input``). **Local**."""
    return input.copy_(K.index_add(input, dim, index, source, alpha=alpha))


declare("index_add", K.index_add, ("input", "index", "source"), local_fn=index_add_local,
        samples="index", backward=D["index_add"])
declare("index_add_", _index_add_, ("input", "index", "source"), local_fn=index_add_local,
        function=False, writes=True, samples="index", backward=D["index_add"])
# the indices are static (every rank holds them whole, as for x[idx] = value)
declare("index_put", K.index_put, ("input", "values"), local_fn=write_index_local,
        samples="index", backward=D["index_put"])
declare("index_put_", K.index_put_, ("input", "values"), local_fn=write_index_local,
        function=False, writes=True, samples="index", backward=D["index_put"])

def _setitem(input: Tensor, idx: object, value: object) -> Tensor:
    """``input[idx] = value``, returning ``input`` (the op table's kernel form). **Local**."""
    input[idx] = value
    return input


# x[idx] = value: the index is static (every rank holds it whole, as for x[idx])
declare_method("setitem", ("input", "idx", "value"), ("input", "value"), kernel=_setitem,
               writes=True, local_fn=write_index_local, samples="index", backward=D["setitem"],
               operators=(Operator("__setitem__", "method", Tensor.__setitem__),))
