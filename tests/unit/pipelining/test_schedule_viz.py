"""The text timeline of ``dt.debug.visualize_schedule`` rendered from synthetic events
(:func:`dtensor.debug._schedule_viz.render_timeline`, pure): exact characters of a small
2-stage GPipe step, the measured bubble against the theory, interleaved and zero-bubble
rows, labels cut to short actions, bad input; and CommDebugMode's per-stage count of
tagged point-to-point messages (observers fed by ``redistribute.comm.notify``)."""

from __future__ import annotations

import pytest

import dtensor as dt
from dtensor.debug._schedule_viz import render_timeline, theory_bubble
from dtensor.errors import PipelineError
from dtensor.pipelining import Message, TimelineEvent
from redistribute import comm as C

MS = 1e-3


def ev(stage, mb, kind, start, end, recv_wait=0.0, send_wait=0.0):
    """An event with its times in milliseconds."""
    return TimelineEvent(stage, mb, kind, start * MS, end * MS, recv_wait * MS, send_wait * MS)


def gpipe_2x2():
    """The ideal GPipe step of 2 stages and 2 micro-batches, forward 1 ms, backward 2 ms;
    stage 1 waits 1 ms for its first activation."""
    rank0 = [ev(0, 0, "F", 0, 1), ev(0, 1, "F", 1, 2), ev(0, 0, "B", 2, 7, recv_wait=3),
             ev(0, 1, "B", 7, 9, send_wait=0.5)]
    rank1 = [ev(1, 0, "F", 0, 2, recv_wait=1), ev(1, 1, "F", 2, 3), ev(1, 0, "B", 3, 5),
             ev(1, 1, "B", 5, 7)]
    return [rank0, rank1]


def test_gpipe_two_stages_exact_text():
    text = render_timeline(gpipe_2x2(), 2, 2, width=18, title="GPipe")
    # 9 ms over 18 cells: 2 cells per ms; rank 0 idles 2-5 ms (its first B waits 3 ms),
    # rank 1 before its first F (1 ms) and after its last B (7-9 ms)
    assert text.splitlines() == [
        "GPipe",
        "       0          9.00 ms",
        "r0/s0 |F0F1......B0  B1  | busy 6.00 ms (67%), waited 3.00 ms recv, 0.50 ms send",
        "r1/s1 |..F0F1B0  B1  ....| busy 6.00 ms (67%), waited 1.00 ms recv, 0.0 us send",
        ("bubble: measured 33.3% (1 - busy / (2 ranks x 9.00 ms)), theory (p-1)/(m+p-1) = "
         "1/3 = 33.3% (p=2, m=2, 2 stages)"),
        "legend: F forward, B backward (then the micro-batch), . idle or waiting for a receive",
    ]


def test_measured_bubble_reads_the_idle_share_not_the_theory():
    # the same step with a 3 ms stall at the end of rank 1: the span grows to 12 ms
    events = gpipe_2x2()
    events[1][-1] = ev(1, 1, "B", 5, 12, recv_wait=5)
    text = render_timeline(events, 2, 2, width=24)
    busy = 6 + 6  # ms of compute over both ranks, unchanged
    measured = 1 - busy / (2 * 12)
    assert f"bubble: measured {measured:.1%}" in text
    assert "theory (p-1)/(m+p-1) = 1/3 = 33.3%" in text
    assert "r1/s1 |..F0F1B0  ..........B1  |" in text  # the wait is drawn idle


def test_theory_formulas():
    assert theory_bubble(4, 4, 8) == (pytest.approx(3 / 11), "(p-1)/(m+p-1) = 3/11")
    assert theory_bubble(2, 4, 4) == (pytest.approx(1 / 9), "(p-1)/(vm+p-1) = 1/9")
    assert theory_bubble(1, 2, 3)[0] == 0.0


def test_interleaved_rows_per_stage_and_zero_bubble_kinds():
    # 2 ranks, 4 stages (stage s on rank s % 2), one micro-batch, unit costs of 1 ms
    rank0 = [ev(0, 0, "F", 0, 1), ev(2, 0, "F", 2, 3), ev(2, 0, "I", 4, 5), ev(0, 0, "I", 6, 7),
             ev(2, 0, "W", 7, 8), ev(0, 0, "W", 8, 9)]
    rank1 = [ev(1, 0, "F", 0, 2, recv_wait=1), ev(3, 0, "F", 3, 4, recv_wait=0),
             ev(3, 0, "I", 4, 4.5), ev(1, 0, "I", 5, 6), ev(3, 0, "W", 6, 7),
             ev(1, 0, "W", 7, 8)]
    lines = render_timeline([rank0, rank1], 4, 1, width=9).splitlines()
    assert [ln.split(" |")[0] for ln in lines[1:5]] == ["r0/s0", "r1/s1", "r0/s2", "r1/s3"]
    assert lines[1] == ("r0/s0 |F.....I.W| busy 3.00 ms (33%), waited 0.0 us recv, "
                        "0.0 us send")
    assert lines[4].startswith("r1/s3 |...FI.W..|")  # I of 0.5 ms still gets its cell
    assert "theory (p-1)/(vm+p-1) = 1/3 = 33.3% (p=2, m=1, 4 stages)" in lines[5]
    assert lines[6].startswith("legend: F forward, I input grad, W weight grad")


def test_labels_are_cut_to_the_cells_an_action_covers():
    rank0 = [ev(0, 12, "F", 0, 1), ev(0, 12, "B", 1, 10)]
    text = render_timeline([rank0], 1, 13, width=10)
    assert "r0/s0 |FB12      |" in text


def test_bad_input():
    with pytest.raises(dt.errors.ArgumentError, match="width >= 8"):
        render_timeline(gpipe_2x2(), 2, 2, width=4)
    with pytest.raises(PipelineError, match="has the schedule stepped"):
        render_timeline([[]], 1, 1)
    with pytest.raises(TypeError, match="expected a dt.pipelining schedule"):
        dt.debug.visualize_schedule(object())


class _Comm:
    mesh_dim = 0
    async_op = False


def test_comm_mode_counts_tagged_messages_per_stage():
    comm = _Comm()
    with dt.debug.CommDebugMode() as mode:
        for mb in range(3):
            C.notify("send", 40, comm, Message(0, mb, "activation", 1))
            C.notify("recv", 40, comm, Message(0, mb, "gradient", 1))
        C.notify("send", 96, comm, Message(0, -1, "header", 1))
        C.notify("recv", 8, comm, Message(2, 0, "activation", 1))
        C.notify("send", 16, comm, "ring attention K/V")  # untagged: no stage
    assert mode.get_p2p_counts() == {
        0: {"activation send": 3, "gradient recv": 3, "header send": 1},
        2: {"activation recv": 1},
    }
    assert mode.get_p2p_bytes() == {
        0: {"activation send": 120, "gradient recv": 120, "header send": 96},
        2: {"activation recv": 8},
    }
    assert mode.get_comm_counts_by_phase() == {"forward": {"send": 5, "recv": 1},
                                               "backward": {"recv": 3}}
    assert mode.get_comm_counts_by_op()["pipeline (backward)"] == {"recv": 3}
    assert C.notified_what() is None  # only while observers run
    table = mode.table()
    section = table.split("point-to-point by pipeline stage (this rank's stages):\n")[1]
    assert section.splitlines() == [
        "stage  direction   sends  bytes sent  receives  bytes received",
        "-----  ----------  -----  ----------  --------  --------------",
        "0      activation  3      120         0         0",
        "0      gradient    0      0           3         120",
        "0      header      1      96          0         0",
        "2      activation  0      0           1         8",
    ]
