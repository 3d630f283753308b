"""Strict mode: ``with dt.debug.no_implicit_redistribute():`` forbids implicit data movement.

This module owns :class:`no_implicit_redistribute` and its error type. While the mode is
active, a dispatched op whose chosen strategy needs an input moved to other placements
raises :class:`ImplicitRedistributeError` before anything is communicated, naming the op,
the input and the placements it would move between. Explicit moves (``x.redistribute``,
``full_tensor``, ``distribute_tensor``) stay allowed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from placements.errors import ShardingError
from placements.types import placement_list

from ..dispatch import dispatcher as _dispatch

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["ImplicitRedistributeError", "no_implicit_redistribute"]


class ImplicitRedistributeError(ShardingError):
    """A dispatched op would redistribute an input while strict mode is active."""


class no_implicit_redistribute:
    """Context manager that raises on any redistribution the user did not ask for.

    **Local** (every rank takes the same decisions, so every rank raises together, before
    any communication).

    Parameters
    ----------
    allow_local : bool
        Also allow moves that communicate nothing (``R -> S(d)`` takes a local chunk, a
        view). Default False: every move of an input raises.

    Notes
    -----
    The check sees the ops that go through the Python dispatcher. A propagation-cache hit
    served by the compiled fast path is not seen; run with ``DTENSOR_FASTPATH=0`` to
    check every op.

    Examples
    --------
    >>> with dt.debug.no_implicit_redistribute():
    ...     y = x @ w          # raises if x or w would have to move
    ...     z = y.redistribute(mesh, [dt.Replicate()])   # explicit: allowed
    """

    def __init__(self, *, allow_local: bool = False) -> None:
        self.allow_local = allow_local
        self._active = False

    def _check(self, entry: _dispatch.CacheEntry, miss: bool, values: list, mesh: object) -> None:
        for i, move in enumerate(entry.moves):
            if not isinstance(move, _dispatch.Redist) or not move.steps:
                continue
            if self.allow_local and not any(s.communicates for s in move.steps):
                continue
            src, dst = move.src, move.dst
            kinds = ", ".join(s.kind for s in move.steps)
            raise ImplicitRedistributeError(
                f"{entry.name}: input {i} (shape {src.shape}, {src.dtype}) would be "
                f"redistributed from {placement_list(src.placements)} to "
                f"{placement_list(dst.placements)} ({kinds}) on mesh "
                f"{src.mesh_shape}, but no_implicit_redistribute() is active; call "
                "x.redistribute(...) explicitly first"
            )

    def __enter__(self) -> Self:
        if self._active:
            raise RuntimeError("no_implicit_redistribute: this mode is already active")
        _dispatch.add_listener(self._check)
        self._active = True
        return self

    def __exit__(self, *exc: object) -> None:
        _dispatch.remove_listener(self._check)
        self._active = False
