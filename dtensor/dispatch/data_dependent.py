"""Ops whose output shape depends on the data: ``nonzero`` and ``masked_select``.

No sharding rule can give their global shape from metadata, so on DTensors they gather:
each input is made whole on every rank (``full_tensor()``; a local tensor counts as the
replicated global value), the local kernel runs on the global values, and the result is a
Replicate DTensor on the input's mesh, the same on every rank. They are **Collective**;
on local tensors they are the local kernels. :mod:`dtensor.dispatch.entry_points` installs them
as Tensor and DTensor methods; ``dtensor`` exports them.
"""

from __future__ import annotations

from placements import Replicate
from placements.errors import MeshError
from placements.spec import DTensorSpec

from ..distributed.dtensor import DTensor
from ..local.kernels import index as _K
from ..local.tensor import Tensor

__all__ = ["DATA_DEPENDENT", "masked_select", "nonzero"]


def _replicated(out: Tensor, mesh: object) -> DTensor:
    spec = DTensorSpec(mesh, (Replicate(),) * mesh.ndim, tuple(out.shape), out.dtype)
    return DTensor._make(out, spec)


def nonzero(input: Tensor | DTensor, *, as_tuple: bool = False) -> object:
    """The indices of the non-zero entries: an int64 tensor ``(n, ndim)``, or with
    ``as_tuple`` one index vector per dim.

    **Collective** on a DTensor (its global values are gathered on every rank; the result
    is replicated: every rank gets all ``n`` indices); **Local** on a Tensor.
    """
    if not isinstance(input, DTensor):
        return _K.nonzero(input, as_tuple=as_tuple)
    mesh = input.device_mesh
    out = _K.nonzero(input.full_tensor(), as_tuple=as_tuple)
    if as_tuple:
        return tuple(_replicated(o, mesh) for o in out)
    return _replicated(out, mesh)


def masked_select(input: Tensor | DTensor, mask: Tensor | DTensor) -> object:
    """The entries of ``input`` where ``mask`` (bool; both broadcast) holds, as a vector.

    **Collective** when either is a DTensor (both are gathered on every rank, a local one
    taken as the replicated global value; the result is replicated); **Local** otherwise.

    Raises
    ------
    MeshError
        Two DTensors on different meshes.
    """
    tensors = [t for t in (input, mask) if isinstance(t, DTensor)]
    if not tensors:
        return _K.masked_select(input, mask)
    mesh = tensors[0].device_mesh
    if any(t.device_mesh != mesh for t in tensors):
        raise MeshError(
            f"masked_select: input and mask live on different meshes {input.device_mesh!r} and "
            f"{mask.device_mesh!r}"
        )
    whole = [t.full_tensor() if isinstance(t, DTensor) else t for t in (input, mask)]
    return _replicated(_K.masked_select(*whole), mesh)


#: name -> function, installed as Tensor and DTensor methods.
DATA_DEPENDENT = {"nonzero": nonzero, "masked_select": masked_select}
