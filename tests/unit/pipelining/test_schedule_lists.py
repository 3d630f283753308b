"""The schedules of ``dt.pipelining`` as data: each rank's action list holds every action
once, never runs a backward before its forward (nor a W before its I), its sends and
receives pair up, a replay with blocking receives (each rank runs its list in order and
waits for what it receives) finishes, and the bubble of GPipe and 1F1B is the theory's
``(p - 1) / (m + p - 1)``; the zero-bubble schedule's is smaller. Checked here by an
independent replay of the lists, not by the generator's own timing."""

from __future__ import annotations

from collections import Counter

import pytest

from dtensor.errors import PipelineError
from dtensor.pipelining import Action, comm_pairs, make_schedule

pytestmark = pytest.mark.mode_independent

CASES = [(k, s, p) for k, s, p in [
    ("gpipe", 2, 2), ("gpipe", 4, 4), ("1f1b", 2, 2), ("1f1b", 4, 4), ("1f1b", 3, 3),
    ("interleaved_1f1b", 4, 2), ("interleaved_1f1b", 8, 4), ("interleaved_1f1b", 6, 3),
    ("zero_bubble", 2, 2), ("zero_bubble", 4, 2), ("zero_bubble", 4, 4),
    ("zero_bubble", 8, 4)]]
MS = [1, 2, 3, 4, 8]
COST = {"F": 1, "B": 2, "I": 1, "W": 1}


def replay(orders, n_stages):
    """Run the lists with unit costs, each rank in its order, an action starting once the
    actions it needs (on any rank) have ended: ``{action: (start, end)}``. Fails on a
    deadlock. Independent of the generator: dependencies written out here."""
    split = any(a.kind == "I" for o in orders for a in o)
    back = "I" if split else "B"

    def needs(a):
        if a.kind == "F":
            return [Action("F", a.stage - 1, a.mb)] if a.stage else []
        if a.kind == "W":
            return [Action("I", a.stage, a.mb)]
        out = [Action("F", a.stage, a.mb)]
        if a.stage < n_stages - 1:
            out.append(Action(back, a.stage + 1, a.mb))
        return out

    pos = [0] * len(orders)
    free = [0] * len(orders)
    end: dict = {}
    while any(pos[r] < len(o) for r, o in enumerate(orders)):
        moved = False
        for r, o in enumerate(orders):
            if pos[r] == len(o):
                continue
            a = o[pos[r]]
            if all(d in end for d in needs(a)):
                start = max([free[r]] + [end[d] for d in needs(a)])
                end[a] = start + COST[a.kind]
                free[r] = end[a]
                pos[r] += 1
                moved = True
        assert moved, f"deadlock at {[o[pos[r]] if pos[r] < len(o) else None for r, o in enumerate(orders)]}"
    return end


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize(("kind", "n_stages", "pp"), CASES)
def test_lists_are_complete_ordered_and_matched(kind, n_stages, pp, m):
    orders = make_schedule(kind, n_stages, pp, m)
    every = Counter(a for o in orders for a in o)
    assert set(every.values()) == {1}
    # the zero-bubble split on every stage but the first (no input gradient to send early)
    assert set(every) == {Action(k, s, mb) for s in range(n_stages) for mb in range(m)
                          for k in ("FIW" if kind == "zero_bubble" and s else "FB")}
    for r, o in enumerate(orders):
        assert all(a.stage % pp == r for a in o), f"rank {r} runs another rank's stage"
        seen = set()
        for a in o:
            if a.kind in "BI":
                assert Action("F", a.stage, a.mb) in seen, f"{a} before its forward"
            if a.kind == "W":
                assert Action("I", a.stage, a.mb) in seen, f"{a} before its I"
            seen.add(a)
    sends, recvs = comm_pairs(orders, n_stages)
    assert Counter(sends) == Counter(recvs)
    expected = sum(1 for s in range(n_stages - 1) if (s + 1) % pp != s % pp) * m * 2
    assert len(sends) == expected
    replay(orders, n_stages)


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_bubble_is_the_theory(kind, p, m):
    end = replay(make_schedule(kind, p, p, m), p)
    span = max(end.values())
    busy = m * p * (COST["F"] + COST["B"])
    assert 1 - busy / (p * span) == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("m", [2, 4, 8])
@pytest.mark.parametrize("p", [2, 4])
def test_zero_bubble_beats_1f1b(p, m):
    ref = max(replay(make_schedule("1f1b", p, p, m), p).values())
    zb = max(replay(make_schedule("zero_bubble", p, p, m), p).values())
    assert zb < ref


@pytest.mark.parametrize("p", [2, 4])
def test_1f1b_keeps_fewer_microbatches_in_flight(p):
    m = 8

    def peak(orders, rank):
        live = top = 0
        for a in orders[rank]:
            live += 1 if a.kind == "F" else -1
            top = max(top, live)
        return top

    gpipe, one = make_schedule("gpipe", p, p, m), make_schedule("1f1b", p, p, m)
    for r in range(p):
        assert peak(gpipe, r) == m
        assert peak(one, r) == p - r


@pytest.mark.parametrize(("kind", "n", "p", "m", "match"), [
    ("1f1b", 4, 2, 2, "runs one stage per pp rank"),
    ("gpipe", 3, 2, 2, "do not fill a pp mesh"),
    ("interleaved_1f1b", 4, 2, 0, "n_microbatches=0"),
    ("round_robin", 2, 2, 2, "unknown kind"),
])
def test_bad_schedules(kind, n, p, m, match):
    with pytest.raises(PipelineError, match=match):
        make_schedule(kind, n, p, m)


@pytest.mark.parametrize(("p", "v", "m"), [(2, 2, 2), (2, 2, 4), (2, 2, 8), (4, 2, 4),
                                           (4, 2, 8), (2, 3, 4), (3, 2, 6)])
def test_interleaved_bubble_is_megatrons(p, v, m):
    """With ``m`` a multiple of ``p``: ``(p - 1) / (v m + p - 1)``, less than 1F1B's."""
    end = replay(make_schedule("interleaved_1f1b", p * v, p, m), p * v)
    span = max(end.values())
    busy = m * p * v * (COST["F"] + COST["B"])
    assert 1 - busy / (p * span) == pytest.approx((p - 1) / (v * m + p - 1))
