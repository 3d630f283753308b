"""Redistribute planner: the steps that turn one placement list into another.

This module owns the plan steps (frozen dataclasses, one per primitive) and :func:`plan`, a
pure and cached function of ``(source spec, target placements)``. Executing a plan is the job
of :mod:`redistribute.execute`; pricing it is :mod:`redistribute.cost`.

Every step changes the placement of ONE mesh dim and records the full placements before and
after it. The global shape never changes. Primitives, by (source kind, target kind):

===========  ==================  =============================================
S(a) -> S(b)  AllToAll            a != b
S(d) -> R     AllGather
R -> S(d)     LocalChunk          a view, no communication
P -> S(d)     ReduceScatter
P -> R        AllReduce
R -> P        PartitionPartial    no communication
===========  ==================  =============================================

S -> P goes through R (AllGather, PartitionPartial); P(op) -> P(other op) goes through R
(AllReduce, PartitionPartial).

Layout rules that order the steps (see :mod:`placements.layout` and
:class:`placements.types.Partial`): mesh dim 0 is the outermost level. A tensor dim sharded on
several mesh dims is split by mesh dim 0 first, so a shard of tensor dim ``d`` may be added or
removed on mesh dim ``m`` only while no higher mesh dim shards ``d``. Partial values are
reduced from the highest mesh dim down, so a Partial on mesh dim ``m`` may be reduced only
while no higher mesh dim is Partial with a reduce op that does not commute with it (``sum``
and ``avg`` commute with each other, every op with itself).

Search: the planner runs a shortest-path search (Dijkstra, costs from the cost model) over
placement lists in which every mesh dim takes its source placement, its target placement or
Replicate. That space always holds a valid plan (reduce/gather down to all-Replicate from the
highest mesh dim, then chunk/partition up from mesh dim 0) and the search picks the cheapest,
so a plan never gathers more than the target needs. Ties break by exploration order (mesh
dims in increasing order), so plans are deterministic and identical on every rank.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from placements.cache import memoize
from placements.errors import NoRuleError
from placements.layout import normalize_placements
from placements.spec import DTensorSpec
from placements.types import Placement, Replicate, short_placements

from .cost import (
    CostModel,
    block_bytes,
    default_cost_model,
    spans_hosts,
    transfer_bytes,
    transfer_cost,
)

__all__ = [
    "AllGather",
    "AllReduce",
    "AllToAll",
    "LocalChunk",
    "PartitionPartial",
    "ReduceScatter",
    "Step",
    "plan",
    "redistribute_cost",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Step:
    """One primitive of a plan: it changes the placement of mesh dim ``mesh_dim``.

    Attributes
    ----------
    mesh_dim : int
        The mesh dim whose placement changes (the collective runs over its communicator).
    before, after : tuple of Placement
        The full placements before and after the step (they differ only at ``mesh_dim``).
    kind : str (class attribute)
        ``all_gather``, ``reduce_scatter``, ``all_reduce``, ``all_to_all``, ``local_chunk``
        or ``partition_partial``.
    communicates : bool (class attribute)
        False for the local steps.
    """

    mesh_dim: int
    before: tuple[Placement, ...]
    after: tuple[Placement, ...]
    kind: ClassVar[str]
    communicates: ClassVar[bool] = True


@dataclass(frozen=True, slots=True, kw_only=True)
class AllGather(Step):
    """``S(tensor_dim) -> R``: concatenate the shards of the mesh dim's group in coord order."""

    tensor_dim: int
    kind: ClassVar[str] = "all_gather"


@dataclass(frozen=True, slots=True, kw_only=True)
class ReduceScatter(Step):
    """``P(reduce_op) -> S(tensor_dim)``: reduce over the group, keep this coord's chunk.

    ``avg`` divides the sum by the group size.
    """

    tensor_dim: int
    reduce_op: str
    kind: ClassVar[str] = "reduce_scatter"


@dataclass(frozen=True, slots=True, kw_only=True)
class AllReduce(Step):
    """``P(reduce_op) -> R``: reduce over the group. ``avg`` divides the sum by the group size."""

    reduce_op: str
    kind: ClassVar[str] = "all_reduce"


@dataclass(frozen=True, slots=True, kw_only=True)
class AllToAll(Step):
    """``S(src_dim) -> S(dst_dim)``: re-split the group's block from one tensor dim to another."""

    src_dim: int
    dst_dim: int
    kind: ClassVar[str] = "all_to_all"


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalChunk(Step):
    """``R -> S(tensor_dim)``: keep this coord's chunk of the local block (a view, no comm)."""

    tensor_dim: int
    kind: ClassVar[str] = "local_chunk"
    communicates: ClassVar[bool] = False


@dataclass(frozen=True, slots=True, kw_only=True)
class PartitionPartial(Step):
    """``R -> P(reduce_op)`` without communication.

    ``sum``: coordinate 0 of the mesh dim keeps the value, the others hold zeros.
    ``prod``: coordinate 0 keeps the value, the others hold ones.
    ``avg``, ``max``, ``min``: every coordinate keeps the value.
    """

    # Note: PyTorch's R -> P(sum) divides the value by the group size on every rank; here one
    # holder keeps it and the others hold zeros, which is exact for integers and for floats.

    reduce_op: str
    kind: ClassVar[str] = "partition_partial"
    communicates: ClassVar[bool] = False


def _replaced(cur: tuple[Placement, ...], m: int, p: Placement) -> tuple[Placement, ...]:
    return cur[:m] + (p,) + cur[m + 1 :]


def _sharded_deeper(cur: tuple[Placement, ...], m: int, dim: int) -> bool:
    """Whether a mesh dim above ``m`` shards tensor dim ``dim`` (it would split first)."""
    return any(p.is_shard(dim) for p in cur[m + 1 :])


def _commute(a: str, b: str) -> bool:
    return a == b or {a, b} == {"sum", "avg"}


def _reduce_blocked(cur: tuple[Placement, ...], m: int, op: str) -> bool:
    """Whether a higher mesh dim holds a Partial that must be reduced before ``op`` on ``m``."""
    return any(p.kind == "P" and not _commute(p.reduce_op, op) for p in cur[m + 1 :])


# Builders, one per (source kind, target kind): for cur[m] -> target, the step class and its
# own fields, or None when the layout rules forbid the step in the current state.
_Move = tuple[type[Step], dict[str, Any]]


def _all_to_all(cur: tuple[Placement, ...], m: int, target: Placement) -> _Move | None:
    a, b = cur[m].dim, target.dim
    if _sharded_deeper(cur, m, a) or _sharded_deeper(cur, m, b):
        return None
    return AllToAll, {"src_dim": a, "dst_dim": b}


def _all_gather(cur: tuple[Placement, ...], m: int, target: Placement) -> _Move | None:
    d = cur[m].dim
    if _sharded_deeper(cur, m, d):
        return None
    return AllGather, {"tensor_dim": d}


def _local_chunk(cur: tuple[Placement, ...], m: int, target: Placement) -> _Move | None:
    d = target.dim
    if _sharded_deeper(cur, m, d):
        return None
    return LocalChunk, {"tensor_dim": d}


def _reduce_scatter(cur: tuple[Placement, ...], m: int, target: Placement) -> _Move | None:
    op, d = cur[m].reduce_op, target.dim
    if _reduce_blocked(cur, m, op) or _sharded_deeper(cur, m, d):
        return None
    return ReduceScatter, {"tensor_dim": d, "reduce_op": op}


def _all_reduce(cur: tuple[Placement, ...], m: int, target: Placement) -> _Move | None:
    op = cur[m].reduce_op
    if _reduce_blocked(cur, m, op):
        return None
    return AllReduce, {"reduce_op": op}


def _partition(cur: tuple[Placement, ...], m: int, target: Placement) -> _Move | None:
    op = target.reduce_op
    # Non-holders of a prod partition hold ones, which a higher P(sum) would add up.
    if op == "prod" and any(p.is_partial("sum") for p in cur[m + 1 :]):
        return None
    return PartitionPartial, {"reduce_op": op}


_TRANSITIONS: dict[tuple[str, str], Callable[..., _Move | None]] = {
    ("S", "S"): _all_to_all,
    ("S", "R"): _all_gather,
    ("R", "S"): _local_chunk,
    ("P", "S"): _reduce_scatter,
    ("P", "R"): _all_reduce,
    ("R", "P"): _partition,
}


@memoize("redistribute.plans", 4096)
def _search(
    src_spec: DTensorSpec, dst: tuple[Placement, ...], model: CostModel
) -> tuple[tuple[Step, ...], float]:
    """Cheapest plan from ``src_spec.placements`` to ``dst`` and its cost."""
    src = src_spec.placements
    if src == dst:
        return (), 0.0
    replicate = Replicate()
    domains = [tuple(dict.fromkeys((s, d, replicate))) for s, d in zip(src, dst)]
    mesh_shape = src_spec.mesh_shape
    network = tuple(spans_hosts(src_spec.mesh, m) for m in range(len(mesh_shape)))
    blocks: dict[tuple[Placement, ...], int] = {}

    def block(state: tuple[Placement, ...]) -> int:
        nbytes = blocks.get(state)
        if nbytes is None:
            nbytes = blocks[state] = block_bytes(src_spec, state)
        return nbytes

    tie = itertools.count()
    heap: list[tuple[float, int, tuple[Placement, ...], tuple[Any, ...]]] = [
        (0.0, next(tie), src, ())
    ]
    best = {src: 0.0}
    while heap:
        cost, _, cur, path = heapq.heappop(heap)
        if cur == dst:
            steps = tuple(
                cls(mesh_dim=m, before=before, after=after, **fields)
                for cls, m, before, after, fields in path
            )
            return steps, cost
        if cost > best[cur]:
            continue
        for m, domain in enumerate(domains):
            for target in domain:
                if target == cur[m]:
                    continue
                build = _TRANSITIONS.get((cur[m].kind, target.kind))
                move = build(cur, m, target) if build is not None else None
                if move is None:
                    continue
                cls, fields = move
                after = _replaced(cur, m, target)
                k = mesh_shape[m]
                nbytes = (
                    transfer_bytes(cls.kind, k, block(cur), block(after)) if cls.communicates else 0
                )
                new_cost = cost + transfer_cost(cls.kind, m, k, nbytes, model, network[m])
                if new_cost < best.get(after, float("inf")):
                    best[after] = new_cost
                    heapq.heappush(
                        heap, (new_cost, next(tie), after, path + ((cls, m, cur, after, fields),))
                    )
    raise NoRuleError(  # unreachable by construction (see the module docstring)
        f"redistribute: no plan from {short_placements(src)} to {short_placements(dst)} "
        f"for {src_spec!r}"
    )


def plan(
    src_spec: DTensorSpec,
    dst_placements: Sequence[Placement],
    cost_model: CostModel | None = None,
) -> tuple[Step, ...]:
    """The steps that redistribute ``src_spec`` to ``dst_placements``. **Local** (pure).

    Cached on ``(src_spec, normalised dst_placements, cost model)``.

    Parameters
    ----------
    src_spec : DTensorSpec
        The source: mesh, placements, global shape, dtype.
    dst_placements : sequence of Placement
        The target placements, one per mesh dim (negative shard dims allowed).
    cost_model : CostModel, optional
        Prices the alternatives; defaults to :func:`redistribute.cost.default_cost_model`.

    Returns
    -------
    tuple of Step
        Empty when nothing changes. ``steps[0].before`` is the source placements and
        ``steps[-1].after`` the target.

    Raises
    ------
    PlacementError
        Invalid target placements for the spec's tensor and mesh.
    """
    dst = normalize_placements(dst_placements, src_spec.shape, src_spec.mesh_shape)
    return _search(src_spec, dst, cost_model or default_cost_model())[0]


def redistribute_cost(
    src_spec: DTensorSpec,
    dst_placements: Sequence[Placement],
    cost_model: CostModel | None = None,
) -> float:
    """Estimated seconds to redistribute ``src_spec`` to ``dst_placements``. **Local** (pure).

    The cost of :func:`plan`'s plan under the same model (0.0 when nothing changes); what a
    dispatcher compares across sharding strategies.

    Parameters are those of :func:`plan`.
    """
    dst = normalize_placements(dst_placements, src_spec.shape, src_spec.mesh_shape)
    return _search(src_spec, dst, cost_model or default_cost_model())[1]
