"""Pipeline schedules as data: per pp rank, the ordered list of :class:`Action` s (forward,
backward, input-gradient and weight-gradient work of one stage on one micro-batch) that the
executor of :mod:`dtensor.pipelining._runtime` runs.

A schedule is made by a small list-scheduling simulation (:func:`simulate`): stages sit on pp
ranks round-robin (stage ``s`` on rank ``s % pp_size``), every action has a unit cost (a
forward 1, a full backward 2, its input and weight halves 1 each), and at each moment every
idle rank picks its next action by the schedule's rule:

- ``gpipe``: all forwards (micro-batch order), then all backwards;
- ``1f1b``: ``pp_size - rank - 1`` warm-up forwards, then one forward and one backward in
  turn, then the remaining backwards;
- ``interleaved_1f1b``: several stages per rank, forwards in Megatron's order (groups of
  ``pp_size`` micro-batches, chunk by chunk), backwards in the reverse chunk order,
  ``2 (pp_size - rank - 1) + (v - 1) pp_size`` warm-up forwards, then in turn (bubble
  ``(p - 1) / (v m + p - 1)`` when ``m`` is a multiple of ``p``; other counts fall back to
  a greedy rule where the strict order would stall);
- ``zero_bubble`` (PyTorch's ``ScheduleInterleavedZeroBubble``): the interleaved order with
  the backward split into ``I`` (input gradient, sent upstream at once) and ``W`` (weight
  gradient), which is deferred: a rank runs a ``W`` while its next ``F`` or ``I`` is not
  ready, and all that are left at the end. Stage 0 keeps whole backwards (``B``): it has no
  input gradient to send, so a split would only move its whole backward into the ``W``
  deferred to the end.

The order of the lists is all the executor uses; the unit costs only decide it. The module
is pure (no MPI, no tensors): the unit tests check each list's dependencies, its matched
sends and receives and its bubble against ``(p - 1) / (m + p - 1)``.
"""

from __future__ import annotations

from typing import NamedTuple

from placements.errors import PipelineError

__all__ = [
    "KINDS",
    "Action",
    "Message",
    "TimelineEvent",
    "bubble_fraction",
    "comm_pairs",
    "make_schedule",
    "simulate",
]

#: Schedule kinds and whether each splits the backward into ``I`` and ``W``.
KINDS = {"gpipe": False, "1f1b": False, "interleaved_1f1b": False, "zero_bubble": True}
#: Unit costs of the simulation.
COST = {"F": 1, "B": 2, "I": 1, "W": 1}


class Action(NamedTuple):
    """One unit of pipeline work: ``kind`` is ``"F"`` (forward), ``"B"`` (full backward),
    ``"I"`` (input gradient) or ``"W"`` (weight gradient) of ``stage`` on micro-batch
    ``mb``. Written as PyTorch writes it: ``"2F1"`` is stage 2's forward of micro-batch 1."""

    kind: str
    stage: int
    mb: int

    def __repr__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"


class TimelineEvent(NamedTuple):
    """One measured action of a step on this rank (``schedule.timeline``): ``kind``
    (``"F"``, ``"B"``, ``"I"``, ``"W"``) of ``stage`` on micro-batch ``mb``; ``start`` and
    ``end`` in seconds (``time.perf_counter``) from the step's origin, the moment its shape
    agreement (the step's one collective before the actions) returned, which is about the
    same moment on every rank; ``recv_wait``: the seconds of ``[start, end]`` spent waiting
    for the action's received input (the rest is compute); ``send_wait``: the seconds spent
    after ``end`` completing sends (for the rank's last action, the wait for every send
    still outstanding)."""

    stage: int
    mb: int
    kind: str
    start: float
    end: float
    recv_wait: float = 0.0
    send_wait: float = 0.0

    @property
    def busy(self) -> float:
        """Seconds of compute: ``end - start - recv_wait``."""
        return self.end - self.start - self.recv_wait


class Message(NamedTuple):
    """The ``what=`` the executor gives each point-to-point message (what
    ``dt.debug.CommDebugMode`` and ``dt.debug.explain`` read): ``stage`` is this rank's stage
    that sends or receives it, ``peer`` the stage at the other end, ``mb`` the micro-batch
    (-1 for a shape header or a tied gradient), ``direction`` ``"activation"`` (forward),
    ``"gradient"`` (backward), ``"header"`` (the dtype and shape, once) or ``"tied"`` (the
    sum of a tied parameter's gradient)."""

    stage: int
    mb: int
    direction: str
    peer: int

    def __str__(self) -> str:
        return f"pipeline stage {self.stage} {self.direction} mb {self.mb} (peer stage {self.peer})"


def _deps(a: Action, num_stages: int, split: bool) -> list[Action]:
    """The actions ``a`` needs done first."""
    back = "I" if split else "B"
    if a.kind == "F":
        return [Action("F", a.stage - 1, a.mb)] if a.stage > 0 else []
    if a.kind == "W":
        return [Action("I", a.stage, a.mb)]
    deps = [Action("F", a.stage, a.mb)]
    if a.stage < num_stages - 1:
        deps.append(Action(back, a.stage + 1, a.mb))
    return deps


def _orders(rank: int, pp: int, v: int, m: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(stage, mb) in Megatron's forward and backward orders for ``rank``: groups of ``pp``
    micro-batches, chunk by chunk (backward: chunks reversed)."""
    fwd, bwd = [], []
    for g in range(0, m, pp):
        mbs = range(g, min(g + pp, m))
        fwd += [(c * pp + rank, mb) for c in range(v) for mb in mbs]
        bwd += [((v - 1 - c) * pp + rank, mb) for c in range(v) for mb in mbs]
    return fwd, bwd


def simulate(kind: str, num_stages: int, pp_size: int, n_microbatches: int
             ) -> tuple[list[list[Action]], dict[Action, tuple[int, int]]]:
    """Run the list-scheduling simulation of a schedule. **Local** (pure).

    Every rank but GPipe's follows Megatron's strict order: ``warm-up`` forwards
    (``pp_size - rank - 1``, or ``2 (pp_size - rank - 1) + (v - 1) pp_size`` with ``v``
    stages per rank), then one forward and one backward in turn, then the remaining
    backwards; it waits when its next action is not ready (a zero-bubble rank runs a
    deferred ``W`` meanwhile). Where that order stalls (interleaved, a micro-batch count
    that is not a multiple of ``pp_size``), the rank instead runs any ready backward, else
    its next forward while fewer than ``warm-up + 1`` are in flight.

    Returns
    -------
    (orders, times)
        ``orders[r]``: rank ``r``'s actions in order; ``times[action]``: its simulated
        ``(start, end)`` in unit costs.

    Raises
    ------
    PipelineError
        An unknown kind, a stage count that is not a multiple of ``pp_size``, a single-stage
        kind with several stages per rank, fewer than one micro-batch.
    """
    if kind not in KINDS:
        raise PipelineError(f"pipeline schedule: unknown kind {kind!r} (one of {sorted(KINDS)})")
    if n_microbatches < 1:
        raise PipelineError(f"pipeline schedule {kind}: n_microbatches={n_microbatches} "
                            "must be at least 1")
    if pp_size < 1 or num_stages < pp_size or num_stages % pp_size:
        raise PipelineError(f"pipeline schedule {kind}: {num_stages} stages do not fill a pp "
                            f"mesh of {pp_size} ranks (each rank holds the same number)")
    if kind in ("gpipe", "1f1b") and num_stages != pp_size:
        raise PipelineError(f"pipeline schedule {kind}: runs one stage per pp rank, got "
                            f"{num_stages} stages on {pp_size} ranks (use an interleaved "
                            "schedule)")
    if kind != "gpipe":
        out = _run(kind, num_stages, pp_size, n_microbatches, strict=True)
        if out is not None:
            return out
    out = _run(kind, num_stages, pp_size, n_microbatches, strict=False)
    if out is None:  # pragma: no cover - the greedy rule never stalls
        raise PipelineError(f"pipeline schedule {kind}: stalls with {num_stages} stages, "
                            f"{pp_size} ranks, {n_microbatches} micro-batches")
    return out


def _warmup(kind: str, rank: int, pp: int, v: int, m: int) -> int:
    """Forwards a rank runs before its first backward."""
    if kind == "gpipe":
        return m * v
    if v == 1:
        return min(pp - rank - 1, m)
    return min(2 * (pp - rank - 1) + (v - 1) * pp, m * v)


def _run(kind: str, num_stages: int, pp_size: int, m: int, strict: bool
         ) -> tuple[list[list[Action]], dict[Action, tuple[int, int]]] | None:
    """The simulation of :func:`simulate` under one rule; None where it stalls."""
    v = num_stages // pp_size
    split = KINDS[kind]
    back = "I" if split else "B"
    fwd, bwd, warm = {}, {}, {}
    for r in range(pp_size):
        f, b = _orders(r, pp_size, v, m)
        fwd[r] = [Action("F", s, mb) for s, mb in f]
        # (stage 0 has no input gradient to send: its backward stays whole)
        bwd[r] = [Action("B" if s == 0 else back, s, mb) for s, mb in b]
        warm[r] = _warmup(kind, r, pp_size, v, m)
    wq: dict[int, list[Action]] = {r: [] for r in range(pp_size)}  # deferred W
    done: dict[Action, tuple[int, int]] = {}
    busy = dict.fromkeys(range(pp_size), 0)
    orders: list[list[Action]] = [[] for _ in range(pp_size)]
    nf = dict.fromkeys(range(pp_size), 0)
    nb = dict.fromkeys(range(pp_size), 0)
    total = (num_stages * 3 - 1) * m if split else num_stages * m * 2
    t = 0

    def ready(a: Action) -> bool:
        return all(d in done and done[d][1] <= t for d in _deps(a, num_stages, split))

    def main_action(r: int) -> Action | None:
        """The rank's next forward or backward under the rule, if ready."""
        fwd_left = nf[r] < len(fwd[r])
        bwd_left = nb[r] < len(bwd[r])
        if kind == "gpipe" or strict:
            if fwd_left and (nf[r] < warm[r] or not bwd_left or nf[r] - warm[r] == nb[r]):
                a = fwd[r][nf[r]]
            elif bwd_left:
                a = bwd[r][nb[r]]
            else:
                return None
            return a if ready(a) else None
        if bwd_left and nb[r] < nf[r] and ready(bwd[r][nb[r]]):
            return bwd[r][nb[r]]
        if fwd_left and nf[r] - nb[r] <= warm[r] and ready(fwd[r][nf[r]]):
            return fwd[r][nf[r]]
        return None

    while len(done) < total:
        for r in range(pp_size):
            if busy[r] > t:
                continue
            pick = main_action(r)
            if pick is not None and pick.kind == "F":
                nf[r] += 1
            elif pick is not None:
                nb[r] += 1
                if pick.kind == "I":
                    wq[r].append(Action("W", pick.stage, pick.mb))
            elif wq[r]:
                pick = wq[r].pop(0)
            if pick is not None:
                done[pick] = (t, t + COST[pick.kind])
                busy[r] = t + COST[pick.kind]
                orders[r].append(pick)
        later = [b for b in busy.values() if b > t]
        if not later:
            return None if len(done) < total else (orders, done)
        t = min(later)
    return orders, done


def make_schedule(kind: str, num_stages: int, pp_size: int, n_microbatches: int
                  ) -> list[list[Action]]:
    """Each pp rank's ordered action list for a schedule (see :func:`simulate`). **Local**."""
    return simulate(kind, num_stages, pp_size, n_microbatches)[0]


def comm_pairs(orders: list[list[Action]], num_stages: int
               ) -> tuple[list[tuple[int, int, str, int, int]], list[tuple[int, int, str, int, int]]]:
    """The messages the executor sends and receives for ``orders`` (rank lists). **Local**.

    Returns ``(sends, recvs)``, each a list of ``(from_rank, to_rank, what, stage, mb)`` where
    ``what`` is ``"act"`` (the output of ``stage`` going to ``stage + 1``) or ``"grad"`` (the
    input gradient of ``stage`` going to ``stage - 1``); messages between two stages of one
    rank are handed over in memory and left out.
    """
    pp = len(orders)
    sends, recvs = [], []
    for r, acts in enumerate(orders):
        for a in acts:
            if a.kind == "F" and a.stage < num_stages - 1 and (a.stage + 1) % pp != r:
                sends.append((r, (a.stage + 1) % pp, "act", a.stage, a.mb))
            if a.kind == "F" and a.stage > 0 and (a.stage - 1) % pp != r:
                recvs.append(((a.stage - 1) % pp, r, "act", a.stage - 1, a.mb))
            if a.kind in "BI" and a.stage > 0 and (a.stage - 1) % pp != r:
                sends.append((r, (a.stage - 1) % pp, "grad", a.stage, a.mb))
            if a.kind in "BI" and a.stage < num_stages - 1 and (a.stage + 1) % pp != r:
                recvs.append(((a.stage + 1) % pp, r, "grad", a.stage + 1, a.mb))
    return sends, recvs


def bubble_fraction(orders: list[list[Action]], times: dict[Action, tuple[int, int]]
                    ) -> float:
    """The idle share of the simulated run: ``1 - busy / (ranks x makespan)``. **Local**."""
    span = max(end for _, end in times.values())
    busy = sum(end - start for start, end in times.values())
    return 1.0 - busy / (len(orders) * span)
