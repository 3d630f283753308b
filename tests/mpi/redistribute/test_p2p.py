"""MPI tests of :class:`redistribute.comm.Comm`'s point-to-point calls: ``isend`` /
``irecv`` / ``sendrecv`` / ``wait_all`` / ``test_all``, the observers' ``send`` / ``recv``
records, and their errors (checked against the data each rank can compute for any other).

Run with ``mpiexec -n K python -m pytest tests/mpi/redistribute/test_p2p.py --with-mpi``.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from placements.errors import CommError
from redistribute import comm as C

WORLD = MPI.COMM_WORLD.Get_size()
pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.mode_independent]


def block(rank, n, dtype=np.float32):
    return (np.arange(n, dtype=np.float64) * 0.5 + 1000 * rank).astype(dtype)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.bool_])
def test_ring_isend_irecv(dtype):
    w = C.world()
    right, left = (w.rank + 1) % w.size, (w.rank - 1) % w.size
    n = 7 + w.rank  # sizes differ per rank: each receiver sizes its buffer for its sender
    send = block(w.rank, n, dtype)
    recv = np.empty(7 + left, dtype)
    reqs = [w.irecv(recv, left, tag=3), w.isend(send, right, tag=3)]
    C.Comm.wait_all(reqs)
    np.testing.assert_array_equal(recv, block(left, 7 + left, dtype))


@pytest.mark.mpi(min_size=2)
def test_sendrecv_and_tags_match_out_of_order():
    w = C.world()
    right, left = (w.rank + 1) % w.size, (w.rank - 1) % w.size
    a, b = block(w.rank, 4), block(w.rank, 4) * -1
    got_b, got_a = np.empty(4, np.float32), np.empty(4, np.float32)
    # posted in the other order than sent: tags, not order, pair them
    reqs = [w.irecv(got_b, left, tag=2), w.irecv(got_a, left, tag=1)]
    reqs += [w.isend(a, right, tag=1), w.isend(b, right, tag=2)]
    C.Comm.wait_all(reqs + [None])
    np.testing.assert_array_equal(got_a, block(left, 4))
    np.testing.assert_array_equal(got_b, block(left, 4) * -1)
    out = np.empty(4, np.float32)
    w.sendrecv(a, right, out, left, tag=5)
    np.testing.assert_array_equal(out, block(left, 4))


@pytest.mark.mpi(min_size=2)
def test_observers_see_send_and_recv():
    w = C.world()
    seen = []

    def observer(kind, nbytes, comm):
        seen.append((kind, nbytes))

    C.add_observer(observer)
    try:
        right, left = (w.rank + 1) % w.size, (w.rank - 1) % w.size
        recv = np.empty(5, np.float64)
        C.Comm.wait_all([w.irecv(recv, left), w.isend(block(w.rank, 5, np.float64), right)])
    finally:
        C.remove_observer(observer)
    assert seen == [("recv", 40), ("send", 40)]


@pytest.mark.mpi(min_size=2)
def test_test_all_polls_until_done():
    w = C.world()
    right, left = (w.rank + 1) % w.size, (w.rank - 1) % w.size
    recv = np.empty(3, np.float32)
    reqs = [w.irecv(recv, left, tag=9)]
    assert C.Comm.test_all([]) is True
    w.barrier()  # nobody has sent yet: the receive cannot have completed
    assert C.Comm.test_all(reqs) is False
    w.barrier()  # every rank has tested before any rank sends
    reqs.append(w.isend(block(w.rank, 3), right, tag=9))
    while not C.Comm.test_all(reqs):
        pass
    np.testing.assert_array_equal(recv, block(left, 3))


@pytest.mark.mpi(min_size=2)
def test_message_longer_than_buffer_is_an_error():
    w = C.world()
    right, left = (w.rank + 1) % w.size, (w.rank - 1) % w.size
    small = np.empty(2, np.float32)
    reqs = [w.irecv(small, left, tag=4), w.isend(block(w.rank, 6), right, tag=4)]
    with pytest.raises(CommError, match="point-to-point message failed"):
        C.Comm.wait_all(reqs)


def test_bad_arguments_are_refused_before_any_message():
    w = C.world()
    strided = np.zeros((4, 4), np.float32)[:, 1]
    with pytest.raises(CommError, match=r"isend: needs a C-contiguous ndarray"):
        w.isend(strided, 0)
    with pytest.raises(CommError, match=r"irecv: needs a C-contiguous ndarray, got list"):
        w.irecv([1, 2], 0)
    with pytest.raises(CommError, match=rf"peer {WORLD} is not a rank .*size {WORLD}"):
        w.isend(np.zeros(2), WORLD)
    with pytest.raises(CommError, match=r"peer -1 is not a rank"):
        w.irecv(np.zeros(2), -1)
    with pytest.raises(CommError, match=rf"peer {w.rank} is this rank itself"):
        w.isend(np.zeros(2), w.rank)
    with pytest.raises(CommError, match=r"tag 40000 must be an int"):
        w.isend(np.zeros(2), w.rank, tag=40000)
