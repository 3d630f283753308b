"""The cross-rank check of index arguments: each rank passes its own.

``x[idx]``, ``x[idx] = value`` and ``index_put(x, indices, values)`` take their index as a
static argument that every rank holds whole (a list, an ndarray, a local Tensor, a bool
mask, ints and slices). In an SPMD program it must be the same on every rank; when it is
not, the ranks decide on different output shapes or strategies: a read of a sharded
tensor returns rows that are no rank's answer, a write leaves the replicas different, and
indices of different lengths hang the next collective. This module owns the check that
turns that into a :class:`~placements.errors.CommError` on every rank, before the op
communicates:

- the index's digest (:func:`placements.index_meta.index_digest`: its structure and the
  values of its arrays), with its number of entries and this rank's world rank, is
  all-gathered over the mesh (one small ``all_gather_ints``, which ``CommDebugMode`` and
  the SPMD check see as ``"index digest"``); every rank compares the table and raises when
  a row differs;
- **when** (the cost is one small collective per call, about what an 8-byte all-gather
  costs): always for an index holding an index array (a list, an array or a local tensor:
  ``x[[0, 2]]``, ``x[mask]``), when a DTensor argument of the call is sharded or partial
  on a mesh dim of more than one rank (the op's result then combines the ranks' parts,
  and such a call communicates now or at the next redistribution anyway); for every index
  (ints and slices too, and replicated inputs, whose op is purely local) while the SPMD
  check is on (``DTENSOR_CHECK_SPMD=1``, ``dt.debug.check_spmd()``). Basic indices (ints
  and slices) of a sharded input are not checked otherwise: they are the fast path of
  slicing, served from compiled code. A DTensor inside an index is laid out by its own
  spec (only its spec enters the digest).

A call that is checked is never served from the compiled front's table (its key is not
handed out), so that each call reaches the check.

This module also owns the index arguments that are not static lists or arrays:

- a DTensor inside the index of ``x[idx]``, ``x[idx] = value`` or ``index_put`` (a mask
  ``x > 0``, an integer index) is gathered (its ``full_tensor()``, **Collective**, as
  ``nonzero`` gathers) and indexes as the local tensor of its values
  (:func:`gather_dtensor_index`); ``x[mask] = scalar`` with a bool DTensor mask over the
  leading dims of ``x`` is ``x.masked_fill_(mask, scalar)`` instead, which moves nothing
  when the mask is laid out like ``x`` (:func:`mask_fill`);
- a local tensor (or ndarray) as the index of ``index_select``, ``gather``,
  ``take_along_dim``, ``scatter(_add)(_)`` and ``index_add(_)`` on a DTensor is taken as a
  Replicate DTensor of the same values, as ``x[idx]`` takes it, after the check above
  (:func:`replicate_local_index`).
"""

from __future__ import annotations

import numpy as np

from placements.errors import CommError
from placements.index_meta import index_digest
from placements.meta import is_advanced_entry
from placements.spec import DTensorSpec
from placements.types import Replicate, placement_list
from redistribute.comm import HOOKS

from ..distributed.abstract import AbstractMesh
from ..distributed.dtensor import DTensor
from ..local.tensor import Tensor, wrap_array

__all__ = [
    "INDEX_PARAMS",
    "INDEX_TENSOR_PARAMS",
    "check_index_args",
    "gather_dtensor_index",
    "mask_fill",
    "replicate_local_index",
]

#: The ops whose index argument is checked, and the name of that parameter.
INDEX_PARAMS = {"getitem": "idx", "setitem": "idx", "index_put": "indices",
                "index_put_": "indices"}
#: The ops whose index is a tensor parameter that may be a local tensor (replicated).
INDEX_TENSOR_PARAMS = {
    "index_select": "index", "gather": "index", "take_along_dim": "indices",
    "scatter": "index", "scatter_": "index", "scatter_add": "index", "scatter_add_": "index",
    "index_add": "index", "index_add_": "index",
}


def _host_array(v: object) -> np.ndarray | None:
    """The values of a local tensor index on the host (None for anything else)."""
    if isinstance(v, Tensor) and not isinstance(v, DTensor):
        arr = v._arr
        return arr if isinstance(arr, np.ndarray) else arr.get()
    return None


_BASIC = frozenset((int, slice, type(None), type(Ellipsis)))


def _rank_local_arrays(index: object) -> bool:
    """Whether ``index`` holds an index array that each rank passes itself (not a DTensor)."""
    if type(index) is tuple:
        return any(type(e) not in _BASIC and is_advanced_entry(e) and not isinstance(e, DTensor)
                   for e in index)
    return type(index) not in _BASIC and is_advanced_entry(index) and not isinstance(
        index, DTensor)


def _spread(args: list) -> bool:
    """Whether a DTensor among ``args`` is sharded or partial on a mesh dim of size > 1."""
    for a in args:
        if isinstance(a, DTensor):
            spec = a._spec
            shape = spec.mesh.shape
            if any(not p.is_replicate() and shape[m] > 1 for m, p in enumerate(spec.placements)):
                return True
    return False


def check_index_args(op: str, index: object, args: list, mesh: object) -> bool:
    """Check that every rank of ``mesh`` passed the same ``index`` to ``op`` (see the module
    docstring for when); returns whether it checked. **Collective** over ``mesh`` when it
    checks, Local otherwise.

    Parameters
    ----------
    op : str
        The op (``getitem``, ``setitem``, ``index_put``, ``index_put_``).
    index : object
        Its index argument.
    args : list
        Its tensor-like arguments (DTensors decide whether the call is checked).
    mesh : DeviceMesh

    Raises
    ------
    CommError
        On every rank of the mesh, when some rank's index differs: the message names the
        op, this rank's index, and each rank's digest and number of index entries.
    """
    if not HOOKS.spmd and not (_rank_local_arrays(index) and _spread(args)):
        return False
    if isinstance(mesh, AbstractMesh) or mesh.size() == 1:
        return False
    digest, entries = index_digest(index, _host_array)
    me = int(mesh._world[mesh._coord])
    comm = mesh._dim_comms[0] if mesh.ndim == 1 else mesh._group_comm(tuple(range(mesh.ndim)))
    table = comm.allgather_ints([digest, entries, me], what=(op, "index digest")).tolist()
    if all(row[0] == digest for row in table):
        return True
    rows = "; ".join(
        f"world rank {w}: digest {d:#018x}, {n} entries" + (" (this rank)" if w == me else "")
        for d, n, w in table
    )
    text = repr(index)
    text = text if len(text) <= 200 else text[:200] + "..."
    shapes = ", ".join(
        f"DTensor({placement_list(a.placements)}, shape {tuple(a.shape)})"
        for a in args if isinstance(a, DTensor)
    )
    raise CommError(
        f"{op}: the ranks of mesh {tuple(mesh.shape)} passed different index arguments "
        f"({shapes}); this rank's index: {text}. Each rank's index: {rows}. The index of "
        "x[idx], x[idx] = value and index_put is a static argument that every rank must "
        "pass alike (SPMD); a per-rank selection is x.to_local()[idx] on the local tensor, "
        "or an index that is itself a DTensor. Every rank raises."
    )


def _has_dtensor(index: object) -> bool:
    t = type(index)
    if t is tuple or t is list:
        return any(_has_dtensor(e) for e in index)  # type: ignore[attr-defined]
    return isinstance(index, DTensor)


def gather_dtensor_index(index: object) -> tuple[object, bool]:
    """``(index, gathered)``: ``index`` with each DTensor in it replaced by the local tensor
    of its global values (``full_tensor()``), and whether it held one. **Collective** over
    the DTensors' meshes when it does (in the order they appear), Local otherwise."""
    if not _has_dtensor(index):
        return index, False

    def whole(v: object) -> object:
        t = type(v)
        if t is tuple or t is list:
            return t(whole(e) for e in v)  # type: ignore[attr-defined]
        return v.full_tensor() if isinstance(v, DTensor) else v

    return whole(index), True


def mask_fill(x: object, index: object, value: object) -> DTensor | None:
    """For ``x[index] = value``: the mask to give ``masked_fill_`` (the bool DTensor
    ``index`` viewed with trailing size-1 dims up to ``x``'s), when ``index`` is a bool
    DTensor over the leading dims of the DTensor ``x`` and ``value`` a python scalar or a
    0-d tensor; None otherwise. **Local** (the view moves nothing)."""
    if not (isinstance(index, DTensor) and isinstance(x, DTensor)) or index.dtype != np.bool_:
        return None
    if not (isinstance(value, (bool, int, float, np.generic)) or (
            isinstance(value, Tensor) and value.ndim == 0)):
        return None
    shape, n = tuple(x.shape), index.ndim
    if not 0 < n <= len(shape) or tuple(index.shape) != shape[:n]:
        return None
    return index if n == len(shape) else index.reshape(tuple(index.shape) + (1,) * (
        len(shape) - n))


def replicate_local_index(op: str, values: list, pos: int, args: list) -> bool:
    """For ``op`` of :data:`INDEX_TENSOR_PARAMS` whose index (``values[pos]``) is a local
    tensor or ndarray: check it across the mesh of the DTensors among ``args`` (see
    :func:`check_index_args`) and replace it by a Replicate DTensor of it (no copy).
    Returns whether it did. **Collective** when the index is checked, Local otherwise."""
    v = values[pos]
    if isinstance(v, np.ndarray):
        v = wrap_array(v)
    if not isinstance(v, Tensor) or isinstance(v, DTensor) or v.ndim == 0:
        return False
    mesh = next((a._spec.mesh for a in args if isinstance(a, DTensor)), None)
    if mesh is None:
        return False
    check_index_args(op, v, args, mesh)
    spec = DTensorSpec(mesh, (Replicate(),) * mesh.ndim, tuple(v.shape), v.dtype)
    values[pos] = DTensor._make(v, spec)
    return True
