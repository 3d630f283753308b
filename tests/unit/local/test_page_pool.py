"""Pooled :class:`ReleasableBuffer` s (the page pool behind ``fully_shard``'s gathered
parameters): pages reused at each buffer's own address, memory figures back to the same
level, no stale data, pages back to the system when their last user dies."""

from __future__ import annotations

import os
import resource
import sys

import numpy as np
import pytest

from dtensor.local import allocator as alloc
from dtensor.local.allocator import (
    ReleasableBuffer,
    empty_cache,
    memory_stats,
    reset_peak_memory_stats,
)

pytestmark = pytest.mark.skipif(
    alloc._PAGES.libc is None, reason="no memfd here: pooled buffers behave as plain ones")

MiB = 1 << 20


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_released_pages_serve_the_next_buffer_of_the_size_without_faults():
    empty_cache()
    nbytes = 8 * MiB
    a, b = ReleasableBuffer(nbytes, pooled=True), ReleasableBuffer(nbytes, pooled=True)
    assert a.pooled and b.pooled
    addr_a, addr_b = a.array.ctypes.data, b.array.ctypes.data
    s0 = memory_stats()
    a.commit()
    a.array[:] = 5
    a.release()
    s1 = memory_stats()
    assert s1["allocated_bytes"] == s0["allocated_bytes"]
    assert s1["reserved_bytes"] - s0["reserved_bytes"] == nbytes  # the pages wait
    assert not a.array.any()  # released: zeros at the same address
    want = (np.arange(nbytes // 8, dtype=np.uint64) * np.uint64(2654435761)).view(np.uint8)
    f0 = _faults()
    b.commit()
    assert memory_stats()["reserved_bytes"] == s1["reserved_bytes"]  # no new pages
    assert memory_stats()["allocated_bytes"] - s0["allocated_bytes"] == nbytes
    b.array[:] = want
    assert _faults() - f0 < nbytes // os.sysconf("SC_PAGE_SIZE") // 8  # mapped, not faulted
    np.testing.assert_array_equal(b.array, want)  # its own data, none of a's
    assert not a.array.any()  # a's view does not see b's pages
    assert (a.array.ctypes.data, b.array.ctypes.data) == (addr_a, addr_b)
    b.release()
    assert memory_stats()["allocated_bytes"] == s0["allocated_bytes"]
    del a, b  # the size's last users: its pages go back
    assert memory_stats()["reserved_bytes"] == s0["reserved_bytes"]


def test_buffers_committed_together_take_pages_of_their_own():
    empty_cache()
    nbytes = 3 * MiB + 123  # not a page multiple
    bufs = [ReleasableBuffer(nbytes, pooled=True) for _ in range(4)]
    reset_peak_memory_stats()
    s0 = memory_stats()
    for step in range(3):  # two at a time, as a layer and its prefetched next one
        for i in range(len(bufs)):
            cur = bufs[i]
            cur.commit()
            typed = cur.array[: nbytes // 4 * 4].view(np.float32)
            typed[:] = step * 10 + i
            if i:
                bufs[i - 1].release()
            assert (typed == step * 10 + i).all()
        bufs[-1].release()
    s1 = memory_stats()
    assert s1["allocated_bytes"] == s0["allocated_bytes"]
    page = os.sysconf("SC_PAGE_SIZE")
    length = -(-nbytes // page) * page
    assert s1["reserved_bytes"] - s0["reserved_bytes"] == 2 * length  # at most two at once
    assert s1["peak_allocated_bytes"] - s0["allocated_bytes"] <= 2 * nbytes
    empty_cache()  # gives the waiting pages back
    assert memory_stats()["reserved_bytes"] == s0["reserved_bytes"]
    bufs[0].commit()  # and the pool makes new ones when asked
    bufs[0].array[:] = 1
    assert bufs[0].array.all()
    bufs[0].release()
    del bufs, cur
    assert memory_stats()["reserved_bytes"] == s0["reserved_bytes"]


def test_a_buffer_dropped_while_committed_gives_everything_back():
    empty_cache()
    s0 = memory_stats()
    buf = ReleasableBuffer(2 * MiB, pooled=True)
    buf.commit()
    view = buf.array[:16]
    view[:] = 9
    del buf  # the view outlives it: it must not see a later buffer's pages
    assert memory_stats()["allocated_bytes"] == s0["allocated_bytes"]
    assert memory_stats()["reserved_bytes"] == s0["reserved_bytes"]
    other = ReleasableBuffer(2 * MiB, pooled=True)
    other.commit()
    other.array[:] = 4
    assert not view.any()
    other.release()


def test_plain_and_empty_buffers_are_not_pooled():
    assert not ReleasableBuffer(MiB).pooled
    assert not ReleasableBuffer(0, pooled=True).pooled


@pytest.mark.skipif(not hasattr(os, "fork") or sys.platform != "linux", reason="needs fork")
def test_a_forked_child_gets_a_private_copy():
    buf = ReleasableBuffer(MiB, pooled=True)
    buf.commit()
    buf.array[:] = 1
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: writes its copy, reports what it sees
        try:
            buf.array[:] = 2
            ok = bool((buf.array == 2).all())
            os.write(w, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(w)
    got = os.read(r, 1)
    os.close(r)
    os.waitpid(pid, 0)
    assert got == b"1"
    assert (buf.array == 1).all()  # the parent's pages are its own
    buf.release()


def test_the_fsdp_pool_setting_is_read_and_checked(monkeypatch):
    from dtensor.errors import ConfigError
    from dtensor.parallel._fsdp import _pooled

    monkeypatch.delenv("DTENSOR_FSDP_POOL", raising=False)
    assert _pooled()
    monkeypatch.setenv("DTENSOR_FSDP_POOL", "0")
    assert not _pooled()
    monkeypatch.setenv("DTENSOR_FSDP_POOL", "yes")
    with pytest.raises(ConfigError, match=r"DTENSOR_FSDP_POOL='yes' is not 0 or 1"):
        _pooled()
