"""Tests of the caching CPU allocator (dtensor/_allocator.py)."""

from __future__ import annotations

import gc
import itertools
import queue
import sys
import threading
import weakref

import numpy as np
import pytest
from helpers.jobs import run_python
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

import dtensor as dt
from dtensor.errors import DTensorError
from dtensor.local import allocator as alloc

MiB = 1 << 20
needs_caching = pytest.mark.skipif(
    not alloc._CPU.caching, reason="the default allocator runs with DTENSOR_ALLOCATOR=nocache"
)


@pytest.fixture(autouse=True)
def _default_pool_threshold(monkeypatch):
    """Tests of empty_array assume the default threshold, whatever the environment says."""
    monkeypatch.setattr(alloc, "POOL_MIN_BYTES", 4096)


def owner(arr: np.ndarray) -> object:
    """The end of an array's base chain (what the local tensor's Storage records)."""
    while isinstance(arr, np.ndarray):
        arr = arr.base
    return arr


def block_of(arr: np.ndarray) -> alloc.Block:
    """The pool's block behind a pooled array: its owner, or with the compiled cache in
    front of the pool (``alloc._CACHE``) the block of its owner, a ``Lease``."""
    end = owner(arr)
    return end.block if alloc._CACHE is not None else end


def pooled(allocator: alloc.CPUAllocator, nbytes: int, fill: int) -> np.ndarray:
    arr = np.asarray(allocator.allocate(nbytes))
    arr.fill(fill)
    return arr


def check_snapshot(allocator: alloc.CPUAllocator) -> None:
    """Blocks tile each segment, no two free blocks touch, stats match the blocks."""
    snap = allocator.snapshot()
    stats = allocator.stats()
    allocated = active = 0
    for seg in snap:
        assert seg["address"] % 64 == 0
        end = seg["address"]
        prev_free = False
        for blk in seg["blocks"]:
            assert blk["address"] == end
            assert blk["size"] > 0 and blk["size"] % 512 == 0
            end += blk["size"]
            free = blk["state"] == "free"
            assert not (free and prev_free), "adjacent free blocks were not merged"
            prev_free = free
            if not free:
                allocated += blk["size"]
                active += 1
        assert end == seg["address"] + seg["size"]
    assert stats["allocated_bytes"] == allocated
    assert stats["active_blocks"] == active
    assert stats["num_segments"] == len(snap)
    assert stats["reserved_bytes"] == sum(seg["size"] for seg in snap)


# --- empty_array -----------------------------------------------------------------------


def test_empty_array_is_pooled_with_block_owner():
    arr = alloc.empty_array((256, 1024), np.float32)
    assert arr.shape == (256, 1024) and arr.dtype == np.float32
    assert arr.flags.c_contiguous and arr.flags.writeable
    assert owner(arr).nbytes == arr.nbytes
    block = block_of(arr)
    assert isinstance(block, alloc.Block)
    assert block.allocator is alloc._CPU
    assert block.nbytes >= arr.nbytes  # the compiled cache asks for the rounded size
    assert arr.ctypes.data == block.address and block.address % 64 == 0
    raw = np.asarray(block)
    assert raw.base is block and raw.dtype == np.uint8 and raw.shape == (arr.nbytes,)
    raw[:4] = 7
    assert arr.view(np.uint8).reshape(-1)[:4].tolist() == [7, 7, 7, 7]  # zero-copy


def test_empty_array_shapes():
    assert alloc.empty_array(5000, np.int8).shape == (5000,)
    assert alloc.empty_array(np.int64(5000), "i1").shape == (5000,)
    assert alloc.empty_array([], np.float64).shape == ()
    assert alloc.empty_array((0, 4096), np.float64).shape == (0, 4096)
    with pytest.raises(ValueError):
        alloc.empty_array((-1, -8192), np.float64)


def test_small_requests_bypass_pool(monkeypatch):
    before = alloc.memory_stats()["num_allocs"]
    arr = alloc.empty_array((alloc.POOL_MIN_BYTES - 1,), np.uint8)
    assert arr.base is None  # numpy owns it
    assert alloc.memory_stats()["num_allocs"] == before
    monkeypatch.setattr(alloc, "POOL_MIN_BYTES", 0)
    small = alloc.empty_array((3,), np.float32)
    assert isinstance(block_of(small), alloc.Block)
    assert alloc.memory_stats()["num_allocs"] == before + 1


def test_object_dtype_is_not_pooled(monkeypatch):
    monkeypatch.setattr(alloc, "POOL_MIN_BYTES", 0)
    arr = alloc.empty_array((10000,), object)
    assert arr.base is None and arr[0] is None


def test_unknown_device():
    with pytest.raises(DTensorError, match="unknown device 'tpu'"):
        alloc.empty_array((4,), np.float32, device="tpu")
    with pytest.raises(DTensorError, match="unknown device"):
        dt.memory_stats("cuda:x")


def test_public_names():
    assert dt.memory_stats is alloc.memory_stats
    assert dt.memory_snapshot is alloc.memory_snapshot
    assert dt.empty_cache is alloc.empty_cache
    assert dt.reset_peak_memory_stats is alloc.reset_peak_memory_stats
    keys = {
        "allocated_bytes", "reserved_bytes", "peak_allocated_bytes", "active_blocks",
        "num_allocs", "num_frees", "cache_hits", "cache_misses", "num_splits",
        "num_merges", "num_segments",
    }  # fmt: skip
    assert keys <= set(dt.memory_stats())


# --- lifetime and statistics -------------------------------------------------------------


def test_stats_return_to_baseline():
    gc.collect()
    base = dt.memory_stats()
    arrays = [alloc.empty_array((n,), np.uint8) for n in (5000, 70000, 3 * MiB, 17 * MiB)]
    mid = dt.memory_stats()
    assert mid["active_blocks"] == base["active_blocks"] + 4
    assert mid["allocated_bytes"] >= base["allocated_bytes"] + sum(a.nbytes for a in arrays)
    assert mid["num_allocs"] == base["num_allocs"] + 4
    del arrays
    end = dt.memory_stats()
    assert end["allocated_bytes"] == base["allocated_bytes"]
    assert end["active_blocks"] == base["active_blocks"]
    assert end["num_frees"] == base["num_frees"] + 4
    check_snapshot(alloc._CPU)


def test_peak_is_the_largest_total_of_blocks_alive_together():
    """peak_allocated_bytes is the largest sum of the live blocks, not the largest block."""
    allocator = alloc.CPUAllocator()
    a = allocator.allocate(MiB)
    b = allocator.allocate(2 * MiB)
    stats = allocator.stats()
    assert stats["peak_allocated_bytes"] == stats["allocated_bytes"] == 3 * MiB
    del a, b
    c = allocator.allocate(MiB)
    stats = allocator.stats()
    assert (stats["allocated_bytes"], stats["peak_allocated_bytes"]) == (MiB, 3 * MiB)
    del c


def test_view_keeps_block_alive():
    gc.collect()
    base = dt.memory_stats()["active_blocks"]
    arr = alloc.empty_array((MiB,), np.float32)
    arr[:] = 3.0
    view = arr[100:200]
    address = view.ctypes.data
    del arr
    assert dt.memory_stats()["active_blocks"] == base + 1
    other = alloc.empty_array((MiB,), np.float32)  # must not reuse the live block
    other[:] = -1.0
    start = other.ctypes.data
    assert not (start <= address < start + other.nbytes)
    assert (view == 3.0).all()
    del other
    assert dt.memory_stats()["active_blocks"] == base + 1
    del view
    assert dt.memory_stats()["active_blocks"] == base


def test_block_reused_after_free():
    allocator = alloc.CPUAllocator()
    first = allocator.allocate(5 * MiB)
    address = first.address
    del first
    second = allocator.allocate(5 * MiB)
    assert second.address == address
    stats = allocator.stats()
    assert stats["cache_hits"] == 1 and stats["cache_misses"] == 1


def test_reserved_does_not_grow_in_steady_loop():
    allocator = alloc.CPUAllocator()
    sizes = [4096, 70000, 3 * MiB, 600, 12 * MiB, 2 * MiB + 1]

    def cycle():
        live = [allocator.allocate(n) for n in sizes]
        del live[::2]
        live += [allocator.allocate(n) for n in sizes[::-1]]
        del live

    cycle()
    reserved = allocator.stats()["reserved_bytes"]
    for _ in range(50):
        cycle()
    stats = allocator.stats()
    assert stats["reserved_bytes"] == reserved
    assert stats["allocated_bytes"] == 0
    assert stats["cache_hits"] >= 50 * 2 * len(sizes)
    check_snapshot(allocator)


def test_reset_peak_memory_stats():
    allocator = alloc.CPUAllocator()
    big = allocator.allocate(30 * MiB)
    del big
    small = allocator.allocate(5000)
    stats = allocator.stats()
    assert stats["peak_allocated_bytes"] == 30 * MiB
    allocator.reset_peak_stats()
    stats = allocator.stats()
    assert stats["peak_allocated_bytes"] == stats["allocated_bytes"] == 5120
    assert stats["peak_reserved_bytes"] == stats["reserved_bytes"]
    del small
    gc.collect()
    dt.reset_peak_memory_stats()
    now = dt.memory_stats()
    assert now["peak_allocated_bytes"] == now["allocated_bytes"]


def test_empty_cache_releases_free_segments():
    allocator = alloc.CPUAllocator()
    keep = allocator.allocate(24 * MiB)
    drop = allocator.allocate(16 * MiB)
    small = allocator.allocate(8192)
    kept_segment = keep.address
    assert allocator.stats()["num_segments"] == 3
    del drop, small
    allocator.empty_cache()
    stats = allocator.stats()
    assert stats["num_segments"] == 1 and stats["reserved_bytes"] == 24 * MiB
    assert stats["num_segment_frees"] == 2
    assert [seg["address"] for seg in allocator.snapshot()] == [kept_segment]
    del keep
    allocator.empty_cache()
    assert allocator.stats()["reserved_bytes"] == 0 and allocator.snapshot() == []


def test_released_memory_is_freed_without_garbage_collection():
    for caching in (True, False):
        allocator = alloc.CPUAllocator(caching=caching)
        block = allocator.allocate(3 * MiB)
        (segment,) = allocator._segments.values()
        buffer = weakref.ref(segment.buffer)
        del segment
        gc.disable()
        try:
            del block
            allocator.empty_cache()
            assert buffer() is None
        finally:
            gc.enable()


@needs_caching
def test_global_empty_cache():
    gc.collect()
    arr = alloc.empty_array((40 * MiB,), np.uint8)
    address = owner(arr).address
    del arr
    assert any(seg["address"] == address for seg in dt.memory_snapshot())
    dt.empty_cache()
    assert all(seg["address"] != address for seg in dt.memory_snapshot())
    check_snapshot(alloc._CPU)


def test_snapshot_shows_split_and_merge():
    allocator = alloc.CPUAllocator()
    big = allocator.allocate(16 * MiB)
    del big
    (seg,) = allocator.snapshot()
    assert [(b["size"], b["state"]) for b in seg["blocks"]] == [(16 * MiB, "free")]
    part = allocator.allocate(4 * MiB)
    (seg,) = allocator.snapshot()
    assert [(b["size"], b["state"]) for b in seg["blocks"]] == [
        (4 * MiB, "allocated"),
        (12 * MiB, "free"),
    ]
    assert seg["blocks"][0]["address"] == part.address == seg["address"]
    stats = allocator.stats()
    assert stats["num_splits"] == 1 and stats["cache_hits"] == 1
    del part
    (seg,) = allocator.snapshot()
    assert [(b["size"], b["state"]) for b in seg["blocks"]] == [(16 * MiB, "free")]
    assert allocator.stats()["num_merges"] == 1


def test_small_pool_merges_both_neighbours():
    allocator = alloc.CPUAllocator()
    a, b, c = (allocator.allocate(n) for n in (1000, 5000, 700))
    assert b.address == a.address + 1024 and c.address == b.address + 5120
    (seg,) = allocator.snapshot()
    assert seg["pool"] == "small" and seg["size"] == 2 * MiB
    assert [blk["state"] for blk in seg["blocks"]] == ["allocated"] * 3 + ["free"]
    del a, c
    assert [blk["state"] for blk in allocator.snapshot()[0]["blocks"]] == [
        "free",
        "allocated",
        "free",
    ]
    del b
    (seg,) = allocator.snapshot()
    assert [(blk["size"], blk["state"]) for blk in seg["blocks"]] == [(2 * MiB, "free")]


def test_best_fit_picks_smallest_free_block():
    allocator = alloc.CPUAllocator()
    blocks = [allocator.allocate(n) for n in (10 * 1024, 512, 6 * 1024, 512, 8 * 1024, 512)]
    addresses = [blk.address for blk in blocks]
    del blocks[4], blocks[2], blocks[0]  # free 8 KiB, 6 KiB, 10 KiB holes
    splits = allocator.stats()["num_splits"]
    fit = allocator.allocate(5 * 1024)
    assert fit.address == addresses[2]  # the 6 KiB hole, split into 5 KiB + 1 KiB
    assert allocator.stats()["num_splits"] == splits + 1
    sizes = [(blk["size"], blk["state"]) for blk in allocator.snapshot()[0]["blocks"]][:6]
    assert sizes[2:4] == [(5 * 1024, "allocated"), (1024, "free")]


# --- nocache mode ---------------------------------------------------------------------


def test_nocache_allocator():
    allocator = alloc.CPUAllocator(caching=False)
    first = allocator.allocate(3 * MiB)
    assert allocator.stats()["reserved_bytes"] == 3 * MiB
    del first
    assert allocator.stats()["reserved_bytes"] == 0 and allocator.snapshot() == []
    blocks = [allocator.allocate(n) for n in (700, 5000, 5000)]
    snap = allocator.snapshot()
    assert [seg["pool"] for seg in snap] == ["nocache"] * 3
    assert [len(seg["blocks"]) for seg in snap] == [1, 1, 1]
    del blocks
    stats = allocator.stats()
    assert stats["cache_hits"] == 0 and stats["cache_misses"] == 4
    assert stats["num_segments"] == 0 and stats["num_frees"] == 4


def test_environment_variables():
    code = (
        "import numpy as np; from dtensor.local import allocator as a; "
        "x = a.empty_array((100,), np.uint8); "
        "print(a._CPU.caching, a.POOL_MIN_BYTES, a.memory_stats()['num_allocs'])"
    )
    out = run_python(code, DTENSOR_ALLOCATOR="nocache", DTENSOR_POOL_MIN_BYTES="64")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "64", "1"]
    out = run_python(code, DTENSOR_ALLOCATOR="", DTENSOR_POOL_MIN_BYTES="")
    assert out.stdout.split() == ["True", "4096", "0"]
    # one process per bad setting (each is read once, at import)
    for env, fragments in (
        ({"DTENSOR_ALLOCATOR": "fast"}, ("ConfigError: environment variable DTENSOR_ALLOCATOR",)),
        ({"DTENSOR_POOL_MIN_BYTES": "4k"}, ("ConfigError: environment variable",
                                            "DTENSOR_POOL_MIN_BYTES='4k' is not an integer")),
        ({"DTENSOR_POOL_MIN_BYTES": "-1"}, ("DTENSOR_POOL_MIN_BYTES='-1' must be at least 0",)),
    ):
        bad = run_python(code, **env)
        assert bad.returncode != 0, bad.stdout
        for fragment in fragments:
            assert fragment in bad.stderr, bad.stderr


# --- property test ----------------------------------------------------------------------

sizes = st.one_of(st.integers(0, 4096), st.integers(4096, MiB + 4096), st.integers(MiB, 3 * MiB))


class AllocatorMachine(RuleBasedStateMachine):
    """Random alloc/free sequences: live blocks never overlap nor see each other's writes."""

    live = Bundle("live")

    def __init__(self) -> None:
        super().__init__()
        self.arrays: dict[int, tuple[np.ndarray, int]] = {}
        self.tag = 0
        self.allocator = alloc.CPUAllocator()

    @initialize(caching=st.booleans())
    def make(self, caching):
        self.allocator = alloc.CPUAllocator(caching=caching)

    @rule(target=live, nbytes=sizes)
    def allocate(self, nbytes):
        self.tag += 1
        fill = self.tag % 251 + 1
        arr = pooled(self.allocator, nbytes, fill)
        assert arr.ctypes.data % 64 == 0
        self.arrays[self.tag] = (arr, fill)
        return self.tag

    @rule(tag=consumes(live))
    def free(self, tag):
        del self.arrays[tag]

    @invariant()
    def no_overlap_and_intact(self):
        ranges = sorted(
            (a.ctypes.data, a.ctypes.data + max(a.nbytes, 1)) for a, _ in self.arrays.values()
        )
        for (_, end), (start, _) in itertools.pairwise(ranges):
            assert end <= start
        for arr, fill in self.arrays.values():
            assert (arr == fill).all()
        check_snapshot(self.allocator)
        assert self.allocator.stats()["active_blocks"] == len(self.arrays)

    def teardown(self):
        self.arrays.clear()
        stats = self.allocator.stats()
        assert stats["allocated_bytes"] == 0 and stats["active_blocks"] == 0
        # every segment merged back into one free block
        assert all(len(seg["blocks"]) == 1 for seg in self.allocator.snapshot())


AllocatorMachine.TestCase.settings = settings(
    stateful_step_count=25, deadline=None  # examples: the profile's count
)
test_allocator_machine = AllocatorMachine.TestCase


# --- threads and garbage collection -----------------------------------------------------


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")  # __del__ errors
def test_frees_from_other_threads():
    allocator = alloc.CPUAllocator()
    handoff: list[queue.Queue] = [queue.Queue() for _ in range(3)]
    errors: list[str] = []
    count = 8000

    def consumer(q: queue.Queue) -> None:
        while (item := q.get()) is not None:
            arr, fill = item
            if not (arr == fill).all():
                errors.append(f"block at {arr.ctypes.data:#x} was overwritten")
            del arr, item  # the free happens here, in this thread

    threads = [threading.Thread(target=consumer, args=(q,)) for q in handoff]
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, inside the allocator's code too
    try:
        for t in threads:
            t.start()
        rng = np.random.default_rng(0)
        kept: list[tuple[np.ndarray, int]] = []
        for i in range(count):
            fill = i % 251 + 1
            kept.append((pooled(allocator, int(rng.integers(1, 60_000)), fill), fill))
            if len(kept) > 8:
                handoff[i % 3].put(kept.pop(0))
            assert all((arr == value).all() for arr, value in kept[-3:])
        for q in handoff:
            q.put(None)
        for t in threads:
            t.join(timeout=60)
            assert not t.is_alive()
    finally:
        sys.setswitchinterval(old_interval)
    del kept
    assert errors == []
    stats = allocator.stats()
    assert stats["active_blocks"] == 0 and stats["allocated_bytes"] == 0
    assert stats["num_frees"] == count
    check_snapshot(allocator)


class Cycle:
    def __init__(self, arr: np.ndarray) -> None:
        self.arr = arr
        self.me = self


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_free_from_garbage_collection_inside_allocator():
    """A collection fired while the allocator holds its lock must not deadlock."""
    allocator = alloc.CPUAllocator()
    done = threading.Event()

    def work() -> None:
        old = gc.get_threshold()
        gc.set_threshold(1, 1, 1)  # collect at nearly every object allocation
        try:
            for i in range(2000):
                Cycle(pooled(allocator, 1000 + 512 * (i % 7), 1))  # garbage only via gc
        finally:
            gc.set_threshold(*old)
        done.set()

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(timeout=120)
    assert done.is_set(), "allocator deadlocked on a free from garbage collection"
    gc.collect()
    allocator.empty_cache()  # also applies frees deferred past the last allocation
    stats = allocator.stats()
    assert stats["active_blocks"] == 0 and stats["num_frees"] == 2000
    check_snapshot(allocator)


@pytest.mark.parametrize("factory", [dt.empty, dt.zeros])
def test_a_request_beyond_ram_and_swap_raises_memory_error(factory):
    # a shared memfd mapping bypasses the kernel's overcommit heuristic: without the check
    # this returned (empty) or filled memory toward the OOM killer (zeros)
    before = dt.memory_stats()["reserved_bytes"]
    n = 1 << 40  # float32 elements: 4 TiB, beyond this machine's RAM and swap
    with pytest.raises(MemoryError, match=r"Unable to allocate .* GiB"):
        factory(n, dtype=dt.float32)
    assert dt.memory_stats()["reserved_bytes"] == before
    assert factory(3, dtype=dt.float32).shape == (3,)


def test_a_block_dying_at_interpreter_shutdown_returns_nothing_to_the_pool():
    """During shutdown module globals are None and the pool's helpers are gone: a Block that
    dies then (held until the end, as by a test session) leaves its memory to the process
    instead of running the pool's bookkeeping (which raised, printed as an ignored
    exception at exit). Otherwise it returns its span."""
    released = []

    class Recorder:
        def _release(self, span):
            released.append(span)

    block = alloc.Block.__new__(alloc.Block)
    block.allocator, block._span = Recorder(), "span"
    alloc.Block.__del__(block, lambda: True)  # as during shutdown
    assert released == []
    alloc.Block.__del__(block, lambda: False)
    assert released == ["span"]


def test_releasable_buffer_gives_pages_back_at_the_same_address():
    from dtensor.local.allocator import ReleasableBuffer, memory_stats

    def rss():
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * 4096

    nbytes = 64 << 20
    buf = ReleasableBuffer(nbytes)
    address = buf.array.ctypes.data
    view = buf.array[1024:2048]
    before, rss0 = memory_stats()["allocated_bytes"], rss()
    buf.commit()
    buf.array[:] = 7
    assert memory_stats()["allocated_bytes"] - before == nbytes
    assert rss() - rss0 > nbytes // 2
    buf.release()
    assert memory_stats()["allocated_bytes"] == before
    assert rss() - rss0 < nbytes // 4  # the pages went back to the system
    assert buf.array.ctypes.data == address and not view.any()  # views stay valid: zeros
    buf.commit()
    view[:] = 3
    assert buf.array[1024] == 3 and buf.committed
    del view
    buf.release()
    buf.release()  # twice is harmless
    assert memory_stats()["allocated_bytes"] == before
