"""The compiled block cache in front of the caching host allocator (``fastpath._pool``).

Each test builds its own ``BlockCache`` over its own ``CPUAllocator`` (so they run in both
dispatch modes); the last ones check the module-level allocator's figures where the cache
serves it (the compiled fast path enabled).
"""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

import fastpath
from dtensor.local import allocator as alloc

pytestmark = pytest.mark.skipif(not fastpath.AVAILABLE, reason="compiled extension not built")
MiB = 1 << 20


def make(**limits):
    pool = alloc.CPUAllocator()
    cache = fastpath.pool.BlockCache(pool.allocate, **limits)
    pool.on_memory_pressure = cache.drain
    return pool, cache


def test_a_freed_block_serves_the_next_request_of_its_size():
    pool, cache = make()
    a = cache.empty((64, 64), np.float32, 4096)
    assert a.shape == (64, 64) and a.dtype == np.float32 and a.flags.c_contiguous
    assert a.flags.writeable and a.ctypes.data % 64 == 0
    assert type(a.base) is fastpath.pool.Lease and a.base.nbytes == a.nbytes
    address = a.ctypes.data
    a[:] = 5
    del a
    assert cache.counters()["cached_blocks"] == 1
    b = cache.empty((128, 32), np.int32, 4096)  # another shape and dtype, same rounded size
    assert b.ctypes.data == address
    c = cache.counters()
    assert c["cache_hits"] == 1 and c["num_allocs"] == 2 and c["cached_blocks"] == 0
    assert pool.stats()["num_allocs"] == 1  # the pool saw the first request only
    del b


def test_small_requests_odd_dtypes_and_bad_shapes():
    _, cache = make()
    small = cache.empty((3,), np.float32, 4096)
    assert small.base is None and cache.counters()["num_allocs"] == 0  # numpy's own
    assert cache.empty(np.int64(5000), "i1", 0).shape == (5000,)
    assert cache.empty([0, 4096], np.float64, 0).shape == (0, 4096)
    assert cache.empty((), np.float64, 0).shape == ()
    assert cache.empty((1000,), object, 0) is None  # object arrays: the caller's numpy.empty
    assert cache.empty((-1, 4), np.float32, 0) is None  # numpy's error from the caller
    assert cache.empty((1 << 40, 1 << 40), np.float32, 0) is None
    with pytest.raises(TypeError):
        cache.empty((2.5,), np.float32, 0)


def test_views_keep_the_block_lent():
    _, cache = make()
    a = cache.empty((MiB,), np.uint8, 4096)
    a[:] = 7
    view = a[10:20]
    del a
    assert cache.counters()["active_blocks"] == 1
    other = cache.empty((MiB,), np.uint8, 4096)
    assert not np.shares_memory(other, view) and view.tolist() == [7] * 10
    del view, other
    c = cache.counters()
    assert c["active_blocks"] == 0 and c["cached_blocks"] == 2


def test_limits_send_blocks_back_to_the_pool():
    pool, cache = make(max_per_size=2, max_bytes=3 * 8192)
    arrays = [cache.empty((8192,), np.uint8, 4096) for _ in range(3)]
    del arrays
    c = cache.counters()
    assert (c["cached_blocks"], c["returned_blocks"], c["num_frees"]) == (2, 1, 3)
    assert pool.stats()["num_frees"] == 1
    big = [cache.empty((16384,), np.uint8, 4096) for _ in range(2)]
    del big  # only one more 8 KiB fits under max_bytes... and 16 KiB does not
    c = cache.counters()
    assert c["cached_bytes"] <= 3 * 8192 and c["returned_blocks"] == 3


def test_drain_gives_every_block_back():
    pool, cache = make()
    arrays = [cache.empty((n,), np.uint8, 4096) for n in (5000, 70000, 3 * MiB, 17 * MiB)]
    assert pool.stats()["active_blocks"] == 4
    del arrays
    assert pool.stats()["active_blocks"] == 4  # waiting in the cache
    assert len(cache.cached_addresses()) == 4
    cache.drain()
    assert pool.stats()["active_blocks"] == 0 and cache.counters()["cached_blocks"] == 0
    pool.empty_cache()
    assert pool.stats()["reserved_bytes"] == 0


def test_a_failed_segment_allocation_drains_the_cache_first(monkeypatch):
    pool, cache = make()
    a = cache.empty((4 * MiB,), np.uint8, 4096)
    del a  # waits in the cache, holding its 20 MiB segment
    real = alloc._Segment

    def one_segment_only(size, owner):
        if len(pool._segments) >= 1:  # (called with the pool's lock held: no stats())
            raise MemoryError("no more memory")
        return real(size, owner)

    monkeypatch.setattr(alloc, "_Segment", one_segment_only)
    b = cache.empty((18 * MiB,), np.uint8, 4096)  # needs a new segment: only after draining
    assert b.nbytes == 18 * MiB and cache.counters()["cached_blocks"] == 0
    assert pool.stats()["num_segments"] == 1


def test_threads_allocating_and_freeing():
    pool, cache = make(max_per_size=4)

    def work(seed):
        rng = np.random.default_rng(seed)
        keep = []
        for _ in range(3000):
            keep.append(cache.empty((int(rng.integers(1, 64)) * 512,), np.uint8, 0))
            if len(keep) > 5:
                keep.pop(int(rng.integers(0, len(keep))))
        keep.clear()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    c = cache.counters()
    assert c["active_blocks"] == 0 and c["allocated_bytes"] == 0 and c["requested_bytes"] == 0
    assert c["num_allocs"] == c["num_frees"] == 12000
    assert pool.stats()["active_blocks"] == c["cached_blocks"]
    cache.drain()
    assert pool.stats()["active_blocks"] == 0


@pytest.mark.skipif(
    alloc._CACHE is None, reason="compiled fast path not enabled (not built or disabled)"
)
def test_module_figures_count_arrays_and_waiting_blocks_are_free():
    gc.collect()
    base = alloc.memory_stats()
    arr = alloc.empty_array((64, 64), np.float32)
    address = arr.ctypes.data
    mid = alloc.memory_stats()
    assert mid["allocated_bytes"] == base["allocated_bytes"] + 16384
    assert mid["requested_bytes"] == base["requested_bytes"] + 16384
    assert mid["num_allocs"] == base["num_allocs"] + 1
    assert mid["peak_allocated_bytes"] >= mid["allocated_bytes"]
    del arr
    end = alloc.memory_stats()
    assert end["allocated_bytes"] == base["allocated_bytes"]
    assert end["num_frees"] == base["num_frees"] + 1
    (block,) = [b for seg in alloc.memory_snapshot() for b in seg["blocks"]
                if b["address"] == address]  # fmt: skip
    assert block["state"] == "free" and block["requested_size"] == 0
    again = alloc.empty_array((16, 256), np.float32)
    assert again.ctypes.data == address
    assert alloc.memory_stats()["cache_hits"] >= end["cache_hits"] + 1
    del again
    alloc.empty_cache()
    assert all(b["address"] != address or b["state"] == "free"
               for seg in alloc.memory_snapshot() for b in seg["blocks"])  # fmt: skip
    alloc.reset_peak_memory_stats()
    assert alloc.memory_stats()["peak_allocated_bytes"] == alloc.memory_stats()["allocated_bytes"]
