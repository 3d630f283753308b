"""``visualize_schedule``: the measured timeline of a pipeline schedule's last step.

This module owns the gathering of every pp rank's last-step timeline (``schedule.timeline``,
the executor's per-action records of :mod:`dtensor.pipelining`), its text rendering (one
row per stage, time on the x axis, each action drawn with its kind and micro-batch, idle and
waiting as ``.``; busy time per stage, the measured bubble and the theory) and an optional
PNG drawing of the same when matplotlib is installed.

The debug layer sits below the pipelining feature, so a schedule is read through its public
attributes only (``timeline``, ``comm``, ``pp_rank``, ``pp_size``, ``num_stages``,
``n_microbatches``); an event is any record with the fields of
:class:`dtensor.pipelining.TimelineEvent` (``stage, mb, kind, start, end, recv_wait,
send_wait``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, TextIO

import numpy as np

from placements.errors import ArgumentError, DTypeError, PipelineError
from redistribute.explain import format_seconds

__all__ = ["render_timeline", "visualize_schedule"]

#: Action kinds, in the order their codes travel in the gathered array.
KINDS = "FBIW"
#: Fields of one event in the gathered array.
_FIELDS = 7
#: What each kind stands for (legend and PNG colours).
_NAMES = {"F": "forward", "B": "backward", "I": "input grad", "W": "weight grad"}
_COLORS = {"F": "tab:blue", "B": "tab:orange", "I": "tab:green", "W": "tab:red"}
_ATTRS = ("timeline", "comm", "pp_rank", "pp_size", "num_stages", "n_microbatches")


def theory_bubble(pp_size: int, num_stages: int, n_microbatches: int) -> tuple[float, str]:
    """The textbook bubble ``(p-1)/(m+p-1)`` (GPipe, 1F1B: one stage per rank) or
    ``(p-1)/(vm+p-1)`` (``v`` stages per rank, interleaved), and that formula. **Local**."""
    p, m = pp_size, n_microbatches
    v = num_stages // p
    if v > 1:
        return (p - 1) / (v * m + p - 1), f"(p-1)/(vm+p-1) = {p - 1}/{v * m + p - 1}"
    return (p - 1) / (m + p - 1), f"(p-1)/(m+p-1) = {p - 1}/{m + p - 1}"


def _col(t: float, span: float, width: int) -> int:
    """The character cell where time ``t`` falls (rounded to the nearest boundary)."""
    return min(max(int(t / span * width + 0.5), 0), width)


def _row(events: Sequence[Any], span: float, width: int) -> str:
    """``width`` characters: each event's compute (after its receive wait) as its kind and
    micro-batch (``F3``; cut to the cells it covers, at least one), idle as ``.``."""
    cells = ["."] * width
    for e in events:
        a = min(_col(e.start + e.recv_wait, span, width), width - 1)
        b = max(_col(e.end, span, width), a + 1)
        label = f"{e.kind}{e.mb}"
        for i in range(a, min(b, width)):
            cells[i] = label[i - a] if i - a < len(label) else " "
    return "".join(cells)


def render_timeline(
    events_by_rank: Sequence[Sequence[Any]],
    num_stages: int,
    n_microbatches: int,
    *,
    width: int = 80,
    title: str | None = None,
) -> str:
    """The text chart of one step's measured events. **Local** (pure).

    Parameters
    ----------
    events_by_rank : sequence of sequences of TimelineEvent
        Per pp rank, its events (``stage, mb, kind, start, end, recv_wait, send_wait``;
        seconds from the step's common origin). Stage ``s`` lives on rank ``s % pp_size``.
    num_stages, n_microbatches : int
    width : int
        Character cells of the time axis (the step's span: the last end of any rank).
    title : str, optional
        A first line.

    Returns
    -------
    str
        A header with the time axis, one row ``r<rank>/s<stage> |...|`` per stage with its
        busy time (compute: ``end - start - recv_wait``), its share of the span and its
        receive and send waits, then the bubble line: measured ``1 - busy / (p x span)``
        over the ranks against the theory (:func:`theory_bubble`), and a legend.
    """
    p = len(events_by_rank)
    if p < 1 or not isinstance(width, int) or width < 8:
        raise ArgumentError(f"visualize_schedule: needs at least one rank's events and an int "
                            f"width >= 8, "
                            f"got {p} ranks, width={width!r}")
    span = max((e.end for evs in events_by_rank for e in evs), default=0.0)
    if span <= 0.0:
        raise PipelineError("visualize_schedule: the timeline has no event of positive "
                            "duration (has the schedule stepped?)")
    rows, busy_total = [], 0.0
    for s in range(num_stages):
        r = s % p
        mine = [e for e in events_by_rank[r] if e.stage == s]
        busy = sum(e.end - e.start - e.recv_wait for e in mine)
        busy_total += busy
        recv = sum(e.recv_wait for e in mine)
        send = sum(e.send_wait for e in mine)
        stats = (f"busy {format_seconds(busy)} ({busy / span:.0%}), waited "
                 f"{format_seconds(recv)} recv, {format_seconds(send)} send")
        rows.append((f"r{r}/s{s}", _row(mine, span, width), stats))
    name_w = max(len(n) for n, _, _ in rows)
    measured = 1.0 - busy_total / (p * span)
    theory, formula = theory_bubble(p, num_stages, n_microbatches)
    end_label = format_seconds(span)
    axis = "0" + " " * max(width - 1 - len(end_label), 1) + end_label
    lines = [title] if title else []
    lines.append(" " * (name_w + 2) + axis)
    lines += [f"{n.ljust(name_w)} |{cells}| {stats}" for n, cells, stats in rows]
    lines.append(f"bubble: measured {measured:.1%} (1 - busy / ({p} ranks x "
                 f"{format_seconds(span)})), theory {formula} = {theory:.1%} "
                 f"(p={p}, m={n_microbatches}, {num_stages} stages)")
    kinds = sorted({e.kind for evs in events_by_rank for e in evs}, key=KINDS.index)
    lines.append("legend: " + ", ".join(f"{k} {_NAMES[k]}" for k in kinds)
                 + " (then the micro-batch), . idle or waiting for a receive")
    return "\n".join(lines)


def _pack(timeline: Sequence[Any]) -> np.ndarray:
    """This rank's events as ``float64[n * 7]`` (the kind as its index in ``KINDS``)."""
    out = np.empty((len(timeline), _FIELDS), np.float64)
    for i, e in enumerate(timeline):
        out[i] = (e.stage, e.mb, KINDS.index(e.kind), e.start, e.end, e.recv_wait, e.send_wait)
    return out.reshape(-1)


class _Event:
    """An unpacked event (the fields of ``TimelineEvent``)."""

    __slots__ = ("end", "kind", "mb", "recv_wait", "send_wait", "stage", "start")

    def __init__(self, row: np.ndarray) -> None:
        self.stage, self.mb = int(row[0]), int(row[1])
        self.kind = KINDS[int(row[2])]
        self.start, self.end, self.recv_wait, self.send_wait = (float(v) for v in row[3:])


def _gather(schedule: Any) -> list[list[_Event]]:
    """Every pp rank's last-step events, on every rank. **Collective** over pp: one
    all-gather of the counts (a rank with none raises on every rank), one of the data."""
    comm = schedule.comm
    timeline = list(schedule.timeline)
    counts = comm.allgather_ints([len(timeline)], what="visualize_schedule counts")[:, 0]
    empty = [r for r, n in enumerate(counts.tolist()) if n == 0]
    if empty:
        raise PipelineError(
            f"visualize_schedule({type(schedule).__name__}): pp ranks {empty} have no "
            "timeline; call schedule.step(...) on every rank first")
    mine = _pack(timeline)
    data = np.empty(int(counts.sum()) * _FIELDS, np.float64)
    comm.allgatherv(mine, data, [int(n) * _FIELDS for n in counts],
                    what="visualize_schedule events")
    out, at = [], 0
    for n in counts.tolist():
        rows = data[at * _FIELDS:(at + n) * _FIELDS].reshape(n, _FIELDS)
        out.append([_Event(row) for row in rows])
        at += n
    return out


def visualize_schedule(
    schedule: Any,
    *,
    png: str | None = None,
    width: int = 80,
    file: TextIO | None = None,
    rank: int | None = 0,
) -> str:
    """Print the measured timeline of a pipeline schedule's last ``step``. **Collective**
    over the schedule's pp mesh: every rank gathers every rank's ``schedule.timeline``.

    The chart (see :func:`render_timeline`) has one row per stage (``r<pp rank>/s<stage>``),
    time on the x axis (``width`` cells over the step's span, from the common origin after
    the step's shape agreement to the last action's end), each action drawn as its kind
    and micro-batch (``F0 F1 ... B0``; ``I``/``W`` for the zero-bubble halves), idle time and
    waits for received inputs as ``.``; per stage its busy (compute) time, and the measured
    bubble ``1 - busy / (p x span)`` next to the theory ``(p-1)/(m+p-1)`` (GPipe, 1F1B) or
    ``(p-1)/(vm+p-1)`` (``v`` stages per rank).

    Parameters
    ----------
    schedule : a dt.pipelining schedule
        One that has stepped on every rank (its ``timeline`` holds the last step's events).
    png : str, optional
        Also draw the chart into this PNG file (needs matplotlib), on the printing rank.
    width : int
        Character cells of the time axis.
    file : text stream, optional
        Where the printing rank writes (default ``sys.stdout``).
    rank : int or None
        The pp rank that prints (and draws the PNG): 0 by default; None prints on none
        (every rank still gets the text back).

    Returns
    -------
    str
        The chart, on every rank.

    Raises
    ------
    PipelineError
        On every rank at once: a schedule that has not stepped on some rank.
    TypeError
        Not a schedule (raised before any communication).
    ValueError
        ``width`` below 8, ``rank`` not a pp rank (before any communication).
    ImportError
        ``png`` without matplotlib installed (on the printing rank).
    """
    missing = [a for a in _ATTRS if not hasattr(schedule, a)]
    if missing:
        raise DTypeError(f"visualize_schedule: expected a dt.pipelining schedule, got "
                         f"{type(schedule).__name__} (no {', '.join(missing)})")
    if rank is not None and not 0 <= rank < schedule.pp_size:
        raise ArgumentError(f"visualize_schedule: rank={rank!r} is not a pp rank of "
                            f"[0, {schedule.pp_size})")
    if not isinstance(width, int) or width < 8:
        raise ArgumentError(f"visualize_schedule: width={width!r} must be an int >= 8")
    events = _gather(schedule)
    p, n, m = schedule.pp_size, schedule.num_stages, schedule.n_microbatches
    title = (f"{type(schedule).__name__}: {n} stages on {p} pp ranks, {m} micro-batches "
             "(last step, measured)")
    text = render_timeline(events, n, m, width=width, title=title)
    if rank is not None and schedule.pp_rank == rank:
        print(text, file=file if file is not None else sys.stdout, flush=True)
        if png is not None:
            _draw_png(events, n, m, png, title)
    return text


def _draw_png(events: list[list[_Event]], num_stages: int, m: int, path: str,
              title: str) -> None:
    """The chart as horizontal bars, one row per stage (matplotlib)."""
    try:
        import matplotlib  # lazy: optional third-party package, only for png=

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # lazy: as above
    except ImportError as exc:
        raise ImportError("visualize_schedule(png=...) needs matplotlib installed "
                          "(pip install matplotlib)") from exc
    p = len(events)
    span = max(e.end for evs in events for e in evs)
    busy = sum(e.end - e.start - e.recv_wait for evs in events for e in evs)
    theory, formula = theory_bubble(p, num_stages, m)
    fig, ax = plt.subplots(figsize=(12, 0.6 * num_stages + 1.6))
    for s in range(num_stages):
        y = num_stages - 1 - s
        for e in (e for e in events[s % p] if e.stage == s):
            t0 = e.start + e.recv_wait
            if e.recv_wait > 0:
                ax.broken_barh([(e.start * 1e3, e.recv_wait * 1e3)], (y - 0.4, 0.8),
                               facecolors="0.85")
            ax.broken_barh([(t0 * 1e3, (e.end - t0) * 1e3)], (y - 0.4, 0.8),
                           facecolors=_COLORS[e.kind], edgecolor="k", linewidth=0.5)
            if (e.end - t0) / span > 0.02:
                ax.text((t0 + e.end) / 2 * 1e3, y, f"{e.kind}{e.mb}", ha="center",
                        va="center", fontsize=8, color="white")
    ax.set_yticks(range(num_stages))
    ax.set_yticklabels([f"r{s % p}/s{s}" for s in reversed(range(num_stages))])
    ax.set_xlim(0, span * 1e3)
    ax.set_xlabel("ms since the step's start")
    ax.set_title(f"{title}\nbubble measured {1 - busy / (p * span):.1%}, theory {formula} "
                 f"= {theory:.1%} (grey: waiting for a receive)")
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
