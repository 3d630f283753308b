"""CommDebugMode: count the collectives a block of code issues, and why.

While active, the mode observes every collective of :mod:`redistribute.comm` on this rank
and records its kind, the mesh dim of its communicator, the bytes this rank sends or
receives, and the op that caused it: the dispatcher names the op whose inputs it is
redistributing; collectives outside dispatched ops (``DTensor.redistribute``,
``full_tensor``, ``distribute_tensor``, ``from_local``) count under ``"redistribute"``.
Collectives of an asynchronous redistribute (``redistribute(..., async_op=True)``, which
runs on the private duplicate of a mesh communicator) are marked ``async_op``.

Collectives of a backward pass are marked ``phase="backward"`` and attributed to the op
whose backward node issued them (its formula's ops, and the move of the gradients it makes
into the leaves' layouts: the all-reduce of a data-parallel weight gradient counts under
``matmul``); by op they are listed as ``"matmul (backward)"``.

On an abstract mesh (``dt.AbstractMesh``) nothing communicates: the mode records the
collectives a real run on a mesh of that shape would issue, as the abstract DTensors' ops
and redistributions report them (kind, mesh dim, op, phase, and rank 0's bytes).
"""

from __future__ import annotations

import json
from collections import Counter
from typing import TYPE_CHECKING, NamedTuple

from redistribute import comm as _comm

from ..dispatch import dispatcher as _dispatch
from ..local import grad_engine as _ag

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["CommDebugMode", "CommRecord"]

_OUTSIDE_OPS = "redistribute"


class CommRecord(NamedTuple):
    """One observed collective: the op that caused it, its kind, mesh dim and bytes, and
    the phase (``"forward"``, or ``"backward"``: ``op`` is then the op whose backward
    issued it)."""

    op: str
    kind: str
    mesh_dim: int | None
    nbytes: int
    async_op: bool = False
    phase: str = "forward"

    @property
    def label(self) -> str:
        """The op, with `` (backward)`` for a collective of backward."""
        return self.op if self.phase == "forward" else f"{self.op} (backward)"


class CommDebugMode:
    """Context manager that records the collectives issued on this rank.

    **Local**: observing adds no communication. Every rank records its own collectives
    (their counts agree across ranks because every rank takes the same decisions).

    Examples
    --------
    >>> with dt.debug.CommDebugMode() as mode:
    ...     y = x @ w
    >>> mode.get_total_counts()
    0
    """

    def __init__(self) -> None:
        self.records: list[CommRecord] = []
        self._active = False

    def _observe(self, kind: str, nbytes: int, comm: object) -> None:
        phase = "forward"
        op = None
        if _ag.in_backward():
            phase = "backward"
            op = _ag.current_backward()
        op = op or _dispatch.current_op() or _OUTSIDE_OPS
        mesh_dim = getattr(comm, "mesh_dim", None)
        is_async = bool(getattr(comm, "async_op", False))
        self.records.append(CommRecord(op, str(kind), mesh_dim, int(nbytes), is_async, phase))

    def __enter__(self) -> Self:
        if self._active:
            raise RuntimeError("CommDebugMode: this mode is already active")
        self.records = []
        _comm.add_observer(self._observe)
        self._active = True
        return self

    def __exit__(self, *exc: object) -> None:
        _comm.remove_observer(self._observe)
        self._active = False

    # -- queries (all Local) -------------------------------------------------------------
    def get_total_counts(self) -> int:
        """Number of collectives observed. **Local**."""
        return len(self.records)

    def get_comm_counts(self) -> dict[str, int]:
        """Collectives by kind (``"allgatherv"``, ``"allreduce"``...). **Local**."""
        return dict(Counter(r.kind for r in self.records))

    def get_comm_counts_by_op(self) -> dict[str, dict[str, int]]:
        """Collectives by causing op (``"<op> (backward)"`` for those of its backward), then
        by kind. **Local**."""
        out: dict[str, dict[str, int]] = {}
        for r in self.records:
            per = out.setdefault(r.label, {})
            per[r.kind] = per.get(r.kind, 0) + 1
        return out

    def get_comm_counts_by_phase(self) -> dict[str, dict[str, int]]:
        """Collectives by phase (``"forward"``, ``"backward"``), then by kind. **Local**."""
        out: dict[str, dict[str, int]] = {}
        for r in self.records:
            per = out.setdefault(r.phase, {})
            per[r.kind] = per.get(r.kind, 0) + 1
        return out

    def get_total_bytes(self) -> int:
        """Bytes sent or received by this rank over all observed collectives. **Local**."""
        return sum(r.nbytes for r in self.records)

    def get_async_counts(self) -> int:
        """Number of observed collectives of asynchronous redistributes. **Local**."""
        return sum(r.async_op for r in self.records)

    def _groups(self) -> list[dict[str, object]]:
        """Records grouped by (op label, kind, mesh dim, async), in order of first
        appearance; the kind of asynchronous ones reads ``"<kind> (async)"``."""
        groups: dict[tuple, dict[str, object]] = {}
        for r in self.records:
            kind = f"{r.kind} (async)" if r.async_op else r.kind
            g = groups.setdefault(
                (r.label, kind, r.mesh_dim),
                {"op": r.label, "phase": r.phase, "kind": kind, "mesh_dim": r.mesh_dim,
                 "count": 0, "bytes": 0},
            )
            g["count"] += 1
            g["bytes"] += r.nbytes
        return list(groups.values())

    def table(self) -> str:
        """A readable table: one row per (op, collective kind, mesh dim); the op of a
        backward collective reads ``"<op> (backward)"``. **Local**."""
        rows = [("op", "collective", "mesh dim", "count", "bytes")]
        for g in self._groups():
            md = "-" if g["mesh_dim"] is None else str(g["mesh_dim"])
            rows.append((g["op"], g["kind"], md, str(g["count"]), str(g["bytes"])))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        lines.append(
            f"total: {self.get_total_counts()} collectives, {self.get_total_bytes()} bytes"
        )
        return "\n".join(lines)

    def to_json(self) -> str:
        """The counts as a JSON document (totals, by kind, by op, by phase, grouped rows).
        **Local**."""
        return json.dumps(
            {
                "total_counts": self.get_total_counts(),
                "total_bytes": self.get_total_bytes(),
                "async_counts": self.get_async_counts(),
                "by_kind": self.get_comm_counts(),
                "by_op": self.get_comm_counts_by_op(),
                "by_phase": self.get_comm_counts_by_phase(),
                "rows": self._groups(),
            }
        )
