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

Point-to-point messages (``send`` / ``recv``) are recorded like collectives. Those of a
pipeline schedule (``dt.pipelining``; the executor tags each message with its stage,
micro-batch and direction) count under op ``"pipeline"``, in phase ``"forward"``
(activations, shape headers) or ``"backward"`` (gradients, tied-gradient sums), and carry
``stage`` (this rank's stage that sends or receives), ``mb`` and ``direction``:
:meth:`CommDebugMode.get_p2p_counts` and :meth:`CommDebugMode.get_p2p_bytes` give them per
stage and the table has a section of them.

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
_PIPELINE = "pipeline"
_P2P = frozenset(("send", "recv"))
#: Directions of pipeline messages that belong to the backward phase.
_BACKWARD_DIRECTIONS = frozenset(("gradient", "tied"))


def p2p_tag(kind: str) -> tuple[int, int, str, int | None, str] | None:
    """``(stage, mb, direction, peer, phase)`` of the point-to-point message being notified
    now, when its sender tagged it (a ``what=`` with ``stage`` and ``direction``, and
    optionally ``mb`` and ``peer``, as ``dt.pipelining``'s executor gives); ``phase`` is
    ``"backward"`` for gradients, ``"forward"`` otherwise. None for anything else.
    **Local**; call it from a communication observer."""
    if kind not in _P2P:
        return None
    what = _comm.notified_what()
    stage = getattr(what, "stage", None)
    direction = getattr(what, "direction", None)
    if not isinstance(stage, int) or not isinstance(direction, str):
        return None
    phase = "backward" if direction in _BACKWARD_DIRECTIONS else "forward"
    return stage, int(getattr(what, "mb", -1)), direction, getattr(what, "peer", None), phase


def _layout(rows: list[tuple[str, ...]]) -> list[str]:
    """Text rows in left-aligned columns, a rule under the first (the header)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


class CommRecord(NamedTuple):
    """One observed collective: the op that caused it, its kind, mesh dim and bytes, and
    the phase (``"forward"``, or ``"backward"``: ``op`` is then the op whose backward
    issued it). A pipeline's point-to-point message (kind ``"send"`` / ``"recv"``, op
    ``"pipeline"``) also has ``stage`` (this rank's stage), ``mb`` (-1 for a header or a
    tied gradient) and ``direction`` (``"activation"``, ``"gradient"``, ``"header"``,
    ``"tied"``); None for everything else."""

    op: str
    kind: str
    mesh_dim: int | None
    nbytes: int
    async_op: bool = False
    phase: str = "forward"
    stage: int | None = None
    mb: int | None = None
    direction: str | None = None

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
        mesh_dim = getattr(comm, "mesh_dim", None)
        is_async = bool(getattr(comm, "async_op", False))
        tag = p2p_tag(kind)
        if tag is not None:
            stage, mb, direction, _, phase = tag
            self.records.append(CommRecord(_PIPELINE, kind, mesh_dim, int(nbytes), is_async,
                                           phase, stage, mb, direction))
            return
        phase = "forward"
        op = None
        if _ag.in_backward():
            phase = "backward"
            op = _ag.current_backward()
        op = op or _dispatch.current_op() or _OUTSIDE_OPS
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

    def _p2p(self, value: object) -> dict[int, dict[str, int]]:
        out: dict[int, dict[str, int]] = {}
        for r in self.records:
            if r.stage is not None:
                per = out.setdefault(r.stage, {})
                key = f"{r.direction} {r.kind}"
                per[key] = per.get(key, 0) + (1 if value == "count" else r.nbytes)
        return dict(sorted(out.items()))

    def get_p2p_counts(self) -> dict[int, dict[str, int]]:
        """A pipeline's point-to-point messages by stage (this rank's stage that sends or
        receives them), then by ``"<direction> <send|recv>"`` (``"activation send"``,
        ``"gradient recv"``, ``"header send"``, ``"tied recv"``...). **Local**."""
        return self._p2p("count")

    def get_p2p_bytes(self) -> dict[int, dict[str, int]]:
        """The bytes of :meth:`get_p2p_counts`' messages, keyed the same way. **Local**."""
        return self._p2p("bytes")

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
        lines = _layout(rows)
        lines.append(
            f"total: {self.get_total_counts()} collectives, {self.get_total_bytes()} bytes"
        )
        lines += self._p2p_table()
        return "\n".join(lines)

    def _p2p_table(self) -> list[str]:
        """The section of a pipeline's point-to-point messages per stage and direction
        (none without them)."""
        counts, nbytes = self.get_p2p_counts(), self.get_p2p_bytes()
        if not counts:
            return []
        rows = [("stage", "direction", "sends", "bytes sent", "receives", "bytes received")]
        for stage, per in counts.items():
            directions = dict.fromkeys(k.rsplit(" ", 1)[0] for k in per)
            for d in directions:
                b = nbytes[stage]
                rows.append((str(stage), d, str(per.get(f"{d} send", 0)),
                             str(b.get(f"{d} send", 0)), str(per.get(f"{d} recv", 0)),
                             str(b.get(f"{d} recv", 0))))
        return ["", "point-to-point by pipeline stage (this rank's stages):", *_layout(rows)]

    def to_json(self) -> str:
        """The counts as a JSON document (totals, by kind, by op, by phase, a pipeline's
        point-to-point messages by stage, grouped rows). **Local**."""
        return json.dumps(
            {
                "total_counts": self.get_total_counts(),
                "total_bytes": self.get_total_bytes(),
                "async_counts": self.get_async_counts(),
                "by_kind": self.get_comm_counts(),
                "by_op": self.get_comm_counts_by_op(),
                "by_phase": self.get_comm_counts_by_phase(),
                "p2p_counts_by_stage": self.get_p2p_counts(),
                "p2p_bytes_by_stage": self.get_p2p_bytes(),
                "rows": self._groups(),
            }
        )
