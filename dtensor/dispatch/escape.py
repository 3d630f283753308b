"""Escape hatches from sharding propagation: ``dt.local_map`` (run a function of local
tensors on every rank's shards, with declared input and output placements) and
``dt.implicit_replication()`` (local tensors mixed with DTensors count as Replicate).

Both follow PyTorch's ``torch.distributed.tensor.experimental.local_map`` and
``implicit_replication``. The user vouches for what the sharding rules would otherwise
check: that the function's local results have the declared placements, and that a local
tensor holds the same values on every rank.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from placements import Placement
from placements.errors import ArgumentError, PlacementError

from ..distributed.dtensor import DTensor
from ..distributed.mesh import DeviceMesh
from ..local.tensor import Tensor
from . import dispatcher as _dispatcher

__all__ = ["implicit_replication", "local_map"]


@contextlib.contextmanager
def implicit_replication() -> Iterator[None]:
    """Inside the block, a local (non 0-d) tensor or ndarray among the arguments of an op on
    DTensors takes part as a Replicate DTensor on the mesh of the op's first DTensor
    argument (outside, mixing them raises ``ShardingError``). **Local**.

    The local tensor must hold the same values on every rank (nothing checks it); it is
    used without a copy. Contexts nest; the setting is process-wide, so enter it on every
    rank alike.
    """
    _dispatcher._implicit_replication += 1
    try:
        yield
    finally:
        _dispatcher._implicit_replication -= 1


def _flatten(tree: object, leaves: list) -> Callable[[Iterator], object]:
    """Append the leaves of ``tree`` (lists, tuples and dict values nest) to ``leaves``;
    return the function that rebuilds the structure from an iterator of new leaves."""
    if type(tree) in (list, tuple):
        parts = [_flatten(e, leaves) for e in tree]
        kind = type(tree)
        return lambda it: kind(p(it) for p in parts)
    if type(tree) is dict:
        parts = {k: _flatten(v, leaves) for k, v in tree.items()}
        return lambda it: {k: p(it) for k, p in parts.items()}
    leaves.append(tree)
    return lambda it: next(it)


def _is_placements(value: object) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(p, Placement) for p in value)


def local_map(
    func: Callable | None = None,
    out_placements: object = None,
    in_placements: Sequence[Sequence[Placement] | None] | None = None,
    *,
    device_mesh: DeviceMesh | None = None,
    redistribute_inputs: bool = False,
) -> Callable:
    """Wrap ``func`` (a function of local tensors) so that it takes DTensors: each DTensor
    argument is replaced by its local shard, ``func`` runs on every rank, and its tensor
    results become DTensors with the declared ``out_placements``.

    **Local** to wrap. The wrapped function is **Collective** over the mesh when an input
    is redistributed (``redistribute_inputs=True``) or a result is sharded (its exact
    global shape is gathered from every rank's local shape: ``DTensor.from_local``);
    **Local** otherwise. Call it on every rank.

    Parameters
    ----------
    func : callable, optional
        The function; without it, ``local_map(out_placements=...)`` is a decorator.
    out_placements : sequence of Placement, or tuple of them (None for a non-tensor)
        The placements of the results, one entry per leaf of ``func``'s result (lists,
        tuples and dict values are flattened in order). A single result takes one
        placement sequence (``[dt.Shard(0)]``); a tuple of sequences gives one per leaf.
    in_placements : sequence, optional
        One entry per leaf of the positional arguments: the placements a DTensor argument
        must have (None for a non-tensor argument; ignored for a local Tensor). None: no
        check.
    device_mesh : DeviceMesh, optional
        The mesh of the results; default the first DTensor argument's.
    redistribute_inputs : bool
        Redistribute a DTensor argument whose placements differ from ``in_placements``
        (otherwise that raises PlacementError).

    Returns
    -------
    callable
        With no DTensor among its arguments, it returns ``func``'s result unchanged.

    Raises
    ------
    PlacementError
        An argument's placements differ from ``in_placements`` without
        ``redistribute_inputs``; the number of ``in_placements`` or ``out_placements`` does
        not match the leaves; a DTensor argument or tensor result has None placements, a
        non-tensor one has placements.
    ArgumentError
        ``func`` returned a DTensor (it must return local tensors).
    """
    if func is None:
        return functools.partial(
            local_map,
            out_placements=out_placements,
            in_placements=in_placements,
            device_mesh=device_mesh,
            redistribute_inputs=redistribute_inputs,
        )

    @functools.wraps(func)
    def wrapped(*args: object, **kwargs: object) -> object:
        leaves: list = []
        rebuild = _flatten(args, leaves)
        if in_placements is not None and len(in_placements) != len(leaves):
            raise PlacementError(
                f"local_map({_name(func)}): {len(in_placements)} in_placements for "
                f"{len(leaves)} arguments"
            )
        mesh = device_mesh
        seen = False
        local = []
        for i, a in enumerate(leaves):
            want = None if in_placements is None else in_placements[i]
            if isinstance(a, DTensor):
                seen = True
                mesh = a.device_mesh if mesh is None else mesh
                if in_placements is not None:
                    a = _check_input(func, i, a, want, redistribute_inputs)
                local.append(a.to_local())
                continue
            if want is not None and not isinstance(a, (Tensor, np.ndarray)):
                raise PlacementError(
                    f"local_map({_name(func)}): argument {i} ({type(a).__name__}) is not a "
                    f"tensor but in_placements gives it {want!r}"
                )
            local.append(a)
        out = func(*rebuild(iter(local)), **kwargs)
        if not seen:
            return out
        return _wrap_results(func, out, out_placements, mesh)

    return wrapped


def _name(func: Callable) -> str:
    return getattr(func, "__name__", repr(func))


def _check_input(
    func: Callable, i: int, a: DTensor, want: object, redistribute: bool
) -> DTensor:
    if want is None:
        raise PlacementError(
            f"local_map({_name(func)}): DTensor argument {i} ({a.placements}) has None in "
            "in_placements; give its placements"
        )
    want = tuple(want)
    if a.placements == want:
        return a
    if redistribute:
        return a.redistribute(a.device_mesh, want)
    raise PlacementError(
        f"local_map({_name(func)}): argument {i} has placements {a.placements}, "
        f"in_placements asks for {want}; pass redistribute_inputs=True to redistribute it"
    )


def _wrap_results(func: Callable, out: object, out_placements: object, mesh: DeviceMesh):
    leaves: list = []
    rebuild = _flatten(out, leaves)
    specs = (
        (out_placements,)
        if not isinstance(out_placements, tuple) or _is_placements(out_placements)
        else out_placements
    )
    if len(specs) != len(leaves):
        raise PlacementError(
            f"local_map({_name(func)}): {len(specs)} out_placements for {len(leaves)} "
            "results; give one placement sequence per result"
        )
    wrapped = []
    for k, (r, pl) in enumerate(zip(leaves, specs)):
        if isinstance(r, DTensor):
            raise ArgumentError(
                f"local_map({_name(func)}): result {k} is a DTensor; func must return local "
                "tensors"
            )
        if isinstance(r, (Tensor, np.ndarray)):
            if pl is None:
                raise PlacementError(
                    f"local_map({_name(func)}): result {k} is a tensor but its out_placements "
                    "entry is None"
                )
            r = DTensor.from_local(r, mesh, pl)
        elif pl is not None:
            raise PlacementError(
                f"local_map({_name(func)}): result {k} ({type(r).__name__}) is not a tensor "
                f"but out_placements gives it {pl!r}"
            )
        wrapped.append(r)
    return rebuild(iter(wrapped))
