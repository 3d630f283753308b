"""DTensors on ``device="cuda"`` meshes, compared with numpy (run under mpiexec).

Every test takes the ``device`` parameter: ``cpu`` and ``cuda`` by default, or the
comma-separated list in ``DTENSOR_TEST_DEVICE`` (``DTENSOR_TEST_DEVICE=cuda`` runs only the
GPU cases). The CPU cases run the same bodies on any machine. The ``cuda`` cases skip when
cupy or a GPU is missing; the decision comes from ``dtensor.distributed.gpu.gpu_unavailable_reason``,
which reads only the installation and the driver (no collective), so all ranks skip together.
When ``cuda`` is asked for explicitly, a missing GPU fails instead of skipping.

With more ranks than GPUs, ranks share a GPU (local rank modulo device count).
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
from helpers.mpi import meshes_dp_tp as meshes
from helpers.mpi import np_local
from mpi4py import MPI

import dtensor as dt
from dtensor.distributed import gpu as _gpu
from redistribute.execute import execute
from redistribute.plan import plan
from redistribute.staging import DeviceBackend, DeviceComm

WORLD = MPI.COMM_WORLD
R, S, P = dt.Replicate(), dt.Shard, dt.Partial

REQUESTED = tuple(d.strip() for d in os.environ.get("DTENSOR_TEST_DEVICE", "").split(",") if d)
DEVICES = REQUESTED or ("cpu", "cuda")
UNAVAILABLE = _gpu.gpu_unavailable_reason()

if UNAVAILABLE is None:  # bind each rank to its GPU (collective: every rank gets here)
    _node = WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    _gpu.bind_device(_node.Get_rank())
    _node.Free()


def _param(device: str):
    marks = []
    if device == "cuda" and UNAVAILABLE is not None and "cuda" not in REQUESTED:
        marks.append(pytest.mark.skip(reason=f"no GPU: {UNAVAILABLE}"))
    return pytest.param(device, marks=marks, id=device)


@pytest.fixture(params=[_param(d) for d in DEVICES])
def device(request) -> str:
    if request.param == "cuda" and UNAVAILABLE is not None:
        pytest.fail(f"DTENSOR_TEST_DEVICE asks for cuda, but {UNAVAILABLE}")
    return request.param


def host(x) -> np.ndarray:
    """A DTensor's global value, or a local tensor's, as a numpy array (explicit copy)."""
    if isinstance(x, dt.DTensor):
        x = x.full_tensor()
    return x.cpu().numpy()


def xp_for(device: str):
    if device == "cpu":
        return np
    import cupy

    return cupy


def global_data(shape, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.mpi(min_size=1)
def test_skip_decision_is_identical_on_all_ranks():
    reasons = WORLD.allgather(UNAVAILABLE)
    assert all(r == reasons[0] for r in reasons), reasons


@pytest.mark.mpi(min_size=1)
def test_local_tensor_lives_on_the_device(device):
    t = dt.arange(12, dtype=dt.float32, device=device).reshape(3, 4)
    assert t.device.type == device and t.is_cuda == (device == "cuda")
    v = t.t()[1:, ::2]  # a view: same storage, new strides
    assert v.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    v.fill_(-1)
    expect = np.arange(12, dtype=np.float32).reshape(3, 4)
    expect.T[1:, ::2] = -1
    np.testing.assert_array_equal(host(t), expect)
    if device == "cuda":
        with pytest.raises(TypeError, match="Use Tensor.cpu"):
            t.numpy()  # a GPU tensor reaches the host by an explicit copy only
        np.testing.assert_array_equal(t.numpy(force=True), expect)
    else:
        assert np.shares_memory(t.numpy(), host(t))


@pytest.mark.mpi(min_size=1)
def test_memory_stats_track_device_allocations(device):
    dt.empty_cache(device)
    before = dt.memory_stats(device)
    t = dt.empty(1 << 20, dtype=dt.float32, device=device)  # 4 MiB
    held = dt.memory_stats(device)
    assert held["allocated_bytes"] >= before["allocated_bytes"] + t.nbytes
    del t
    dt.empty_cache(device)
    assert dt.memory_stats(device)["reserved_bytes"] < held["reserved_bytes"]


@pytest.mark.mpi(min_size=1)
def test_dlpack_interop_shares_memory(device):
    xp = xp_for(device)
    arr = xp.arange(6, dtype=xp.float32)
    t = dt.from_dlpack(arr)
    assert t.device.type == device
    t.fill_(3)
    assert float(arr.sum()) == 18.0
    back = xp.from_dlpack(t.contiguous()._arr)
    back[0] = 5
    np.testing.assert_array_equal(host(t), [5, 3, 3, 3, 3, 3])


@pytest.mark.mpi(min_size=1)
def test_device_binding_round_robin(device):
    if device == "cpu":
        pytest.skip("device binding is a GPU matter")
    local = WORLD.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
    expect = _gpu.select_device_for(local, _gpu.device_count())
    assert _gpu.current_device() == expect
    t = dt.ones(3, device=device)
    assert t.device.index in (None, expect)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("shape", [(7, 5), (2, 3)])
def test_redistribute_every_placement_pair(device, shape):
    g = global_data(shape)
    for mesh in meshes(device):
        opts = [R, P("sum"), S(0), S(1)]
        for src, dst in itertools.product(itertools.product(opts, repeat=mesh.ndim), repeat=2):
            x = dt.distribute_tensor(dt.from_numpy(g).to(device), mesh, list(src))
            assert x.to_local().device.type == device
            y = x.redistribute(mesh, list(dst))
            assert tuple(y.placements) == dst and y.to_local().device.type == device
            np.testing.assert_allclose(host(y), g, rtol=1e-6, atol=1e-6, err_msg=f"{src}->{dst}")


@pytest.mark.mpi(min_size=1)
def test_ops_match_numpy(device):
    mesh = meshes(device)[0]
    a, w = global_data((8, 6), 1), global_data((6, 4), 2)
    x = dt.distribute_tensor(dt.from_numpy(a).to(device), mesh, [S(0)])
    wt = dt.distribute_tensor(dt.from_numpy(w).to(device), mesh, [R])
    y = (x @ wt).relu().sum(dim=1)
    np.testing.assert_allclose(host(y), np.maximum(a @ w, 0).sum(axis=1), rtol=1e-5, atol=1e-5)
    z = dt.softmax(x * 2.0 + 1.0, dim=1)
    e = np.exp(2 * a + 1 - (2 * a + 1).max(axis=1, keepdims=True))
    np.testing.assert_allclose(host(z), e / e.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-6)
    assert z.to_local().device.type == device


@pytest.mark.mpi(min_size=1)
def test_repeated_ops_reuse_the_cached_plan(device):
    """The propagation cache (and the fast path when built) serve GPU tensors unchanged."""
    mesh = meshes(device)[0]
    a, b = global_data((6, 4), 3), global_data((6, 4), 4)
    x = dt.distribute_tensor(dt.from_numpy(a).to(device), mesh, [S(0)])
    y = dt.distribute_tensor(dt.from_numpy(b).to(device), mesh, [R])
    results = [host(x + y) for _ in range(4)]
    for r in results:
        np.testing.assert_allclose(r, a + b, rtol=1e-6)


# -- the staged path's logic on real MPI, numpy standing in for device memory ---------------


class Dev(np.ndarray):
    """An ndarray that plays device memory."""


class HostOnly:
    """Forwards to a Comm, failing when a device buffer would reach MPI."""

    def __init__(self, comm):
        self._comm = comm

    def __getattr__(self, name):
        target = getattr(self._comm, name)
        if not callable(target):
            return target

        def call(*args, **kw):
            assert not any(isinstance(a, Dev) for a in (*args, *kw.values())), name
            return target(*args, **kw)

        return call


def _copy(src, dst):
    dst.view(np.ndarray)[...] = src.view(np.ndarray)


STANDIN = DeviceBackend("numpy-standin", lambda a: isinstance(a, Dev), _copy, _copy, lambda: None)


@pytest.mark.mpi(min_size=1)
def test_staged_execute_matches_host_execute():
    """Every placement pair through DeviceComm's staged path equals the host result."""
    g = global_data((7, 6), 5)
    for mesh in meshes("cpu"):
        coord = mesh.get_coordinate()
        comms = mesh.get_all_groups()
        staged = [DeviceComm(HostOnly(c), STANDIN, "staged") for c in comms]
        opts = [R, P("sum"), S(0), S(1)]
        for src, dst in itertools.product(itertools.product(opts, repeat=mesh.ndim), repeat=2):
            x = dt.distribute_tensor(g, mesh, list(src))
            spec, local = x._spec, x.to_local().numpy()
            steps = plan(spec, list(dst))
            want = execute(steps, local, spec, coord, comms, np.empty)
            got = execute(
                steps, np.ascontiguousarray(local).view(Dev), spec, coord, staged,
                lambda shape, dtype: np.empty(shape, dtype).view(Dev),
            )  # fmt: skip
            assert isinstance(got, Dev) or not steps
            np.testing.assert_array_equal(got.view(np.ndarray), want, err_msg=f"{src}->{dst}")
            if not any(p.is_partial() for p in dst):  # and numpy's block of the global data
                np.testing.assert_array_equal(got.view(np.ndarray), np_local(g, mesh, dst),
                                              err_msg=f"{src}->{dst}")
