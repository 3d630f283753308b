"""The compiled fast path and the Python path give identical results under MPI.

Run at 1-4 ranks:
``mpiexec -n K python -m pytest tests/mpi/dispatch/test_fastpath_modes.py --with-mpi``.
Every program runs on both paths (switched at runtime); values (the full tensor), local
shapes, strides and offsets, placements, dtypes and the propagation-cache counters must
agree, including for entries that redistribute an input or produce a Partial.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import dtensor as dt
import fastpath

pytestmark = pytest.mark.skipif(
    not fastpath.ENABLED, reason="compiled fast path not enabled (not built or disabled)"
)
R, S, P = dt.Replicate(), dt.Shard, dt.Partial


def _meshes():
    n = MPI.COMM_WORLD.size
    meshes = [((n,), [[S(0)], [S(1)], [R]])]
    if n == 4:
        meshes.append(((2, 2), [[S(0), S(1)], [S(1), R], [R, S(0)]]))
    return meshes


def _programs(mesh, placements, rng):
    a = rng.standard_normal((7, 5)).astype(np.float32)  # uneven over 2, 3 and 4 ranks
    b = rng.standard_normal((7, 5)).astype(np.float32)
    w = rng.standard_normal((5, 3)).astype(np.float32)
    c = rng.standard_normal((6, 40)).astype(np.float32)  # rows long enough for the sum lanes
    x = dt.distribute_tensor(a, mesh, placements)
    y = dt.distribute_tensor(b, mesh, placements)
    wr = dt.distribute_tensor(w, mesh, [R] * mesh.ndim)
    ws = dt.distribute_tensor(w, mesh, [S(0)] + [R] * (mesh.ndim - 1))
    xc = dt.distribute_tensor(c, mesh, placements)
    return {
        "add": lambda: x + y,
        "mul_scalar": lambda: x * 1.5,
        "rsub": lambda: 2.0 - x,
        "relu": lambda: x.relu(),
        "gelu": lambda: dt.gelu(x),
        "sum": lambda: x.sum(),
        "sum_dim": lambda: x.sum(dim=1),
        "mean": lambda: x.mean(),
        "mean_dim0": lambda: x.mean(dim=0, keepdim=True),
        "mean_dim1": lambda: x.mean(dim=1),
        "sum_rows": lambda: xc.sum(dim=(1,)),  # dims as a tuple or list: the same loop
        "mean_rows": lambda: xc.mean(dim=[-1]),
        "sum_all": lambda: xc.sum(dim=(0, 1)),
        "mm_R": lambda: x @ wr,
        "mm_S0": lambda: x @ ws,  # redistributes (or yields a Partial) depending on x
        "partial_plus_scalar": lambda: (x @ ws) + 1.0,
        "softmax": lambda: x.softmax(dim=-1),
        "log_softmax": lambda: dt.log_softmax(x, -1),
        "gelu_tanh": lambda: dt.gelu(x, approximate="tanh"),
        "view": lambda: x.view(-1),
        "reshape": lambda: x.reshape(5, 7),
        "t": lambda: x.t(),
        "getitem": lambda: x[:, 1:4],
        "lt": lambda: x < y,
    }


def _observe(out):
    loc = out.to_local()
    full = out.full_tensor().numpy()
    return (
        tuple(out.shape), str(out.dtype), tuple(out.placements), tuple(loc.shape),
        loc.stride(), loc.storage_offset(), full.tobytes(), loc.numpy().tobytes(),
    )


def _run(mesh, placements, seed, fast):
    dt.debug.set_fastpath(fast)
    dt.debug.clear_prop_cache()
    progs = _programs(mesh, placements, np.random.default_rng(seed))
    seen = {}
    for _ in range(3):
        for name, fn in progs.items():
            seen[name] = _observe(fn())
    st = dt.debug.prop_cache_stats()
    return seen, (st["hits"], st["misses"], st["size"], st["evictions"]), st["fast_hits"]


@pytest.mark.mpi(min_size=1)
def test_paths_agree(seed):
    for shape, placement_sets in _meshes():
        mesh = dt.init_device_mesh(shape)
        for placements in placement_sets:
            try:
                slow, slow_stats, slow_fast_hits = _run(mesh, placements, seed, False)
                fast, fast_stats, fast_hits = _run(mesh, placements, seed, True)
            finally:
                dt.debug.set_fastpath(True)
            assert slow_fast_hits == 0
            assert fast_hits > 0
            for name in slow:
                assert fast[name] == slow[name], (shape, placements, name)
            assert fast_stats == slow_stats, (shape, placements)


@pytest.mark.mpi(min_size=2)
def test_cached_redistribution_runs_from_the_fast_path(seed):
    mesh = dt.init_device_mesh((MPI.COMM_WORLD.size,))
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((6, 4)).astype(np.float32)
    b = rng.standard_normal((6, 4)).astype(np.float32)
    x = dt.distribute_tensor(a, mesh, [S(0)])
    y = dt.distribute_tensor(b, mesh, [S(1)])  # x + y must move one input
    dt.debug.set_fastpath(True)
    dt.debug.clear_prop_cache()
    for _ in range(3):
        out = x + y
        np.testing.assert_allclose(out.full_tensor().numpy(), a + b, rtol=1e-6)
    st = dt.debug.prop_cache_stats()
    assert st["misses"] == 1 and st["fast_hits"] >= 2
