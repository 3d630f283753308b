"""Node-shared segments (redistribute.shm) and the allocator's use of them (no MPI)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from helpers.jobs import run_python

from dtensor.local import allocator as alloc
from redistribute import shm

needs_shm = pytest.mark.skipif(not shm.enabled(), reason="no memfd here, or DTENSOR_SHM=0")
MiB = 1 << 20


@needs_shm
def test_locate_finds_arrays_and_views_inside_a_segment():
    seg = shm.Segment(MiB)
    try:
        whole = seg.buffer.view(np.float32).reshape(512, 512)
        fd, serial, size, offset = shm.locate(whole)
        assert (fd, serial, size, offset) == (seg.fd, seg.serial, MiB, 0)
        assert shm.locate(whole[3:, 5:])[3] == (3 * 512 + 5) * 4
        assert shm.locate(whole.T)[3] == 0  # strided views: start at the first element
        assert shm.locate(whole[::-1])[3] == 511 * 512 * 4  # negative strides
        assert shm.locate(seg.buffer[MiB - 8 :])[3] == MiB - 8
        assert shm.locate(whole[:0]) is None  # nothing to read
        assert shm.locate(np.ones(10)) is None  # ordinary memory
        # an array that only starts in the segment is not inside it
        past = np.lib.stride_tricks.as_strided(seg.buffer[MiB - 4 :], (8,), (1,))
        assert shm.locate(past) is None
    finally:
        seg.close()
    assert shm.locate(whole) is None  # closed: no longer offered to peers


@needs_shm
def test_two_segments_have_distinct_serials():
    a, b = shm.Segment(4096), shm.Segment(4096)
    try:
        assert a.serial != b.serial and a.fd != b.fd
        assert shm.locate(a.buffer)[:2] == (a.fd, a.serial)
        assert shm.locate(b.buffer)[:2] == (b.fd, b.serial)
    finally:
        a.close()
        b.close()


@needs_shm
def test_peer_buffer_maps_the_same_pages_and_notices_a_new_segment():
    """A mapping by (pid, fd) sees the owner's writes; when the descriptor number comes
    back for a later segment (new serial), the cached mapping is replaced."""
    shm.clear_peer_maps()
    seg = shm.Segment(8192)
    seg.buffer[:4] = [1, 2, 3, 4]
    view = shm.peer_buffer(os.getpid(), seg.fd, seg.serial, seg.size)
    assert view.tolist()[:4] == [1, 2, 3, 4]
    seg.buffer[0] = 9
    assert view[0] == 9  # the same memory, not a copy
    assert not view.flags.writeable
    assert shm.peer_buffer(os.getpid(), seg.fd, seg.serial, seg.size) is view  # cached
    fd = seg.fd
    seg.close()
    again = shm.Segment(8192)
    try:
        assert again.fd == fd  # the lowest free descriptor number is reused
        again.buffer[0] = 42
        fresh = shm.peer_buffer(os.getpid(), again.fd, again.serial, again.size)
        assert fresh is not view and fresh[0] == 42
        with pytest.raises(OSError):
            shm.peer_buffer(os.getpid(), 10**6, 1, 4096)  # no such descriptor
        with pytest.raises(OSError):  # the segment is smaller than described
            shm.peer_buffer(os.getpid(), again.fd, again.serial + 1, 1 << 30)
    finally:
        again.close()
        shm.clear_peer_maps()


@needs_shm
def test_a_peer_that_closed_segments_has_its_mappings_dropped():
    """A cached mapping keeps the peer's memory alive; a new epoch from that peer (it has
    closed segments since) drops every mapping of it."""
    shm.clear_peer_maps()
    a, b = shm.Segment(4096), shm.Segment(4096)
    try:
        me = os.getpid()
        view_a = shm.peer_buffer(me, a.fd, a.serial, a.size, shm.epoch())
        shm.peer_buffer(me, b.fd, b.serial, b.size, shm.epoch())
        assert len(shm._peer_maps) == 2
        assert shm.peer_buffer(me, a.fd, a.serial, a.size, shm.epoch()) is view_a
        b.close()
        again = shm.peer_buffer(me, a.fd, a.serial, a.size, shm.epoch())
        assert again is not view_a and len(shm._peer_maps) == 1
    finally:
        a.close()
        b.close()
        shm.clear_peer_maps()


@needs_shm
def test_segments_beyond_the_quota_are_ordinary_memory(monkeypatch):
    """Each segment holds a descriptor: past the quota the allocator falls back."""
    monkeypatch.setattr(shm, "_MAX_SEGMENTS", len(shm._segments))
    with pytest.raises(OSError, match="shared segments already live"):
        shm.Segment(4096)
    allocator = alloc.CPUAllocator()
    block = allocator.allocate(3 * MiB)
    assert shm.locate(np.asarray(block)) is None
    assert [seg["shared"] for seg in allocator.snapshot()] == [False]
    assert 16 <= shm._max_segments() <= 1024


@needs_shm
def test_pooled_segments_are_shared():
    allocator = alloc.CPUAllocator()
    block = allocator.allocate(3 * MiB)
    arr = np.asarray(block)
    assert shm.locate(arr) is not None
    (seg,) = allocator.snapshot()
    assert seg["shared"] is True
    del arr, block
    allocator.empty_cache()
    assert allocator.snapshot() == []


def test_nocache_segments_are_not_shared():
    allocator = alloc.CPUAllocator(caching=False)
    block = allocator.allocate(3 * MiB)
    arr = np.asarray(block)
    assert shm.locate(arr) is None
    assert [seg["shared"] for seg in allocator.snapshot()] == [False]


@needs_shm
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_gets_private_copies():
    """After fork, the child's writes to a pooled array do not reach the parent (nor the
    parent's the child), as with ordinary memory, and the child offers no segment to
    peers."""
    arr = alloc.empty_array((512, 512), np.float32)
    arr[...] = 1.0
    assert shm.locate(arr) is not None
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: report what it sees, then leave without running pytest's exit
        code = 1
        try:
            os.close(read)
            arr[...] = 2.0
            ok = shm.locate(arr) is None and float(arr.sum()) == 2.0 * arr.size
            os.write(write, b"1" if ok else b"0")
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    child_saw = os.read(read, 1)
    os.close(read)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert child_saw == b"1"
    assert float(arr.sum()) == arr.size  # the parent's data is untouched
    assert shm.locate(arr) is not None


def test_shm_off_by_environment():
    out = run_python(
        "import numpy as np\n"
        "from dtensor.local import allocator as a\n"
        "from redistribute import shm\n"
        "x = a.empty_array((1 << 20,), np.uint8)\n"
        "print(shm.enabled(), shm.locate(x), a.memory_snapshot()[0]['shared'])\n",
        DTENSOR_SHM="0",
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "None", "False"]


@pytest.mark.parametrize(
    ("name", "value"), [("DTENSOR_SHM", "maybe"), ("DTENSOR_SHM_MIN_BYTES", "-1")]
)
def test_bad_shm_settings_are_refused(name, value):
    out = run_python("import redistribute.shm", **{name: value})
    assert out.returncode != 0
    assert name in out.stderr and repr(value) in out.stderr


class _FakeComm:
    """Two 'ranks' in one process: the peer's row is given; the collectives just echo."""

    rank, size = 0, 2

    def __init__(self, peer_row):
        self.peer_row = peer_row

    def shared_exchange(self, values, kind, what=None, detail=""):
        return np.array([list(values), self.peer_row(list(values))], np.int64)

    def all_true(self, flag, what=None):
        return bool(flag)


@needs_shm
def test_probe_reads_the_peer_token(monkeypatch):
    """A 'peer' that is this very process passes; a wrong token or a descriptor that
    cannot be opened fails. On one node, a failure turns shared segments off; a peer on
    another node (different node id) only fails the probe."""
    monkeypatch.setattr(shm, "_ENABLED", True)
    assert shm.probe(_FakeComm(lambda mine: mine)) is True
    assert shm.enabled()
    other_node = shm.probe(_FakeComm(lambda mine: mine[:4] + [mine[4] + 1, mine[5] + 1]))
    assert other_node is False and shm.enabled()
    unmappable = shm.probe(_FakeComm(lambda mine: [1, mine[1], 10**6, 1, mine[4], mine[5]]))
    assert unmappable is False and not shm.enabled()
    allocator = alloc.CPUAllocator()
    block = allocator.allocate(3 * MiB)  # ordinary memory from now on
    assert shm.locate(np.asarray(block)) is None
