"""The compiled dispatch front against the Python dispatcher (one process, a 1-rank mesh).

Both paths must give identical values, placements, shapes, strides and dtypes, and identical
propagation-cache behaviour (hits, misses, size, evictions and the LRU order). Tests that
need the compiled front skip when it is not available (extension not built or
``DTENSOR_FASTPATH=0``); the fallback behaviour is checked in subprocesses.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
from helpers import ROOT
from helpers.jobs import PKG_ROOT

import dtensor as dt
import fastpath
from dtensor.dispatch import compiled as front
from dtensor.dispatch import dispatcher as _dispatch
from dtensor.ops import OPS

needs_front = pytest.mark.skipif(
    not fastpath.ENABLED, reason="compiled fast path not enabled (not built or disabled)"
)


@pytest.fixture(scope="module")
def mesh():
    return dt.init_device_mesh((1,))


@pytest.fixture(autouse=True)
def _fresh_cache():
    active = dt.debug.fastpath_status()["active"]
    dt.debug.clear_prop_cache()
    yield
    dt.debug.set_prop_cache_size(4096)
    dt.debug.clear_prop_cache()
    if fastpath.ENABLED:
        dt.debug.set_fastpath(active)


def _data(shape=(4, 6), dtype=np.float32, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


#: Shapes of the programs' operands: below the allocator's pooling size (numpy allocates
#: the outputs) and above it (pooled outputs, which the front allocates itself).
SHAPES = [(4, 6), (48, 64)]


def _programs(mesh, shape=SHAPES[0]):
    """Calls that reach the dispatcher through every kind of entry point."""
    s0, r = [dt.Shard(0)], [dt.Replicate()]
    a, b = _data(shape), _data(shape, seed=1)
    x = dt.distribute_tensor(a, mesh, s0, src_data_rank=None)
    y = dt.distribute_tensor(b, mesh, s0, src_data_rank=None)
    w = dt.distribute_tensor(_data((shape[1], shape[1]), seed=2), mesh, r, src_data_rank=None)
    i = dt.distribute_tensor(np.arange(a.size, dtype=np.int64).reshape(shape), mesh, s0,
                             src_data_rank=None)
    return {
        "add": lambda: x + y,
        "add_alpha": lambda: x.add(y, alpha=2),
        "radd": lambda: 1.5 + x,
        "sub": lambda: x - y,
        "mul_scalar": lambda: x * 2.5,
        "mul_int": lambda: x * 3,
        "div": lambda: x / y,
        "pow": lambda: x ** 2,
        "neg": lambda: -x,
        "rsub": lambda: 1.0 - x,
        "rtruediv": lambda: 2 / x,
        "numpy_scalar_plus": lambda: np.float32(2) + x,
        "lt": lambda: x < y,
        "eq_scalar": lambda: x == 0.5,
        "matmul": lambda: x @ w,
        "relu": lambda: x.relu(),
        "gelu": lambda: dt.gelu(x),
        "dt_add": lambda: dt.add(x, y),
        "maximum": lambda: dt.maximum(x, y),
        "sum": lambda: x.sum(),
        "sum_dim": lambda: x.sum(dim=1),
        "sum_keepdim": lambda: x.sum(1, True),
        "mean": lambda: x.mean(),
        "softmax": lambda: x.softmax(dim=-1),
        "view": lambda: x.view(-1),
        "view_args": lambda: x.view(2, -1),
        "reshape": lambda: x.reshape((shape[1], shape[0])),
        "t": lambda: x.t(),
        "transpose": lambda: x.transpose(0, 1),
        "permute": lambda: x.permute(1, 0),
        "contiguous": lambda: x.t().contiguous(),
        "contiguous_already": lambda: x.contiguous(),
        "clone": lambda: x.clone(),
        "clone_transposed": lambda: x.t().clone(),
        "getitem": lambda: x[:, 1:5],
        "getitem_int": lambda: x[:, 2],
        "int_plus_float": lambda: i + 0.5,
        "int_floordiv": lambda: i // 4,
        "max_dim": lambda: x.max(dim=1),
        "amax_dim": lambda: x.amax(dim=1),
        "amin_all": lambda: x.amin(),
        "amax_keepdim": lambda: x.amax((0, 1), True),
        "amax_int": lambda: i.amax(dim=0),
        "split": lambda: x.split(2, dim=1),
    }


def _describe(out):
    """Everything observable about a result: values, dtype, shape, placements, strides."""
    if isinstance(out, tuple):
        return tuple(_describe(o) for o in out)
    loc = out.to_local()
    return (
        type(out).__name__,
        tuple(out.shape),
        str(out.dtype),
        tuple(out.placements),
        tuple(loc.shape),
        loc.stride(),
        loc.storage_offset(),
        loc.numpy().tobytes(),
    )


def _run_all(mesh, shape, repeat=3):
    """Run every program ``repeat`` times; results of the last round and cache counters."""
    dt.debug.clear_prop_cache()
    progs = _programs(mesh, shape)
    results = {}
    for _ in range(repeat):
        for name, fn in progs.items():
            results[name] = _describe(fn())
    stats = dt.debug.prop_cache_stats()
    return results, {k: stats[k] for k in ("hits", "misses", "size", "evictions")}


@needs_front
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_both_paths_give_identical_results_and_cache_behaviour(mesh, shape):
    dt.debug.set_fastpath(False)
    slow, slow_stats = _run_all(mesh, shape)
    assert dt.debug.prop_cache_stats()["fast_hits"] == 0
    dt.debug.set_fastpath(True)
    fast, fast_stats = _run_all(mesh, shape)
    assert fast == slow
    assert fast_stats == slow_stats
    assert dt.debug.prop_cache_stats()["fast_hits"] > 0


def _dispatcher_calls(fn) -> list[str]:
    """Names of the Python dispatcher's functions that run during ``fn()`` (whoever calls
    them: the compiled front holds its own references to ``lookup`` and ``run_entry``)."""
    seen = []

    def profile(frame, event, _arg):
        if event == "call" and frame.f_code.co_filename == _dispatch.__file__:
            seen.append(frame.f_code.co_name)

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(previous)
    return seen


@needs_front
def test_fast_hits_are_served_without_the_python_dispatcher(mesh):
    x = dt.distribute_tensor(_data(), mesh, [dt.Shard(0)], src_data_rank=None)
    dt.debug.set_fastpath(False)
    x + x
    assert "lookup" in _dispatcher_calls(lambda: x + x)  # the Python path is seen
    dt.debug.set_fastpath(True)
    x + x
    before = dt.debug.prop_cache_stats()
    assert _dispatcher_calls(lambda: x + x) == []
    after = dt.debug.prop_cache_stats()
    assert after["fast_hits"] == before["fast_hits"] + 1
    assert after["hits"] == before["hits"] + 1
    assert after["misses"] == before["misses"]


@needs_front
@pytest.mark.parametrize(
    "name",
    ["add", "mul_scalar", "maximum", "relu", "gelu", "matmul", "clone", "contiguous", "t",
     "softmax"],
)
def test_outputs_of_every_size_are_served_by_the_front(mesh, name):
    """From the pooling size on, the front writes into a pooled output itself (no detour
    through the Python dispatcher); the outputs live in the pool (node-shared memory when
    it is on), are new memory and hold the same values as on the Python path."""
    from dtensor.local import allocator
    from redistribute import shm

    fn = _programs(mesh, (64, 64))[name]
    dt.debug.set_fastpath(False)
    want = _describe(fn())
    dt.debug.set_fastpath(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. numpy's deprecation of a positional out
        fn()
    assert _dispatcher_calls(fn) == []
    out = fn()
    assert _describe(out) == want
    arr = out.to_local().numpy()
    assert arr.nbytes >= allocator.POOL_MIN_BYTES
    if name != "t":  # a view: shares its input's memory
        owner = arr
        while isinstance(owner, np.ndarray):
            owner = owner.base
        assert type(owner) is fastpath.pool.Lease
        assert not any(np.shares_memory(arr, o.to_local().numpy()) for o in [fn(), fn()])
        if shm.enabled():
            assert shm.locate(arr) is not None


@needs_front
def test_row_reductions_and_transposed_copies_run_the_compiled_loops(mesh):
    """The front's raw forms of sum/mean/amax and softmax/log_softmax over the last dim call
    the compiled loops the local kernels call, and ``contiguous`` of a transposed shard the
    tiled transpose; both paths give the same bytes (a transposed softmax input goes to the
    kernel's other path)."""
    from dtensor.dispatch import compiled as front

    for op in ("sum", "amax"):
        assert isinstance(front._REDUCE[op], fastpath.kernels.LastDimReduce), op
    for op in ("softmax", "log_softmax"):
        assert isinstance(front._SOFTMAX[op], fastpath.kernels.LastDimSoftmax), op
    x = dt.distribute_tensor(_data((160, 96)), mesh, [dt.Shard(0)], src_data_rank=None)
    calls = [lambda: x.sum(dim=1), lambda: x.mean(-1, True), lambda: x.amax(dim=1),
             lambda: x.sum(), lambda: x.t().contiguous(), lambda: x.t().reshape(-1),
             lambda: x.softmax(-1), lambda: dt.log_softmax(x, 1), lambda: x.t().softmax(1)]
    for call in calls:
        dt.debug.set_fastpath(False)
        want = _describe(call())
        dt.debug.set_fastpath(True)
        call()
        assert _describe(call()) == want


@needs_front
@pytest.mark.parametrize("mode", [True, False])
def test_cache_keys_distinguish_what_matters(mesh, mode):
    dt.debug.set_fastpath(mode)
    s0, r = [dt.Shard(0)], [dt.Replicate()]
    x = dt.distribute_tensor(_data(), mesh, s0, src_data_rank=None)
    xr = dt.distribute_tensor(_data(), mesh, r, src_data_rank=None)
    x64 = dt.distribute_tensor(_data(dtype=np.float64), mesh, s0, src_data_rank=None)
    xs = dt.distribute_tensor(_data((4, 5)), mesh, s0, src_data_rank=None)
    calls = [
        lambda: x.sum(dim=0), lambda: x.sum(dim=1), lambda: x.sum(dim=1, keepdim=True),
        lambda: xr.sum(dim=1), lambda: x64.sum(dim=1), lambda: xs.sum(dim=1),
        lambda: x * 2.0, lambda: x * 2, lambda: x.view(-1), lambda: x.view(6, 4),
    ]
    for i, call in enumerate(calls):
        call()
        assert dt.debug.prop_cache_stats()["misses"] == i + 1, i
    for call in calls:
        call()
    assert dt.debug.prop_cache_stats()["misses"] == len(calls)
    before = dt.debug.prop_cache_stats()["hits"]
    for k in range(5):  # a changing python scalar's value never misses
        out = x * (0.5 + k)
        np.testing.assert_array_equal(out.to_local().numpy(), x.to_local().numpy() * (0.5 + k))
    assert dt.debug.prop_cache_stats()["misses"] == len(calls)
    assert dt.debug.prop_cache_stats()["hits"] == before + 5


@needs_front
def test_alternating_signatures_at_one_op_never_reuse_the_previous_entry(mesh):
    # the front tries the previous hit's entry first: every switch must still key correctly
    dt.debug.set_fastpath(True)
    a = _data()
    x = dt.distribute_tensor(a, mesh, [dt.Replicate()], src_data_rank=None)
    y = dt.distribute_tensor(a[:, :3].copy(), mesh, [dt.Replicate()], src_data_rank=None)
    for _ in range(3):
        for t, arr in ((x, a), (y, a[:, :3])):
            for dim in (0, 1):
                got = t.sum(dim=dim).to_local().numpy()
                np.testing.assert_array_equal(got, arr.sum(axis=dim))
        dt.debug.clear_prop_cache()  # a cleared cache invalidates the remembered entry too
        assert dt.debug.prop_cache_stats()["misses"] == 0
        np.testing.assert_array_equal(x.sum(dim=1).to_local().numpy(), a.sum(axis=1))
        assert dt.debug.prop_cache_stats()["misses"] == 1


def _outcome(fn):
    try:
        out = fn()
    except (ValueError, TypeError, RuntimeError, IndexError) as exc:  # must agree on paths
        return type(exc), str(exc)
    loc = out.to_local()
    return tuple(out.shape), out.placements, loc.stride(), loc.numpy().tobytes()


@needs_front
def test_packed_size_calls_bind_as_on_the_python_path(mesh):
    # view/reshape take their sizes as positionals or as one sequence; the compiled method
    # passes them on without re-packing, which must bind exactly as the Python binder does
    x = dt.distribute_tensor(_data((4, 6)), mesh, [dt.Replicate()], src_data_rank=None)
    one = dt.distribute_tensor(_data((1,)), mesh, [dt.Replicate()], src_data_rank=None)
    calls = [
        lambda: x.view(-1), lambda: x.view(2, -1), lambda: x.view((2, -1)),
        lambda: x.view([3, 8]), lambda: x.reshape(6, 4), lambda: x.reshape((24,)),
        lambda: x.view(5, -1), lambda: x.view(), lambda: one.view(), lambda: one.reshape(()),
        lambda: x.view(2, (3, 4)), lambda: x.permute(1, 0), lambda: x.permute((1, 0)),
    ]
    for k, call in enumerate(calls):
        dt.debug.set_fastpath(False)
        slow = [_outcome(call) for _ in range(2)]
        dt.debug.set_fastpath(True)
        fast = [_outcome(call) for _ in range(2)]
        assert fast == slow, k


@needs_front
def test_a_mutated_static_list_is_not_mistaken_for_the_old_value(mesh):
    dt.debug.set_fastpath(True)
    x = dt.distribute_tensor(_data((2, 3, 4)), mesh, [dt.Replicate()], src_data_rank=None)
    dims = [2, 0, 1]
    assert x.permute(dims).shape == (4, 2, 3)
    assert x.permute(dims).shape == (4, 2, 3)
    dims[:] = [1, 2, 0]
    assert x.permute(dims).shape == (3, 4, 2)
    assert x.permute((1, 2, 0)).shape == (3, 4, 2)
    assert dt.debug.prop_cache_stats()["misses"] == 2


@needs_front
def test_meshes_never_share_an_entry():
    dt.debug.set_fastpath(True)
    m1 = dt.init_device_mesh((1,))
    m2 = dt.init_device_mesh((1, 1))
    a = _data()
    x1 = dt.distribute_tensor(a, m1, [dt.Shard(0)], src_data_rank=None)
    x2 = dt.distribute_tensor(a, m2, [dt.Shard(0), dt.Replicate()], src_data_rank=None)
    assert (x1 + x1).device_mesh is m1
    assert (x2 + x2).device_mesh is m2
    assert (x1 + x1).device_mesh is m1
    assert dt.debug.prop_cache_stats()["misses"] == 2


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "python"])
def test_equal_meshes_built_separately_keep_their_own_outputs(fast):
    # two meshes over the same ranks compare equal, but each output keeps its input's mesh
    # object (ops and redistributes alike), on both paths
    if fast and not fastpath.ENABLED:
        pytest.skip("compiled fast path not enabled (not built or disabled)")
    dt.debug.set_fastpath(fast)
    ma, mb = dt.init_device_mesh((1,)), dt.init_device_mesh((1,))
    assert ma == mb and ma is not mb
    a = _data()
    xa = dt.distribute_tensor(a, ma, [dt.Shard(0)], src_data_rank=None)
    xb = dt.distribute_tensor(a, mb, [dt.Shard(0)], src_data_rank=None)
    for _ in range(2):  # the second round hits the caches
        for x, m in ((xa, ma), (xb, mb)):
            assert (x + x).device_mesh is m
            assert x.sum(dim=1).device_mesh is m
            assert x.redistribute(m, [dt.Replicate()]).device_mesh is m
    assert dt.debug.prop_cache_stats()["misses"] == 4


@needs_front
def test_lru_eviction_order_is_the_same_on_both_paths(mesh):
    def trace():
        dt.debug.clear_prop_cache()
        dt.debug.set_prop_cache_size(3)
        x = dt.distribute_tensor(_data(), mesh, [dt.Shard(0)], src_data_rank=None)
        ops = [lambda: x + x, lambda: x * 2.0, lambda: x.relu(), lambda: x.sum()]
        seen = []
        for i in (0, 1, 2, 0, 0, 1, 3, 2, 0, 1, 0, 3, 3, 2):
            ops[i]()
            stats = dt.debug.prop_cache_stats()
            seen.append((stats["hits"], stats["misses"], stats["evictions"]))
        _dispatch._FRONT.flush(_dispatch._CACHE.data)
        return seen, [k[0] for k in _dispatch._CACHE.data]

    dt.debug.set_fastpath(False)
    slow = trace()
    dt.debug.set_fastpath(True)
    assert trace() == slow


@needs_front
def test_default_dtype_change_is_part_of_the_key(mesh):
    dt.debug.set_fastpath(True)
    i = dt.distribute_tensor(np.arange(6, dtype=np.int64), mesh, [dt.Shard(0)],
                             src_data_rank=None)
    assert (i + 0.5).dtype == np.float32
    dt.set_default_dtype(dt.float64)
    assert (i + 0.5).dtype == np.float64
    dt.set_default_dtype(dt.float32)
    assert (i + 0.5).dtype == np.float32
    assert dt.debug.prop_cache_stats()["misses"] == 2


@needs_front
def test_entry_points_are_compiled_and_status_reports_them(mesh):
    dt.debug.set_fastpath(True)
    st = dt.debug.fastpath_status()
    assert st["active"] and st["path"] == "compiled" and st["reason"] is None
    for fn in (dt.DTensor.__lt__, dt.DTensor.relu, dt.DTensor.sum, dt.add):
        assert type(fn).__name__ == "cython_function_or_method", fn
    # arithmetic operators are the compiled base's C slots
    for d in ("__add__", "__radd__", "__mul__", "__matmul__", "__neg__"):
        assert d not in vars(dt.DTensor), d
    assert dt.DTensor.__add__ is fastpath.DTensorBase.__add__
    entries = (dt.DTensor.__lt__, dt.DTensor.relu, dt.DTensor.sum, dt.DTensor.redistribute)
    add = dt.add  # taken before the switch: it follows the flag too
    dt.debug.set_fastpath(False)
    st = dt.debug.fastpath_status()
    assert not st["active"] and st["path"] == "python"
    # nothing is installed again: the same entry points read the flag per call
    assert (dt.DTensor.__lt__, dt.DTensor.relu, dt.DTensor.sum,
            dt.DTensor.redistribute) == entries
    assert dt.add is add
    # the operator slots stay, now running the Python dispatcher
    assert dt.DTensor.__add__ is fastpath.DTensorBase.__add__
    x = dt.distribute_tensor(_data(), mesh, [dt.Shard(0)], src_data_rank=None)
    for f in (lambda: x + x, lambda: add(x, x), lambda: x.relu(), lambda: x < 1.0,
              lambda: x.redistribute(mesh, [dt.Replicate()])):
        f()
        before = dt.debug.fastpath_status()
        f()
        after = dt.debug.fastpath_status()
        assert after["fast_hits"] == before["fast_hits"]
        assert after["fast_redistributes"] == before["fast_redistributes"]
    dt.debug.set_fastpath(True)
    for f in (lambda: x + x, lambda: add(x, x), lambda: x.relu()):
        f()
        before = dt.debug.fastpath_status()["fast_hits"]
        f()
        assert dt.debug.fastpath_status()["fast_hits"] == before + 1


@needs_front
def test_errors_and_local_calls_fall_through_unchanged(mesh):
    dt.debug.set_fastpath(True)
    x = dt.distribute_tensor(_data(), mesh, [dt.Shard(0)], src_data_rank=None)
    with pytest.raises(TypeError, match="unexpected keyword"):
        x.sum(axis_typo=1)
    with pytest.raises(dt.errors.ShardingError):
        x + dt.tensor(_data())
    local = dt.tensor(_data())
    assert isinstance(dt.add(local, local), dt.Tensor)
    assert (x == "text") is False


def _subprocess(code: str, **env: str) -> str:
    full = {**os.environ, "PYTHONPATH": PKG_ROOT, **env}
    res = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], check=False, capture_output=True,
        text=True,
        env=full, timeout=120, cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr
    return res.stdout + res.stderr


def test_env_switch_forces_the_python_path():
    out = _subprocess(
        """
        import numpy as np, dtensor as dt, fastpath
        st = dt.debug.fastpath_status()
        assert not st["active"] and st["path"] == "python", st
        assert not fastpath.ENABLED
        assert type(dt.Tensor.__mro__[1]).__name__ == "type"  # the pure-Python base
        m = dt.init_device_mesh((1,))
        x = dt.distribute_tensor(np.ones((2, 2), np.float32), m, [dt.Shard(0)])
        assert (x + x).to_local().numpy().sum() == 8
        print("ok")
        """,
        DTENSOR_FASTPATH="0",
    )
    assert "ok" in out


def test_missing_extension_warns_once_and_runs_on_the_python_path():
    out = _subprocess(
        """
        import sys, warnings
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name in ("fastpath._dispatch", "fastpath._strides"):
                    raise ImportError(f"blocked {name}")
        sys.meta_path.insert(0, Block())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import numpy as np, dtensor as dt, fastpath
        msgs = [str(w.message) for w in caught if "Python path" in str(w.message)]
        assert len(msgs) == 1, msgs
        st = dt.debug.fastpath_status()
        assert not st["built"] and st["path"] == "python" and "not built" in st["reason"]
        m = dt.init_device_mesh((1,))
        x = dt.distribute_tensor(np.ones((2, 2), np.float32), m, [dt.Shard(0)])
        assert (x * 3.0).sum().to_local().item() == 12.0
        try:
            dt.debug.set_fastpath(True)
        except RuntimeError:
            print("ok")
        """,
    )
    assert "ok" in out


@needs_front
def test_raw_forms_of_views_survive_autograd_activation():
    """Entries filled after autograd is active (Tensor's view methods are then their
    recording forms) still get the compiled front's raw forms of view, reshape, t,
    getitem, clone and contiguous (they lost them: view ops ran 2-5x slower in a process
    once it had trained)."""
    dt.ones(1).requires_grad_()  # autograd active from here on
    mesh = dt.init_device_mesh((1,))
    x = dt.distribute_tensor(np.ones((4, 4), np.float32), mesh, [dt.Shard(0)])
    calls = {"view": [x, (2, 8)], "reshape": [x, (8, 2)], "t": [x],
             "getitem": [x, (slice(None), slice(1, 3))], "clone": [x], "contiguous": [x.t()]}
    for name, values in calls.items():
        entry, _, _ = _dispatch.lookup(OPS[name], values)
        assert front.raw_form(OPS[name], entry, values) is not None, name
