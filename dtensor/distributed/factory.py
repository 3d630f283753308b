"""Distributed factories: ``dt.zeros(..., device_mesh=, placements=)`` and friends.

Each rank allocates only its own shard: the local shape and global offsets come from the
layout math, and values that depend on the element position (``arange``, ``rand``,
``randn``, ``randint``) are computed from *global* element indices, so a DTensor has the
same global values on any mesh and any placements (random values: for the same seed).
A ``Partial("sum")`` placement holds the values on mesh coordinate 0 of that mesh dim and
zeros elsewhere (so the reduced tensor is the requested one); other Partial kinds hold the
values on every coordinate.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from placements import Partial
from placements.errors import ArgumentError
from placements.spec import DTensorSpec

from ..local import allocator as _allocator
from ..local import backend as _backend
from ..local import dtypes as _dtypes
from ..local import rng as _random
from ..local.tensor import _wrap
from .dtensor import DTensor, _normalize_placements

__all__ = ["distributed_factory"]


def _shape_from_size(size: object) -> tuple[int, ...]:
    if isinstance(size, (int, np.integer)):
        return (int(size),)
    return tuple(int(s) for s in size)


def _zero_partial_holder(spec: DTensorSpec) -> bool:
    """True when this rank holds zeros because of a Partial(sum) mesh dim. **Local**."""
    coord = spec.mesh.get_coordinate()
    return any(
        isinstance(p, Partial) and p.reduce_op == "sum" and coord[m] != 0
        for m, p in enumerate(spec.placements)
    )


def distributed_factory(
    name: str,
    size: object,
    *,
    dtype: object,
    device_mesh: object,
    placements: Sequence[object] | None = None,
    device: object = None,
    **kwargs: object,
) -> DTensor:
    """Create a DTensor whose local shard only is allocated on each rank.

    **Local**: no communication (the mesh already knows every coordinate). Every rank must
    still make the same calls in the same order, because random factories advance the
    generator by the global element count.

    Parameters
    ----------
    name : str
        One of ``empty, zeros, ones, full, arange, linspace, eye, rand, randn, randint``.
    size : tuple of int
        The global shape.
    dtype : dtype-like
        Already resolved by the public factory (PyTorch's defaults).
    device_mesh, placements
        The mesh and the placements (default Replicate on every mesh dim).
    device : str, optional
        Ignored: the mesh's device type decides where the shard lives.
    kwargs
        ``fill_value`` (full), ``start``/``step`` (arange), ``start``/``end``/``steps``
        (linspace), ``low``/``high`` (randint).
    """
    mesh = device_mesh
    placements = _normalize_placements(placements, mesh, f"dt.{name}")
    shape = _shape_from_size(size)
    dtype = _dtypes.to_dtype(dtype)
    spec = DTensorSpec(mesh, placements, shape, dtype)
    coord = mesh.get_coordinate()
    lshape = spec.local_shape(coord)
    offsets = spec.local_offsets(coord)
    device = mesh.device_type
    xp = _backend.array_module(device)
    zero = _zero_partial_holder(spec)

    if name in ("rand", "randn", "randint"):
        # every rank reserves the same counter range: the generator stays in step on all ranks
        seed, offset = _random._reserve(int(np.prod(shape, dtype=np.int64)))
        kind = {"rand": "uniform", "randn": "normal", "randint": "randint"}[name]
        bounds = {"low": kwargs["low"], "high": kwargs["high"]} if name == "randint" else {}
        arr = _random.random_block(
            kind, shape, offsets, lshape, dtype, seed, offset, xp, **bounds
        )
    elif name in _INDEX_VALUES:
        idx = [xp.arange(o, o + n).reshape((-1,) + (1,) * (len(lshape) - d - 1))
               for d, (o, n) in enumerate(zip(offsets, lshape))]
        arr = _allocator.empty_array(lshape, dtype, device)
        arr[...] = _INDEX_VALUES[name](xp, *idx, **kwargs)
    elif name in ("empty", "zeros", "ones", "full"):
        arr = _allocator.empty_array(lshape, dtype, device)
        if name != "empty":
            arr.fill({"zeros": 0, "ones": 1}.get(name, kwargs.get("fill_value")))
    else:
        raise ArgumentError(f"distributed_factory: unknown factory {name!r}")
    if zero and name != "empty":
        arr[...] = 0
    return DTensor._make(_wrap(arr), spec)


def _arange_values(xp, i, *, start, step, **_):
    return start + i * step


def _linspace_values(xp, i, *, start, end, steps, **_):
    # PyTorch's formula: count up from start in the first half, down from end in the second
    step = (end - start) / (steps - 1) if steps > 1 else 0.0
    return xp.where(i < steps / 2, start + step * i, end - step * (steps - 1 - i))


def _eye_values(xp, i, j, **_):
    return i == j


_INDEX_VALUES = {"arange": _arange_values, "linspace": _linspace_values, "eye": _eye_values}
