"""Mesh-aware factories: ``dt.zeros(..., device_mesh=, placements=)`` and friends.

Each public factory of ``dtensor`` is the twin of a local one
(:mod:`dtensor.local.factory`): without ``device_mesh`` it builds the local tensor; with
one it builds a DTensor from the same resolved :class:`~dtensor.local.factory.Request`, and
each rank allocates only its own shard. The local shape and global offsets come from the
layout math, and the values come from the local factories' one value routine
(:func:`~dtensor.local.factory.fill_block`) at the shard's global offsets, so a DTensor has
the same global values on any mesh and any placements (random values: for the same seed).
A ``*_like`` factory of a DTensor takes its mesh and placements unless others are given.

Under ``Partial`` placements the values are placed as by :func:`distribute_tensor`
(:func:`placements.layout.partial_fill`): ``Partial(sum)``/``Partial(prod)`` hold the value
on coordinate 0 of that mesh dim and the reduction's identity elsewhere; the other kinds
hold the value on every coordinate. The reduced tensor is the requested one.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence

from placements.errors import PlacementError
from placements.layout import partial_fill
from placements.spec import DTensorSpec, check_partial_dtype

from ..local import allocator as _allocator
from ..local import factory as _local
from ..local.tensor import wrap_array
from .abstract import AbstractMesh, abstract_tensor
from .dtensor import DTensor, normalize_placements

__all__ = ["FACTORIES", "distributed_factory"]


def distributed_factory(
    req: _local.Request, device_mesh: object, placements: Sequence[object] | None = None
) -> DTensor:
    """Create the DTensor of a factory request; each rank allocates its own shard only.

    **Local**: no communication (the mesh already knows every coordinate). Every rank must
    still make the same calls in the same order, because random factories advance the
    generator by the global element count.

    Parameters
    ----------
    req : Request
        The resolved factory call (its ``size`` is the global shape; its device is ignored:
        the mesh's device type decides where the shard lives).
    device_mesh, placements
        The mesh and the placements (default Replicate on every mesh dim). On an
        ``AbstractMesh`` the result is a metadata-only DTensor
        (:func:`dtensor.distributed.abstract.abstract_tensor`).
    """
    mesh = device_mesh
    if type(mesh) is AbstractMesh and mesh._abstract:  # metadata only (the generator advances as on a mesh)
        _local.reserve(req)
        return abstract_tensor(req.size, mesh, placements, dtype=req.dtype)
    placements = normalize_placements(placements, mesh, f"dt.{req.name}")
    spec = DTensorSpec(mesh, placements, req.size, req.dtype)
    check_partial_dtype(f"dt.{req.name}", spec.placements, spec.dtype)
    coord = mesh.get_coordinate()
    local_shape = spec.local_shape(coord)
    with _allocator.allocating(f"dt.{req.name}", local_shape, req.dtype):
        out = _allocator.empty_array(local_shape, req.dtype, mesh.device_type)
    counters = _local.reserve(req)
    if req.name != "empty":
        fill = partial_fill(spec.placements, coord)
        if fill is None:
            _local.fill_block(req, out, spec.local_offsets(coord), counters)
        else:
            out.fill(fill)
    return DTensor._make(wrap_array(out), spec)


_MESH_DOC = """

    With ``device_mesh=`` (and ``placements=``, default Replicate) it returns a DTensor of
    that global shape instead, each rank allocating its shard only: still **Local** (no
    communication), but call it on every rank in the same order, since random factories
    advance the generator by the global element count.
"""
_LIKE_DOC = """    A DTensor input gives its mesh and placements unless others are passed.
"""


def _twin(name: str, request: Callable) -> Callable:
    """The public factory ``name``: local without a mesh, a DTensor with one."""
    local = getattr(_local, name)
    like = name.endswith("_like")

    @functools.wraps(local)
    def factory(*args, device_mesh=None, placements=None, requires_grad=False, **kwargs):
        if like and device_mesh is None and isinstance(args[0] if args else None, DTensor):
            src = args[0]
            device_mesh = src.device_mesh
            placements = src.placements if placements is None else placements
        if device_mesh is None:
            if placements is not None:
                raise PlacementError(
                    f"{name}: placements={placements!r} given without device_mesh"
                )
            return local(*args, requires_grad=requires_grad, **kwargs)
        out = distributed_factory(request(*args, **kwargs), device_mesh, placements)
        return out.requires_grad_() if requires_grad else out

    factory.__doc__ = (local.__doc__ or "").rstrip() + _MESH_DOC + (_LIKE_DOC if like else "")
    sig = inspect.signature(local)  # requires_grad= included
    mesh_params = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None)
                   for n in ("device_mesh", "placements")]
    factory.__signature__ = sig.replace(parameters=[*sig.parameters.values(), *mesh_params],
                                        return_annotation="Tensor | DTensor")
    return factory


#: The public factories (``dtensor.zeros``...), by name.
FACTORIES = {name: _twin(name, request) for name, request in _local.REQUESTS.items()}
