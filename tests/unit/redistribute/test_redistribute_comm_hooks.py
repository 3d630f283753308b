"""The debug hooks around every collective of redistribute.comm (one process, COMM_SELF).

Each :class:`redistribute.comm.Comm` collective tells the observers ``(kind, nbytes)``
before the debug checks enter it, the checks record its fingerprint, and the watchdog slot
is released however the MPI call ends; with no observer and no check nothing is recorded.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from redistribute import comm as C
from redistribute.comm import spmd as CS

pytestmark = pytest.mark.mode_independent  # see tests/conftest.py


@pytest.fixture
def comm():
    return C.Comm(MPI.COMM_SELF)


@pytest.fixture
def hooks(comm):
    """Observer, SPMD check and watchdog on; yields the observer's records
    ``(kind, nbytes, collectives checked so far on comm)``."""
    seen = []

    def observer(kind, nbytes, c):
        assert c is comm
        seen.append((kind, nbytes, CS._counters.get(comm.mpi.handle, 0)))

    C.add_observer(observer)
    prev = C.set_check_spmd(True)
    C.set_watchdog(600.0)
    try:
        yield seen
    finally:
        C.remove_observer(observer)
        C.set_check_spmd(prev)
        C.set_watchdog(None)
        C.configure_from_env()


def _calls(comm):
    """(call, kind, nbytes seen by observers or None when hidden from them)."""
    x = np.arange(8, dtype=np.float32)
    out = np.empty(8, np.float32)
    ints = np.empty(8, np.int64)
    byte = C.BYTES
    return [
        (lambda: comm.allgatherv(x, out, [8], what="t"), "all_gather", 32),
        (lambda: comm.allgatherv(x, out, [8], [0], what="t"), "all_gather", 32),
        (lambda: comm.allreduce(x, out, "sum", what="t"), "all_reduce", 32),
        (lambda: comm.allreduce(out, None, "max", what="t"), "all_reduce", 32),
        (lambda: comm.reduce_scatter(x, out, [8], what="t"), "reduce_scatter", 32),
        (lambda: comm.alltoallv(x, [8], [0], out, [8], [0], what="t"), "all_to_all", 32),
        (
            lambda: comm.alltoallw(x, [32], [0], [byte], out, [32], [0], [byte], what="t"),
            "all_to_all",
            32,
        ),
        (
            lambda: comm.alltoallw(
                x, [32], [0], [byte], out, [32], [0], [byte], "all_gather", "t", nbytes=99
            ),
            "all_gather",
            99,
        ),
        (lambda: comm.scatterv(x, [8], [0], out, 0, what="t"), "scatter", 32),
        (lambda: comm.bcast_array(out, 0, what="t"), "broadcast", 32),
        (lambda: comm.barrier(what="t"), "barrier", 0),
        (lambda: comm.allgather_ints(ints, what="t"), "all_gather_ints", 64),
        (lambda: comm.shared_exchange(ints, "all_gather", what="t"), "all_gather", None),
        (lambda: comm.all_true(True, what="t"), "all_reduce", None),
    ]


def test_observers_hear_first_then_the_checks_enter_and_leave(comm, hooks):
    for call, kind, nbytes in _calls(comm):
        hooks.clear()
        before = CS._counters.get(comm.mpi.handle, 0)
        call()
        # observers: told before the checks entered (the counter had not moved yet)
        assert hooks == ([] if nbytes is None else [(kind, nbytes, before)])
        assert CS._counters[comm.mpi.handle] == before + 1  # one checked collective
        n, got_kind, what, *_ = CS._history[-1]
        assert (n, got_kind, what) == (before + 1, kind, "t")
        assert C.HOOKS.watchdog.slot is None  # left


def test_the_checks_leave_when_the_mpi_call_raises(comm, hooks):
    x, out = np.zeros(8, np.float32), np.empty(8, np.float32)
    out.setflags(write=False)
    before = CS._counters.get(comm.mpi.handle, 0)
    with pytest.raises(BufferError):
        comm.allgatherv(x, out, [8], what="read-only")  # mpi4py refuses the receive buffer
    assert hooks == [("all_gather", 32, before)]
    assert CS._history[-1][1:3] == ("all_gather", "read-only")
    assert C.HOOKS.watchdog.slot is None


def test_no_observer_and_no_check_records_nothing(comm):
    prev = C.set_check_spmd(False)
    try:
        if C.HOOKS.watchdog is not None or C.HOOKS.observers:
            pytest.skip("a watchdog or an observer is configured from outside")
        before = CS._counters.get(comm.mpi.handle, 0)
        for call, _, _ in _calls(comm):
            call()
        assert CS._counters.get(comm.mpi.handle, 0) == before
    finally:
        C.set_check_spmd(prev)
