"""Placement types: how one mesh dimension distributes a tensor.

This module owns :class:`Placement` and its three kinds, :class:`Shard`, :class:`Replicate`
and :class:`Partial`. They are frozen, slotted, hashable values that never communicate. Each
carries a one-letter ``kind`` ("S", "R", "P") that the redistribute planner uses as a table key.

Equality is by value (``Shard(0) == Shard(0)``, ``Shard(0) != Replicate()``) and placements are
totally ordered (Shard < Replicate < Partial, then by dim / reduce op), so lists of placements
sort deterministically.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

from .errors import PlacementError

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = [
    "REDUCE_OPS",
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "placement_list",
    "short_placements",
]

#: Reduce ops a :class:`Partial` may carry.
REDUCE_OPS: tuple[str, ...] = ("sum", "avg", "max", "min", "prod")

_KIND_ORDER = {"S": 0, "R": 1, "P": 2}


class Placement:
    """Base class of placements: how one mesh dimension holds a tensor.

    Instances are immutable and interned: constructing an equal placement returns the same
    object. Equality and hashing are therefore by identity (the fast built-in ones), which is
    equality by value.
    """

    __slots__ = ("_key",)
    kind: ClassVar[str] = ""
    _interned: ClassVar[dict[tuple[Any, ...], Placement]] = {}

    @classmethod
    def _intern(cls, **fields: Any) -> Placement:
        key = (_KIND_ORDER[cls.kind], *fields.values())
        self = Placement._interned.get((cls, key))
        if self is None:
            self = object.__new__(cls)
            for name, value in fields.items():
                object.__setattr__(self, name, value)
            object.__setattr__(self, "_key", key)
            self = Placement._interned.setdefault((cls, key), self)
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable; cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable; cannot delete {name!r}")

    def __reduce__(self) -> tuple[type, tuple[Any, ...]]:
        return type(self), self._key[1:]

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Placement):
            return NotImplemented
        return self._key < other._key

    def __le__(self, other: object) -> bool:
        if not isinstance(other, Placement):
            return NotImplemented
        return self._key <= other._key

    def __gt__(self, other: object) -> bool:
        if not isinstance(other, Placement):
            return NotImplemented
        return self._key > other._key

    def __ge__(self, other: object) -> bool:
        if not isinstance(other, Placement):
            return NotImplemented
        return self._key >= other._key

    def short(self) -> str:
        """Short form used in spec reprs and plans: ``S(0)``, ``R``, ``P(sum)``. **Local**."""
        raise NotImplementedError

    def is_shard(self, dim: int | None = None) -> bool:
        """True for ``Shard`` (of tensor dim ``dim`` when given). **Local**."""
        return False

    def is_replicate(self) -> bool:
        """True for ``Replicate``. **Local**."""
        return False

    def is_partial(self, reduce_op: str | None = None) -> bool:
        """True for ``Partial`` (with reduce op ``reduce_op`` when given). **Local**."""
        return False


class Shard(Placement):
    """The tensor is split along tensor dim ``dim`` over the mesh dimension.

    The split follows ``torch.chunk``: chunks of ``ceil(n / k)`` elements, trailing coordinates
    hold fewer, possibly zero. A negative ``dim`` counts from the end; a
    :class:`~placements.spec.DTensorSpec` resolves it against the tensor's rank.
    """

    __slots__ = ("dim",)
    kind: ClassVar[str] = "S"
    dim: int

    def __new__(cls, dim: int) -> Self:
        if isinstance(dim, bool):
            raise PlacementError(f"Shard(dim={dim!r}): dim must be an int, not bool")
        try:
            dim = operator.index(dim)
        except TypeError:
            raise PlacementError(
                f"Shard(dim={dim!r}): dim must be an int, not {type(dim).__name__}"
            ) from None
        return cls._intern(dim=dim)

    def __repr__(self) -> str:
        return f"Shard(dim={self.dim})"

    def short(self) -> str:
        return f"S({self.dim})"

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim


class Replicate(Placement):
    """Every coordinate of the mesh dimension holds the whole (sub-)tensor."""

    __slots__ = ()
    kind: ClassVar[str] = "R"

    def __new__(cls) -> Self:
        return cls._intern()

    def __repr__(self) -> str:
        return "Replicate()"

    def short(self) -> str:
        return "R"

    def is_replicate(self) -> bool:
        return True


class Partial(Placement):
    """Every coordinate holds a contribution; the value is their reduction by ``reduce_op``.

    ``reduce_op`` is one of ``sum``, ``avg``, ``max``, ``min``, ``prod``. When several mesh
    dimensions are Partial, the value is reduced from the highest mesh dim to mesh dim 0
    (mesh dim 0 is the outermost level, as for nested sharding); this matters only for reduce
    ops that do not commute (e.g. ``sum`` with ``max``).
    """

    # Note: the product op is spelled "prod" (numpy's name), not PyTorch's "product". PyTorch
    # leaves the order of mixed Partial reductions unspecified; here it is fixed (see above).

    __slots__ = ("reduce_op",)
    kind: ClassVar[str] = "P"
    reduce_op: str

    def __new__(cls, reduce_op: str = "sum") -> Self:
        if reduce_op not in REDUCE_OPS:
            raise PlacementError(
                f"Partial(reduce_op={reduce_op!r}): unknown reduce op; "
                f"allowed: {', '.join(REDUCE_OPS)}"
            )
        return cls._intern(reduce_op=reduce_op)

    def __repr__(self) -> str:
        return f"Partial({self.reduce_op})"

    def short(self) -> str:
        return f"P({self.reduce_op})"

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return reduce_op is None or reduce_op == self.reduce_op


def short_placements(placements: Iterable[Placement], sep: str = ",") -> str:
    """Join the short forms of ``placements``: ``S(0),R``. **Local**.

    Parameters
    ----------
    placements : iterable of Placement
        The placements to render (other objects are rendered with ``repr``).
    sep : str
        Separator between entries.
    """
    return sep.join(p.short() if isinstance(p, Placement) else repr(p) for p in placements)


def placement_list(placements: Iterable[Placement]) -> str:
    """The placements as messages and debug tools print them: ``[S(0), R]``. **Local**."""
    return "[" + short_placements(placements, ", ") + "]"
