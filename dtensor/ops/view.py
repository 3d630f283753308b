"""Records of the view ops: the Tensor methods ``view``, ``reshape``, ``expand``,
``flatten``, ``permute``, ``transpose``, ``squeeze``, ``narrow``, ``select``, ``x[...]``,
``split``... (defined on the Tensor class; DTensor gets dispatching twins), with their
backward formulas.

Ops whose output shape is a static argument receive the LOCAL output shape on a shard
(:func:`dtensor.ops.shard_kernels.shape_local`). A recorded call of a view op whose output shares
its input's data makes a view for autograd (:data:`VIEWS`, :mod:`dtensor.dispatch.tape`).
"""

from __future__ import annotations

import numpy as np

from placements import Replicate
from placements.errors import AutogradError, ShardingError
from placements.meta import norm_dim

from ..distributed.dtensor import DTensor, distribute_tensor
from ..local.factory import from_numpy
from ..local.tensor import Tensor
from ._grad import FIRST, IDENTITY, along, spread
from .shard_kernels import expand_as_local, getitem_local, shape_local, squeeze_local
from .table import Backward, Operator, declare_method

__all__ = ["VIEWS"]


def _like_input(g, v, o, need, fns):
    return (g.reshape(v[0].shape),)


def _permute(g, v, o, need, fns):
    x, dims = v[0], v[1]
    dims = [norm_dim(d, x.ndim, "permute") for d in dims]
    inv = [0] * len(dims)
    for i, d in enumerate(dims):
        inv[d] = i
    return (g.permute(*inv),)


def _embed(g, x, dim, start, fns):
    """``g`` placed at ``start`` along ``dim`` of a zero gradient shaped like ``x``."""
    d = norm_dim(dim, x.ndim, "narrow")
    n = g.shape[d]
    parts = []
    if start:
        parts.append(fns.zeros_like(x.narrow(d, 0, start)))
    parts.append(g)
    rest = x.shape[d] - start - n
    if rest:
        parts.append(fns.zeros_like(x.narrow(d, start + n, rest)))
    return fns.cat(parts, d) if len(parts) > 1 else g


def _narrow(g, v, o, need, fns):
    x, dim, start = v[0], v[1], v[2]
    d = norm_dim(dim, x.ndim, "narrow")
    start = start + x.shape[d] if start < 0 else start
    return (_embed(g, x, d, start, fns),)


def _select(g, v, o, need, fns):
    x, dim, index = v[0], v[1], v[2]
    d = norm_dim(dim, x.ndim, "select")
    index = index + x.shape[d] if index < 0 else index
    return (_embed(g.unsqueeze(d), x, d, index, fns),)


def _getitem(g, v, o, need, fns):
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
        return (_getitem_put(g, x, items, idx, fns),)
    return (_getitem_dtensor(g, x, idx, fns),)


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


def _getitem_put(g, x, items, idx, fns):
    """The gradient of an index with stepped slices, masks or integer arrays: ``g``
    written at the index into zeros (a recorded ``setitem``). Integer arrays that name
    one element twice (read there twice) add up instead: one array along one dim as
    ``index_select``'s gradient; otherwise refused."""
    z = fns.zeros_like(x)
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
            return spread(x, d, along(index, d, g.shape), g, fns)
    try:
        z[idx] = g
    except ShardingError:  # (raised on every rank alike: the rule decides)
        mesh = x.device_mesh  # no strategy writes the index into x's layout: Replicate
        z = fns.zeros(tuple(x.shape), dtype=x.dtype, device_mesh=mesh,
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


def _getitem_dtensor(g, x, idx, fns):
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
        g = _embed(g, ref, picked[j][0], picked[j][1], fns)
    return g


def _pieces(x, v_split, dim, name):
    """The views ``x`` was cut into by split/chunk/unbind (for zero gradients)."""
    return getattr(x, name)(*v_split, dim) if name != "unbind" else x.unbind(dim)


def _split_like(name):
    def fn(grads, v, o, need, fns):
        x = v[0]
        dim = v[-1]
        parts = _pieces(x, v[1:-1], dim, name)
        gs = [g if g is not None else fns.zeros_like(p) for g, p in zip(grads, parts)]
        d = norm_dim(dim, x.ndim, name)
        return (fns.stack(gs, d) if name == "unbind" else fns.cat(gs, d),)
    return Backward(fn, multi=True)


_VIEWS: list[str] = []


def view(name: str, *args: object, backward: Backward, **kw: object) -> None:
    """Declare the view op ``name`` with its formula ``backward`` (a method the Tensor class
    defines, the validator's view samples unless ``samples`` says otherwise, compute class
    ``view`` unless ``cost`` does). **Local**."""
    declare_method(name, *args, samples=kw.pop("samples", "view"), backward=backward,
                   cost=kw.pop("cost", "view"), **kw)
    _VIEWS.append(name)


_LIKE_INPUT = Backward(_like_input)
for _name in ("view", "reshape"):
    view(_name, ("input", "shape"), local_fn=shape_local("shape"), backward=_LIKE_INPUT,
         raw="view")
# the recorder sums the gradient down to the input's shape
view("expand", ("input", "sizes"), local_fn=shape_local("sizes"), backward=IDENTITY)
view("expand_as", ("input", "other"), tensors=("input", "other"), local_fn=expand_as_local,
     samples="expand_as", cost="pointwise", backward=FIRST)
view("flatten", ("input", "start_dim", "end_dim"),
     defaults={"start_dim": 0, "end_dim": -1}, backward=_LIKE_INPUT)
view("unflatten", ("input", "dim", "sizes"), local_fn=shape_local("sizes"),
     backward=_LIKE_INPUT)
view("permute", ("input", "dims"), backward=Backward(_permute))
_TRANSPOSE = Backward(lambda g, v, o, n, fns: (g.transpose(v[1], v[2]),))
for _name in ("transpose", "swapaxes", "swapdims"):
    view(_name, ("input", "dim0", "dim1"), backward=_TRANSPOSE)
view("t", ("input",), backward=Backward(lambda g, v, o, n, fns: (g.t(),)), raw="t")
_MOVEDIM = Backward(lambda g, v, o, n, fns: (g.movedim(v[2], v[1]),))
for _name in ("movedim", "moveaxis"):
    view(_name, ("input", "source", "destination"), backward=_MOVEDIM)
view("squeeze", ("input", "dim"), defaults={"dim": None}, local_fn=squeeze_local,
     backward=_LIKE_INPUT)
view("unsqueeze", ("input", "dim"), backward=_LIKE_INPUT)
view("narrow", ("input", "dim", "start", "length"), backward=Backward(_narrow))
# index is static so that the rule checks it against the global size (before any
# redistribution); one cache entry per index value
view("select", ("input", "dim", "index"), backward=Backward(_select))
view("getitem", ("input", "idx"), kernel=Tensor.__getitem__, method=False,
     local_fn=getitem_local, operators=(Operator("__getitem__", "method", Tensor.__getitem__),),
     backward=Backward(_getitem), raw="getitem")
view("split", ("input", "split_size_or_sections", "dim"),
     defaults={"dim": 0}, backward=_split_like("split"))
view("chunk", ("input", "chunks", "dim"), defaults={"dim": 0}, backward=_split_like("chunk"))
view("unbind", ("input", "dim"), defaults={"dim": 0}, backward=_split_like("unbind"))

#: The view ops (those declared by :func:`view`): a recorded call whose output shares its
#: input's data makes a view.
VIEWS = frozenset(_VIEWS)
