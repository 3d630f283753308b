"""The GPU path's logic with numpy standing in for cupy (no GPU, no MPI).

Covers the pinned staging pool, the staged and CUDA-aware collective paths of
``redistribute.staging.DeviceComm`` (a numpy subclass plays device memory and a fake
communicator checks that MPI would only ever see host memory, after a device sync), the
rank-to-GPU binding rule, the collective-free GPU skip decision and DLPack interop, and the
cupy glue of ``dtensor.distributed.gpu``, ``dtensor.distributed.device_comm`` and ``dtensor.local.dlpack`` against a fake cupy module.
"""

from __future__ import annotations

import copy
import sys
import types

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import dtensor as dt
from dtensor.distributed import device_comm as _devcomm
from dtensor.distributed import gpu as _gpu
from dtensor.local import dlpack as _dlpack
from placements.errors import CommError, DTensorError, DTypeError, MeshError
from redistribute.staging import DeviceBackend, DeviceComm, PinnedPool, select_path

# -- a numpy stand-in for device memory -----------------------------------------------------


class Dev(np.ndarray):
    """An ndarray that plays device memory: the fake MPI refuses it."""


def dev(a) -> Dev:
    return np.ascontiguousarray(a).view(Dev)


class Log(list):
    """Events in order: ("d2h", id), ("h2d", id), ("sync",), ("mpi", name)."""


def standin_backend(log: Log) -> DeviceBackend:
    def to_host(d, h):
        assert isinstance(d, Dev) and not isinstance(h, Dev)
        h[...] = d.view(np.ndarray)
        log.append(("d2h", id(d)))

    def to_device(h, d):
        assert isinstance(d, Dev) and not isinstance(h, Dev)
        d.view(np.ndarray)[...] = h
        log.append(("h2d", id(d)))

    return DeviceBackend(
        name="numpy-standin",
        is_device=lambda x: isinstance(x, Dev),
        to_host=to_host,
        to_device=to_device,
        synchronize=lambda: log.append(("sync",)),
    )


class FakeComm:
    """Rank ``rank`` of ``size``; peers' data is simulated. Every call checks that no
    device buffer reaches MPI and that the device was synchronised right before."""

    def __init__(self, log: Log, rank: int = 0, size: int = 2, staged: bool = True):
        self.log, self.rank, self.size, self.mesh_dim, self.staged = log, rank, size, 0, staged
        self.fail = False
        self.whats, self.kinds = [], []

    def _enter(self, name, *bufs, what=None):
        self.whats.append(what)
        if self.staged:
            for b in bufs:
                assert b is None or not isinstance(b, Dev), f"{name}: MPI got device memory"
        assert self.log and self.log[-1] == ("sync",), f"{name}: no device sync before MPI"
        self.log.append(("mpi", name))
        if self.fail:
            raise CommError(f"{name}: simulated failure")

    def barrier(self):
        return "barrier"

    def allgatherv(self, send, recv, counts, displs=None, what=None):
        self._enter("allgatherv", send, recv, what=what)
        flat = recv.reshape(-1)
        starts = np.cumsum([0] + list(counts))[:-1] if displs is None else displs
        for j, (s, n) in enumerate(zip(starts, counts)):
            flat[s : s + n] = send.reshape(-1) + 100 * j

    def allreduce(self, send, recv=None, op="sum", what=None):
        self._enter("allreduce", send, recv, what=what)
        out = send if recv is None else recv
        out[...] = send * self.size

    def reduce_scatter(self, send, recv, counts, op="sum", what=None):
        self._enter("reduce_scatter", send, recv, what=what)
        start = sum(counts[: self.rank])
        recv.reshape(-1)[...] = send.reshape(-1)[start : start + counts[self.rank]] * self.size

    def alltoallv(self, send, sc, sd, recv, rc, rd, what=None):
        self._enter("alltoallv", send, recv, what=what)
        for j in range(self.size):
            if j != self.rank:
                recv.reshape(-1)[rd[j] : rd[j] + rc[j]] = -1 - j

    def alltoallw(self, send, sc, sd, st, recv, rc, rd, rt, kind="all_to_all", what=None):
        self._enter("alltoallw", send, recv, what=what)
        self.kinds.append(kind)
        sb, rb = send.reshape(-1).view(np.uint8), recv.reshape(-1).view(np.uint8)
        for j in range(self.size):
            if j != self.rank:  # the peer sends back what we sent it (bytes)
                rb[rd[j] : rd[j] + rc[j]] = sb[sd[j] : sd[j] + sc[j]]

    def scatterv(self, send, counts, displs, recv, root, what=None):
        self._enter("scatterv", send, recv, what=what)
        if recv is not None:
            recv[...] = 42

    def bcast_array(self, arr, root=0, what=None):
        self._enter("bcast_array", arr, what=what)
        if self.rank != root:
            arr[...] = 7
        return arr


@pytest.fixture
def log():
    return Log()


def staged(log, **kw):
    pool = PinnedPool()
    comm = FakeComm(log, **kw)
    return DeviceComm(comm, standin_backend(log), "staged", pool), comm, pool


# -- PinnedPool ---------------------------------------------------------------------------


def test_pool_size_classes_and_reuse():
    calls = []

    def alloc(n):
        calls.append(n)
        return np.empty(n, np.uint8)

    pool = PinnedPool(alloc)
    a = pool.acquire(1)
    b = pool.acquire(5000)
    c = pool.acquire(3 * 1024 * 1024 + 1)
    assert (a.nbytes, b.nbytes, c.nbytes) == (4096, 8192, 4 * 1024 * 1024)
    assert calls == [4096, 8192, 4 * 1024 * 1024]
    for buf in (a, b, c):
        pool.release(buf)
    st_ = pool.stats()
    assert st_["cached_bytes"] == st_["reserved_bytes"] == 4096 + 8192 + 4 * 1024 * 1024
    assert st_["in_use_bytes"] == 0 and st_["num_allocs"] == 3 and st_["cache_hits"] == 0
    again = pool.acquire(6000)  # same class as b: served from the cache, the same memory
    assert again.__array_interface__["data"][0] == b.__array_interface__["data"][0]
    assert pool.stats()["cache_hits"] == 1 and len(calls) == 3
    assert pool.stats()["in_use_bytes"] == 8192
    pool.release(again)
    pool.empty_cache()
    assert pool.stats()["reserved_bytes"] == 0 and pool.stats()["cached_bytes"] == 0
    pool.acquire(100)
    assert len(calls) == 4  # nothing cached any more


def test_pool_respects_max_cached_and_checks_releases():
    pool = PinnedPool(max_cached_bytes=8192)
    bufs = [pool.acquire(4096) for _ in range(3)]
    for buf in bufs:
        pool.release(buf)
    st_ = pool.stats()
    assert st_["cached_bytes"] == 8192 and st_["reserved_bytes"] == 8192
    assert st_["peak_reserved_bytes"] == 3 * 4096
    with pytest.raises(DTensorError, match="not in use"):
        pool.release(bufs[0])
    with pytest.raises(DTensorError, match="not in use"):
        pool.release(np.empty(4096, np.uint8))
    bad = PinnedPool(lambda n: np.empty(n // 2, np.float32))
    with pytest.raises(DTensorError, match="1-D uint8"):
        bad.acquire(10)


def test_pool_borrow_gives_exact_views_and_returns_on_error():
    pool = PinnedPool()
    with pytest.raises(RuntimeError, match="boom"), pool.borrow([10, 0, 70000]) as bufs:
        assert [b.nbytes for b in bufs] == [10, 0, 70000]
        assert pool.stats()["in_use_bytes"] == 4096 + 4096 + 131072
        raise RuntimeError("boom")
    assert pool.stats()["in_use_bytes"] == 0


# -- path selection -----------------------------------------------------------------------


def test_select_path(monkeypatch):
    monkeypatch.delenv("DTENSOR_GPU_COMM", raising=False)
    assert select_path(True) == "cuda-aware" and select_path(False) == "staged"
    assert select_path(True, "staged") == "staged" and select_path(True, " AUTO ") == "cuda-aware"
    monkeypatch.setenv("DTENSOR_GPU_COMM", "staged")
    assert select_path(True) == "staged"
    with pytest.raises(CommError, match="does not report CUDA support"):
        select_path(False, "cuda-aware")
    with pytest.raises(CommError, match="expected one of"):
        select_path(True, "nccl")


# -- DeviceComm: staged path --------------------------------------------------------------


def _events(log, kind):
    return [e for e in log if e[0] == kind]


def test_staged_allreduce_out_of_place_copies_only_what_is_needed(log):
    comm, _, pool = staged(log)
    x = dev(np.arange(6, dtype=np.float32).reshape(2, 3))
    out = dev(np.full((2, 3), -5, np.float32))
    comm.allreduce(x, out, "sum")
    np.testing.assert_array_equal(out.view(np.ndarray), 2 * np.arange(6).reshape(2, 3))
    # the input goes to the host, the output only comes back (never read from the device)
    assert log == [("d2h", id(x)), ("sync",), ("mpi", "allreduce"), ("h2d", id(out)), ("sync",)]
    assert pool.stats()["in_use_bytes"] == 0


def test_staged_in_place_allreduce_uses_one_buffer(log):
    comm, _, pool = staged(log)
    x = dev(np.arange(4, dtype=np.int64))
    comm.allreduce(x, None, "sum")
    np.testing.assert_array_equal(x.view(np.ndarray), [0, 2, 4, 6])
    assert _events(log, "d2h") == [("d2h", id(x))] and _events(log, "h2d") == [("h2d", id(x))]
    assert pool.stats()["num_allocs"] == 1


def test_staged_partial_receive_keeps_the_untouched_bytes(log):
    """alltoallw writes only the peers' blocks: the own block already in the device output
    must survive the copy back."""
    comm, _, _ = staged(log)
    send = dev(np.arange(8, dtype=np.float64))
    recv = dev(np.full(8, 3.0))  # own block: elements 0..3 (bytes 0..31), set beforehand
    b = 8  # bytes per element
    comm.alltoallw(send, [0, 4 * b], [0, 4 * b], [None, None],
                   recv, [0, 4 * b], [0, 4 * b], [None, None])  # fmt: skip
    np.testing.assert_array_equal(recv.view(np.ndarray), [3, 3, 3, 3, 4, 5, 6, 7])
    assert ("d2h", id(recv)) in log  # read before the collective...
    assert log.index(("d2h", id(recv))) < log.index(("mpi", "alltoallw"))


def test_staged_allgatherv_full_and_partial(log):
    comm, _, _ = staged(log)
    send = dev(np.array([1, 2], np.int32))
    full = dev(np.zeros(4, np.int32))
    comm.allgatherv(send, full, [2, 2])
    np.testing.assert_array_equal(full.view(np.ndarray), [1, 2, 101, 102])
    assert ("d2h", id(full)) not in log  # fully written: not read from the device
    log.clear()
    slack = dev(np.full(5, 9, np.int32))  # one element more than the counts cover
    comm.allgatherv(send, slack, [2, 2])
    np.testing.assert_array_equal(slack.view(np.ndarray), [1, 2, 101, 102, 9])
    assert ("d2h", id(slack)) in log


def test_staged_reduce_scatter_alltoallv_scatterv(log):
    comm, _, _ = staged(log, rank=1)
    send = dev(np.arange(5, dtype=np.float32))
    recv = dev(np.empty(2, np.float32))
    comm.reduce_scatter(send, recv, [3, 2], "sum")
    np.testing.assert_array_equal(recv.view(np.ndarray), [6, 8])
    out = dev(np.zeros(4, np.int16))
    comm.alltoallv(dev(np.zeros(4, np.int16)), [2, 2], [0, 2], out, [2, 2], [0, 2])
    np.testing.assert_array_equal(out.view(np.ndarray), [-1, -1, 0, 0])
    got = dev(np.zeros(3, np.uint8))
    comm.scatterv(None, [3, 3], [0, 3], got, 0)
    np.testing.assert_array_equal(got.view(np.ndarray), [42, 42, 42])


def test_staged_bcast_returns_the_device_array(log):
    comm, _, _ = staged(log, rank=1)
    a = dev(np.zeros(3, np.float32))
    assert comm.bcast_array(a, 0) is a
    np.testing.assert_array_equal(a.view(np.ndarray), [7, 7, 7])
    assert ("d2h", id(a)) not in log  # a receiver's buffer is write-only
    log.clear()
    root, _, _ = staged(log, rank=0)
    b = dev(np.ones(3, np.float32))
    assert root.bcast_array(b, 0) is b
    assert _events(log, "d2h") == [("d2h", id(b))] and not _events(log, "h2d")


def test_trailing_arguments_pass_through(log):
    comm, fake, _ = staged(log)
    x, out = dev(np.ones(2)), dev(np.empty(2))
    comm.allreduce(x, out, "sum", "rs-1")
    comm.reduce_scatter(x, dev(np.empty(1)), [1, 1], "sum", what="rs-2")
    comm.alltoallw(
        x, [0, 8], [0, 8], [None] * 2, out, [0, 8], [0, 8], [None] * 2, "all_gather", "w"
    )
    comm.bcast_array(x, 0, "b")
    assert fake.whats == ["rs-1", "rs-2", "w", "b"] and fake.kinds == ["all_gather"]


def test_host_buffers_pass_through_untouched(log):
    comm, fake, pool = staged(log)
    log.append(("sync",))  # FakeComm insists on a sync before MPI; host calls make none
    x = np.arange(3.0)
    comm.allreduce(x, None)
    assert log == [("sync",), ("mpi", "allreduce")]
    np.testing.assert_array_equal(x, [0, 2, 4])
    assert pool.stats()["num_allocs"] == 0
    assert comm.rank == 0 and comm.size == 2 and comm.barrier() == "barrier"
    assert copy.copy(comm).rank == 0  # attribute forwarding survives copy's probing
    assert comm.mesh_dim == fake.mesh_dim


def test_staged_reuses_pool_buffers_and_releases_on_failure(log):
    comm, fake, pool = staged(log)
    x = dev(np.ones(1000, np.float32))
    out = dev(np.empty(1000, np.float32))
    for _ in range(5):
        comm.allreduce(x, out)
    assert pool.stats()["num_allocs"] == 2 and pool.stats()["cache_hits"] == 8
    fake.fail = True
    with pytest.raises(CommError, match="simulated failure"):
        comm.allreduce(x, out)
    assert pool.stats()["in_use_bytes"] == 0


def test_staged_refuses_non_contiguous_device_buffers(log):
    comm, _, _ = staged(log)
    x = dev(np.zeros((4, 4)))[:, ::2]
    with pytest.raises(CommError, match="not C-contiguous"):
        comm.allreduce(x, None)


@given(
    n=st.integers(0, 300),
    dtype=st.sampled_from([np.float32, np.float64, np.int8, np.complex64]),
    in_place=st.booleans(),
)
def test_staged_round_trip_matches_host_collective(n, dtype, in_place):
    log = Log()
    comm, _, pool = staged(log, size=3)
    data = (np.arange(n) % 7).astype(dtype)
    x = dev(data.copy())
    out = None if in_place else dev(np.empty(n, dtype))
    comm.allreduce(x, out)
    result = (x if in_place else out).view(np.ndarray)
    np.testing.assert_array_equal(result, data * 3)
    assert pool.stats()["in_use_bytes"] == 0


# -- DeviceComm: CUDA-aware path ----------------------------------------------------------


def test_cuda_aware_path_passes_device_buffers_after_a_sync(log):
    fake = FakeComm(log, staged=False)
    comm = DeviceComm(fake, standin_backend(log), "cuda-aware")
    x = dev(np.arange(3, dtype=np.float32))
    comm.allreduce(x, None)
    assert log == [("sync",), ("mpi", "allreduce")]
    assert isinstance(x, Dev) and x.view(np.ndarray).tolist() == [0, 2, 4]
    assert (
        "cuda-aware" in comm.describe()
        and "staged" in DeviceComm(fake, standin_backend(log), "staged").describe()
    )
    with pytest.raises(CommError, match="is not one of"):
        DeviceComm(fake, standin_backend(log), "nccl")


@pytest.mark.parametrize("call", ["allreduce", "reduce_scatter"])
def test_cuda_aware_path_stages_nan_propagating_max_min(log, call):
    # floating max/min run a user-defined MPI op whose numpy callback must read host memory:
    # on the CUDA-aware path they are staged; sums (MPI's own ops) keep the device buffers
    fake = FakeComm(log, staged=False)
    comm = DeviceComm(fake, standin_backend(log), "cuda-aware")

    def run(op, dtype):
        log.clear()
        x = dev(np.arange(4, dtype=dtype))
        if call == "allreduce":
            comm.allreduce(x, None, op)
        else:
            comm.reduce_scatter(x, dev(np.zeros(2, dtype)), [2, 2], op)
        return [e[0] for e in log]

    for op in ("max", "min"):
        assert run(op, np.float32)[:2] == ["d2h", "sync"], op  # staged: copied to the host
    for op, dtype in (("sum", np.float32), ("max", np.int64)):
        assert run(op, dtype) == ["sync", "mpi"], (op, dtype)  # device buffers to MPI


# -- rank to GPU binding ------------------------------------------------------------------


@given(local_rank=st.integers(0, 64), count=st.integers(1, 8))
def test_select_device_for_round_robin(local_rank, count):
    idx = _gpu.select_device_for(local_rank, count)
    assert 0 <= idx < count and idx == local_rank % count
    # the ranks of a node spread over every device before any device gets a second rank
    if local_rank < count:
        assert idx == local_rank


def test_select_device_for_errors_and_sharing():
    assert [_gpu.select_device_for(r, 1) for r in range(3)] == [0, 0, 0]  # one shared GPU
    with pytest.raises(MeshError, match="no CUDA device is visible"):
        _gpu.select_device_for(0, 0)
    with pytest.raises(MeshError, match="local rank must be >= 0"):
        _gpu.select_device_for(-1, 2)


# -- a fake cupy module -------------------------------------------------------------------


class FakeDevArray(Dev):
    """A stand-in for cupy.ndarray: a CUDA array interface, get(out=) and set()."""

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (0, False)}

    def get(self, out):
        out[...] = self.view(np.ndarray)
        return out

    def set(self, arr):
        self.view(np.ndarray)[...] = arr


def fake_cupy(count=2, raises=False):
    events = []

    class CUDARuntimeError(RuntimeError):
        pass

    def get_count():
        if raises:
            raise CUDARuntimeError("cudaErrorNoDevice")
        return count

    current = {"id": 0}

    class Device:
        def __init__(self, index=None):
            self.id = current["id"] if index is None else index

        def use(self):
            current["id"] = self.id
            events.append(("use", self.id))

    stream = types.SimpleNamespace(synchronize=lambda: events.append(("sync",)))
    runtime = types.SimpleNamespace(getDeviceCount=get_count, CUDARuntimeError=CUDARuntimeError)
    cuda = types.SimpleNamespace(runtime=runtime, Device=Device, get_current_stream=lambda: stream)
    cp = types.ModuleType("cupy")
    cp.cuda = cuda
    cp.from_dlpack = lambda obj: np.from_dlpack(obj.host).view(FakeDevArray)

    def empty_pinned(shape, dtype):
        events.append(("pinned", shape))
        return np.empty(shape, dtype)

    cpx = types.ModuleType("cupyx")
    cpx.empty_pinned = empty_pinned
    return cp, cpx, events


@pytest.fixture
def with_cupy(monkeypatch):
    def install(**kw):
        cp, cpx, events = fake_cupy(**kw)
        monkeypatch.setitem(sys.modules, "cupy", cp)
        monkeypatch.setitem(sys.modules, "cupyx", cpx)
        monkeypatch.setattr(_devcomm, "_state", {})
        return events

    return install


def test_gpu_unavailable_reason_without_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    reason = _gpu.gpu_unavailable_reason()
    assert reason is not None and "cupy is not usable" in reason
    assert _gpu.device_count() == 0


def test_gpu_unavailable_reason_with_cupy(with_cupy):
    with_cupy(count=0)
    assert _gpu.gpu_unavailable_reason() == "cupy sees no CUDA device"
    with_cupy(raises=True)
    assert _gpu.device_count() == 0 and _gpu.gpu_unavailable_reason() is not None
    with_cupy(count=2)
    assert _gpu.gpu_unavailable_reason() is None and _gpu.device_count() == 2


def test_bind_device_uses_local_rank_modulo_count(with_cupy):
    events = with_cupy(count=2)
    assert _gpu.bind_device(3) == 1 and _gpu.current_device() == 1
    assert _gpu.bind_device(4) == 0 and _gpu.current_device() == 0
    assert events == [("use", 1), ("use", 0)]
    with_cupy(count=0)
    with pytest.raises(MeshError, match="no CUDA device"):
        _gpu.bind_device(0)


def test_device_comm_glue_stages_through_the_pinned_pool(with_cupy, monkeypatch):
    events = with_cupy(count=1)
    monkeypatch.delenv("DTENSOR_GPU_COMM", raising=False)
    log = Log()
    fake = FakeComm(log)
    fake.log = events  # the fake cupy's stream sync records into ``events``
    comm = _devcomm.device_comm(fake, cuda_aware=False)
    assert comm.path == "staged" and comm.backend is _devcomm.cupy_backend()
    x = np.arange(4, dtype=np.float32).view(FakeDevArray)
    comm.allreduce(x, None)
    np.testing.assert_array_equal(x.view(np.ndarray), [0, 2, 4, 6])
    assert events == [("pinned", (4096,)), ("sync",), ("mpi", "allreduce"), ("sync",)]
    comm.allreduce(x, None)
    assert _devcomm.pinned_pool().stats() == {
        "reserved_bytes": 4096, "cached_bytes": 4096, "in_use_bytes": 0,
        "peak_reserved_bytes": 4096, "num_allocs": 1, "cache_hits": 1,
    }  # fmt: skip
    assert _devcomm.device_comm(fake, cuda_aware=True).path == "cuda-aware"
    assert _devcomm.device_comm(fake, cuda_aware=True, path="staged").path == "staged"


# -- DLPack -------------------------------------------------------------------------------


def test_from_dlpack_host_is_zero_copy():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)[:, 1:]
    t = _dlpack.from_dlpack(a)
    assert isinstance(t, dt.Tensor) and t.shape == (3, 3) and t.device.type == "cpu"
    t[0, 0] = 100
    assert a[0, 0] == 100
    u = _dlpack.from_dlpack(t)  # a dt.Tensor is a producer too
    u[1, 1] = -1
    assert a[1, 1] == -1 and t[1, 1].item() == -1
    np.testing.assert_array_equal(np.from_dlpack(t.numpy()), a)


def test_from_dlpack_device_and_errors(monkeypatch, with_cupy):
    class Producer:
        def __init__(self, kind, host=None):
            self.kind, self.host = kind, host

        def __dlpack__(self, stream=None):
            return self.host.__dlpack__()

        def __dlpack_device__(self):
            return (self.kind, 0)

    with pytest.raises(DTypeError, match="__dlpack__"):
        _dlpack.from_dlpack([1, 2])
    with pytest.raises(DTensorError, match="DLPack device type 4"):
        _dlpack.from_dlpack(Producer(4))
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(ImportError, match="need cupy"):
        _dlpack.from_dlpack(Producer(2))
    with_cupy(count=1)
    host = np.arange(3.0)
    t = _dlpack.from_dlpack(Producer(2, host))  # routed to cupy.from_dlpack
    assert isinstance(t._arr, FakeDevArray)


def test_to_dlpack_round_trip():
    t = dt.arange(5, dtype=dt.float32)
    cap = _dlpack.to_dlpack(t)
    assert type(cap).__name__ == "PyCapsule"
    with pytest.raises(DTypeError, match="expected a dt.Tensor"):
        _dlpack.to_dlpack(np.zeros(2))
