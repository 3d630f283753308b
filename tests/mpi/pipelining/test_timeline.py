"""Measured pipeline timelines and point-to-point visibility on the GPT tiny config (vocab
64, d 32, seq 16), every schedule this world runs (the pp mesh is the world): each rank's
``schedule.timeline`` holds one forward and one backward (or one ``I`` and one ``W``) per
stage and micro-batch, in the schedule's order, with nonnegative ordered times;
``dt.debug.visualize_schedule`` prints on pp rank 0 only and draws a PNG there; a schedule
that has not stepped raises on every rank; CommDebugMode and ``dt.debug.explain`` count the
activations and gradients per stage with the bytes computed by hand (micro-batch x seq x d
x 4)."""

from __future__ import annotations

import io
import os

import pytest
from mpi4py import MPI

import dtensor as dt
from dtensor import pipelining as pp
from dtensor.errors import PipelineError
from launch.examples.gpt import GPT, GPTConfig, batch

WORLD = MPI.COMM_WORLD.Get_size()
RANK = MPI.COMM_WORLD.Get_rank()
F = dt.nn.functional
BATCH, SEQ, D = 8, 16, 32
pytestmark = pytest.mark.mpi(min_size=1)

SCHEDULES = {
    "gpipe": (pp.ScheduleGPipe, 1),
    "1f1b": (pp.Schedule1F1B, 1),
    "interleaved": (pp.ScheduleInterleaved1F1B, 2),
    "zero_bubble": (pp.ScheduleInterleavedZeroBubble, 1),
}
#: (schedule, stages per rank) this world runs: one stage per rank needs 2+ ranks.
CASES = [(name, v) for name, (_, v) in SCHEDULES.items() for v in (v,)
         if WORLD * v >= 2]
CASES += [("zero_bubble", 2)] if WORLD == 1 else []


def loss_fn(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _build(name, per_rank, m):
    mesh = dt.init_device_mesh((WORLD,), mesh_dim_names=("pp",))
    n = WORLD * per_rank
    dt.manual_seed(7)
    cfg = GPTConfig(vocab_size=64, block_size=SEQ, n_layer=n, n_head=4, d_model=D)
    mods = pp.pipeline_split(GPT(cfg), n, stages=range(RANK, n, WORLD))
    stages = [pp.PipelineStage(mods[s], s, n, mesh) for s in sorted(mods)]
    cls = SCHEDULES[name][0]
    sched = cls(stages[0], m, loss_fn) if cls in (pp.ScheduleGPipe, pp.Schedule1F1B) else (
        cls(stages, m, loss_fn))
    return cfg, mods, sched


def _args(cfg, mods, n, seed=0):
    x, y = batch(cfg, BATCH, seed)
    return ((x,) if 0 in mods else ()), {"target": y if n - 1 in mods else None}


def _step(cfg, mods, sched, seed=0):
    args, kwargs = _args(cfg, mods, sched.num_stages, seed)
    sched.step(*args, **kwargs)


@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize(("name", "per_rank"), CASES)
def test_timeline_has_every_action_once_in_order(name, per_rank, m):
    cfg, mods, sched = _build(name, per_rank, m)
    for seed in range(2):  # the first step also agrees shapes; the timeline is the last's
        _step(cfg, mods, sched, seed)
    tl = sched.timeline
    def kinds_of(stage):  # the zero-bubble split on every stage but the first
        return "FIW" if name == "zero_bubble" and stage else "FB"

    want = sorted((k, s, mb) for s in mods for mb in range(m) for k in kinds_of(s))
    assert sorted((e.kind, e.stage, e.mb) for e in tl) == want
    assert [(e.kind, e.stage, e.mb) for e in tl] == [(a.kind, a.stage, a.mb)
                                                     for a in sched.actions]
    for stage in mods:  # per stage and micro-batch: F before B (before I before W)
        kinds = kinds_of(stage)
        for mb in range(m):
            at = {e.kind: i for i, e in enumerate(tl) if (e.stage, e.mb) == (stage, mb)}
            assert [at[k] for k in kinds] == sorted(at[k] for k in kinds)
    prev_end = 0.0
    for e in tl:
        assert 0.0 <= prev_end <= e.start <= e.start + e.recv_wait <= e.end
        assert e.recv_wait >= 0.0 and e.send_wait >= 0.0 and e.busy > 0.0
        prev_end = e.end + e.send_wait


@pytest.mark.parametrize(("name", "per_rank"), CASES[:2])
def test_visualize_prints_on_rank_0_and_draws_a_png(name, per_rank, folder):
    m = 4
    cfg, mods, sched = _build(name, per_rank, m)
    _step(cfg, mods, sched)
    out = io.StringIO()
    png = os.path.join(folder, "timeline.png")
    text = dt.debug.visualize_schedule(sched, png=png, file=out, width=60)
    printed = out.getvalue()
    n = sched.num_stages
    if RANK == 0:
        assert printed == text + "\n"
        # matplotlib is a test dependency (the [test] extra): the PNG is always drawn here
        with open(png, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    else:
        assert printed == ""
    lines = text.splitlines()
    rows = [ln for ln in lines if " |" in ln]
    assert [r.split(" |")[0] for r in rows] == [f"r{s % WORLD}/s{s}" for s in range(n)]
    for s, r in zip(range(n), rows):
        cells = r.split("|")[1]
        assert len(cells) == 60
        assert "F" in cells and ("B" in cells or "I" in cells)
    v = n // WORLD
    theory = (WORLD - 1) / (v * m + WORLD - 1)
    assert f"= {theory:.1%} (p={WORLD}, m={m}, {n} stages)" in lines[-2]
    assert text == MPI.COMM_WORLD.bcast(text)  # the same chart on every rank


def test_no_step_raises_on_every_rank():
    _, _, sched = _build(*CASES[0], 2)
    with pytest.raises(PipelineError, match=r"pp ranks \[.*\] have no timeline; call "
                                            r"schedule.step"):
        dt.debug.visualize_schedule(sched)
    assert MPI.COMM_WORLD.allreduce(1) == WORLD  # every rank got here: none hangs


def _expected_p2p(mods, n, m):
    """Per stage of this rank: bytes per direction, by hand (the stage boundary carries the
    (micro-batch, seq, d) float32 hidden state both ways); stages on one rank hand over in
    memory."""
    act = (BATCH // m) * SEQ * D * 4
    out = {}
    for s in mods:
        per = {}
        if s > 0 and (s - 1) % WORLD != RANK:
            per["activation recv"] = per["gradient send"] = m * act
        if s < n - 1 and (s + 1) % WORLD != RANK:
            per["activation send"] = per["gradient recv"] = m * act
        if per:
            out[s] = per
    return out


def _pipeline_only(p2p):
    return {s: {k: v for k, v in per.items() if k.split()[0] in ("activation", "gradient")}
            for s, per in p2p.items()}


@pytest.mark.parametrize(("name", "per_rank"), CASES)
def test_comm_mode_p2p_bytes_per_stage(name, per_rank):
    m = 4
    cfg, mods, sched = _build(name, per_rank, m)
    n = sched.num_stages
    want = _expected_p2p(mods, n, m)
    for seed in range(2):  # the first step also sends the shape headers (96 bytes)
        with dt.debug.CommDebugMode() as mode:
            _step(cfg, mods, sched, seed)
        got = mode.get_p2p_bytes()
        assert {s: v for s, v in _pipeline_only(got).items() if v} == want
        counts = _pipeline_only(mode.get_p2p_counts())
        assert all(c == m for per in counts.values() for c in per.values())
        headers = sum(v for per in got.values() for k, v in per.items() if k.startswith("head"))
        boundaries = sum(("activation send" in per) + ("activation recv" in per)
                         for per in want.values())
        assert headers == (96 * boundaries if seed == 0 else 0)
        phases = {r.direction: r.phase for r in mode.records if r.stage is not None}
        assert phases.get("activation", "forward") == "forward"
        assert phases.get("gradient", "backward") == "backward"
        if want:
            assert "point-to-point by pipeline stage" in mode.table()


@pytest.mark.parametrize(("name", "per_rank"), CASES[:2])
def test_explain_lists_messages_per_stage(name, per_rank):
    m = 2
    cfg, mods, sched = _build(name, per_rank, m)
    n = sched.num_stages
    _step(cfg, mods, sched)  # headers out of the way
    args, kwargs = _args(cfg, mods, n, 1)
    e = dt.debug.explain(sched.step, *args, top=0, **kwargs)
    want = _expected_p2p(mods, n, m)
    assert {s: v for s, v in _pipeline_only(e.p2p_bytes()).items() if v} == want
    tied = [msg for msg in e.messages if msg.direction == "tied"]
    for msg in e.messages:
        assert msg.phase == ("forward" if msg.direction == "activation" else "backward")
        if msg.direction == "tied":  # the head's weight is the token embedding's (64 x d)
            assert (msg.stage, msg.peer) in ((0, n - 1), (n - 1, 0))
            assert msg.nbytes == 64 * D * 4
            continue
        assert msg.peer == msg.stage + (1 if (msg.direction == "activation")
                                        == (msg.kind == "send") else -1)
        assert msg.nbytes == (BATCH // m) * SEQ * D * 4
    assert len(tied) == (2 if {0, n - 1} & set(mods) and (n - 1) % WORLD != 0 else 0)
    text = str(e)
    if want:
        assert "point-to-point (pipeline)" in text
        for s in want:
            assert f"  stage {s}: " in text
