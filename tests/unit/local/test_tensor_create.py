"""Creation of local tensors: dtypes and defaults, from_numpy/as_tensor/tensor, factories,
the counter-based random generator, storages and allocators, and the hand-off of
factories with a device mesh to the distributed factory."""

from __future__ import annotations

import numpy as np
import pytest

import dtensor as dt
from dtensor.errors import DTypeError, PlacementError, ViewError
from dtensor.local import backend as _backend
from dtensor.local import rng as _random


def meta(t):
    return tuple(t.shape), t.stride(), t.storage_offset()


# ------------------------------------------------------------------------ dtypes


def test_dtype_names_are_numpy_dtypes():
    assert dt.float32 == np.float32 and isinstance(dt.float32, np.dtype)
    assert dt.float == dt.float32 and dt.double == dt.float64 and dt.half == dt.float16
    assert dt.int == dt.int32 and dt.long == dt.int64 and dt.short == dt.int16
    assert dt.bool == np.bool_ and dt.uint8 == np.uint8 and dt.int8 == np.int8
    assert dt.bfloat16.name == "bfloat16" and dt.bfloat16.itemsize == 2  # ml_dtypes


def test_to_dtype_conversions():
    from dtensor.local.dtypes import to_dtype

    assert to_dtype(float) == dt.float32 and to_dtype(int) == dt.int64
    assert to_dtype(bool) == dt.bool and to_dtype(complex) == dt.complex64
    assert to_dtype("float") == dt.float32 and to_dtype("int") == dt.int32
    assert to_dtype("long") == dt.int64 and to_dtype("float64") == dt.float64
    assert to_dtype(np.int16) == dt.int16 and to_dtype("i4") == dt.int32
    with pytest.raises(DTypeError, match="cannot interpret"):
        to_dtype("nonsense")
    with pytest.raises(DTypeError, match="unsupported dtype"):
        to_dtype(object)
    with pytest.raises(DTypeError, match="unsupported dtype"):
        to_dtype(np.dtype(">f4"))


def test_default_dtype_drives_float_inference():
    assert dt.get_default_dtype() == dt.float32
    assert dt.tensor([1.5]).dtype == dt.float32 and dt.zeros(2).dtype == dt.float32
    dt.set_default_dtype(dt.float64)
    assert dt.get_default_dtype() == dt.float64
    assert dt.tensor([1.5]).dtype == dt.float64 and dt.ones(2).dtype == dt.float64
    assert dt.tensor([1j]).dtype == dt.complex128 and dt.rand(2).dtype == dt.float64
    assert dt.arange(0.0, 1.0, 0.5).dtype == dt.float64 and dt.full((1,), 2.0).dtype == dt.float64
    assert dt.tensor([1, 2]).dtype == dt.int64  # ints are not affected
    with pytest.raises(DTypeError, match="floating-point"):
        dt.set_default_dtype(dt.int32)


def test_tensor_dtype_inference_from_python_and_numpy_data():
    assert dt.tensor([True, False]).dtype == dt.bool
    assert dt.tensor([1, 2]).dtype == dt.int64
    assert dt.tensor([True, 2]).dtype == dt.int64
    assert dt.tensor([1, 2.5]).dtype == dt.float32
    assert dt.tensor([1 + 2j]).dtype == dt.complex64
    assert dt.tensor([]).dtype == dt.float32 and dt.tensor([]).shape == (0,)
    assert dt.tensor(np.arange(3, dtype=np.float64)).dtype == dt.float64
    assert dt.tensor(np.int32(3)).dtype == dt.int32
    assert dt.tensor(dt.arange(3, dtype=dt.int16)).dtype == dt.int16
    assert dt.tensor([[1, 2], [3, 4]], dtype=dt.float64).dtype == dt.float64
    with pytest.raises(OverflowError):
        dt.tensor([2**63])
    with pytest.raises(DTypeError):
        dt.tensor(["a", "b"])


# ------------------------------------------------------------- from data / arrays


def test_tensor_constructor_and_is_tensor():
    t = dt.Tensor([[1.0, 2.0]])
    assert isinstance(t, dt.Tensor) and t.dtype == dt.float32 and t.tolist() == [[1.0, 2.0]]
    assert dt.is_tensor(t) and not dt.is_tensor(np.zeros(2)) and t.device == dt.Device("cpu")


def test_tensor_copies_and_is_contiguous():
    a = np.arange(12.0).reshape(3, 4).T
    t = dt.tensor(a)
    assert t.is_contiguous() and meta(t) == ((4, 3), (3, 1), 0)
    t[0, 0] = 100
    assert a[0, 0] == 0
    src = dt.arange(3)
    c = dt.tensor(src)
    c[0] = 9
    assert src[0].item() == 0


def test_from_numpy_is_zero_copy_both_ways():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = dt.from_numpy(a)
    t[1, 1] = -5
    assert a[1, 1] == -5
    a[2, 3] = 77
    assert t[2, 3].item() == 77
    assert t.data_ptr() == a.__array_interface__["data"][0]
    assert np.shares_memory(t.numpy(), a)
    with pytest.raises(TypeError, match=r"expected np.ndarray \(got list\)"):
        dt.from_numpy([1, 2])


def test_from_numpy_of_views_shares_one_storage():
    a = np.arange(20, dtype=np.int32)
    whole, tail, strided = dt.from_numpy(a), dt.from_numpy(a[5:]), dt.from_numpy(a[1::3])
    for t in (tail, strided):
        assert t.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
        assert t.untyped_storage().nbytes() == 80
    assert meta(tail) == ((15,), (1,), 5) and meta(strided) == ((7,), (3,), 1)
    m = dt.from_numpy(a.reshape(4, 5)[:, 1:3])
    assert meta(m) == ((4, 2), (5, 1), 1) and not m.is_contiguous()


def test_from_numpy_negative_strides_zero_copy():
    a = np.arange(10.0)
    r = dt.from_numpy(a[::-1])
    assert meta(r) == ((10,), (-1,), 9) and not r.is_contiguous()
    assert r.untyped_storage().data_ptr() == a.__array_interface__["data"][0]
    np.testing.assert_array_equal(r.numpy(), a[::-1])
    v = r.view(2, 5)  # one chunk of stride -1: PyTorch's rule allows the view
    assert meta(v) == ((2, 5), (-5, -1), 9)
    r[0] = 100
    assert a[9] == 100
    m = dt.from_numpy(np.arange(12.0).reshape(3, 4)[::-1])
    assert meta(m) == ((3, 4), (-4, 1), 8)
    with pytest.raises(ViewError, match="view size is not compatible"):
        m.view(12)
    np.testing.assert_array_equal(
        m.reshape(12).numpy(), np.arange(12.0).reshape(3, 4)[::-1].reshape(12)
    )
    c = m.clone()  # negative strides are not "dense": the clone is contiguous
    assert meta(c) == ((3, 4), (4, 1), 0)


def test_from_numpy_rejects_what_a_tensor_cannot_describe():
    rec = np.zeros(5, dtype=[("a", "f8"), ("b", "u1")])
    with pytest.raises(ViewError, match="not a multiple of the element size"):
        dt.from_numpy(rec["a"])  # byte stride 9
    raw = np.zeros(17, np.uint8)
    with pytest.raises(ViewError, match="starts 1 bytes into its memory"):
        dt.from_numpy(raw[1:].view(np.float64))
    with pytest.raises(DTypeError):
        dt.from_numpy(np.array(["x"]))
    with pytest.raises(DTypeError):
        dt.from_numpy(np.zeros(3, dtype=">f4"))
    # as_tensor copies what from_numpy cannot view
    t = dt.as_tensor(rec["a"])
    assert t.is_contiguous() and t.dtype == dt.float64 and t.shape == (5,)


def test_from_numpy_of_a_subclass_and_of_a_foreign_strided_buffer():
    mat = np.ma.masked_array(np.arange(4.0))
    assert type(dt.from_numpy(mat).numpy()) is np.ndarray
    buf = bytearray(64)
    strided = np.ndarray((4,), np.float32, buffer=buf, offset=8, strides=(12,))
    t = dt.from_numpy(strided)
    st = t.untyped_storage()
    assert st.nbytes() == 3 * 12 + 4 and meta(t) == ((4,), (3,), 0)
    assert dt.from_numpy(strided[1:]).untyped_storage().data_ptr() == st.data_ptr()
    t[2] = 1.5
    assert np.frombuffer(buf, np.float32, count=1, offset=8 + 24)[0] == 1.5


def test_as_tensor_shares_when_possible():
    a = np.arange(4.0)
    t = dt.as_tensor(a)
    assert np.shares_memory(t.numpy(), a)
    c = dt.as_tensor(a, dtype=dt.float32)
    assert c.dtype == dt.float32 and not np.shares_memory(c.numpy(), a)
    assert dt.as_tensor(t) is t and dt.as_tensor(t, dtype=dt.float64) is t
    assert dt.as_tensor([1, 2]).dtype == dt.int64


def test_storage_of_an_allocator_block_reports_its_allocator():
    owner_mem = np.zeros(4096, np.uint8)

    class Block:  # what the caching allocator hands out: the end of the base chain
        def __init__(self):
            self.__array_interface__ = {
                "data": (owner_mem.__array_interface__["data"][0], False),
                "shape": (4096,),
                "typestr": "|u1",
                "version": 3,
            }
            self.allocator = "pool-allocator"
            self.keep = owner_mem

    flat = np.asarray(Block())
    arr = flat[:1024].view(np.float32).reshape(16, 16)
    t = dt.from_numpy(arr)
    st = t.untyped_storage()
    assert st.allocator == "pool-allocator" and st.nbytes() == 4096
    assert t.t().untyped_storage().allocator == "pool-allocator"
    assert t[1:].storage_offset() == 16 and st.device == "cpu"
    assert dt.from_numpy(np.zeros(3)).untyped_storage().allocator is _backend.HOST_ALLOCATOR


def test_factories_allocate_through_the_allocator(monkeypatch):
    from dtensor.local import allocator as _allocator

    calls = []
    real = _allocator.empty_array

    def spy(shape, dtype, device="cpu"):
        calls.append((tuple(shape), np.dtype(dtype)))
        return real(shape, dtype, device)

    monkeypatch.setattr(_allocator, "empty_array", spy)
    dt.zeros(2, 3)
    dt.rand(4)
    dt.arange(5).view(5, 1).t().contiguous()  # contiguous already: no allocation
    dt.arange(6).view(2, 3).t().contiguous()
    dt.arange(6).view(2, 3).t().clone()
    dt.tensor([1, 2])
    assert ((2, 3), dt.float32) in calls and ((4,), dt.float32) in calls
    assert ((1, 5), dt.int64) not in calls
    assert ((3, 2), dt.int64) in calls and ((6,), dt.int64) in calls
    assert ((2,), dt.int64) in calls


# ---------------------------------------------------------------------- factories


def test_size_arguments_and_defaults():
    for t in (dt.empty(2, 3), dt.empty((2, 3)), dt.zeros([2, 3]), dt.ones(dt.Size([2, 3]))):
        assert t.shape == (2, 3) and t.dtype == dt.float32 and t.device == "cpu"
        assert t.is_contiguous()
    assert dt.zeros(2, 3).tolist() == [[0.0] * 3] * 2
    assert dt.ones(2, dtype=dt.int8).tolist() == [1, 1]
    assert dt.zeros(()).shape == () and dt.zeros(0).shape == (0,)
    assert dt.empty(2, device="cpu").device == _backend.CPU
    with pytest.raises(ValueError, match=r"negative dimension -1: \[2, -1\]"):
        dt.zeros(2, -1)


def test_full_infers_its_dtype_from_the_value():
    assert dt.full((2,), 1).dtype == dt.int64
    assert dt.full((2,), 1.5).dtype == dt.float32
    assert dt.full((2,), True).dtype == dt.bool
    assert dt.full((2,), 1.5, dtype=dt.int32).tolist() == [1, 1]
    assert dt.full((2, 2), dt.tensor(3.0)).tolist() == [[3.0, 3.0]] * 2
    assert dt.full(3, 2).tolist() == [2, 2, 2]


def test_arange_linspace_eye():
    assert dt.arange(5).tolist() == [0, 1, 2, 3, 4] and dt.arange(5).dtype == dt.int64
    assert dt.arange(1, 10, 3).tolist() == [1, 4, 7]
    assert dt.arange(10, 1, -3).tolist() == [10, 7, 4]
    assert dt.arange(0, 1, 0.25).tolist() == [0.0, 0.25, 0.5, 0.75]
    assert dt.arange(0, 1, 0.25).dtype == dt.float32
    assert dt.arange(3, dtype=dt.float64).dtype == dt.float64
    assert dt.arange(0).shape == (0,) and dt.arange(3, 3).shape == (0,)
    assert dt.arange(-1.5, 1.0).tolist() == [-1.5, -0.5, 0.5]
    with pytest.raises(ValueError, match="inconsistent with step sign"):
        dt.arange(0, 5, -1)
    with pytest.raises(ValueError, match="nonzero"):
        dt.arange(0, 5, 0)
    lin = dt.linspace(0, 1, 5)
    assert lin.dtype == dt.float32 and lin.tolist() == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert dt.linspace(-1, 1, 1).tolist() == [-1.0] and dt.linspace(0, 1, 0).shape == (0,)
    assert dt.linspace(0, 10, 5, dtype=dt.int64).tolist() == [0, 2, 5, 7, 10]
    l64 = dt.linspace(0.1, 0.7, 7, dtype=dt.float64).tolist()
    assert l64[-1] == 0.7 and l64[0] == 0.1  # both ends exact (symmetric formula)
    assert (
        dt.eye(3).tolist() == np.eye(3).tolist() and dt.eye(2, 3).tolist() == np.eye(2, 3).tolist()
    )
    assert dt.eye(2, dtype=dt.int32).dtype == dt.int32


def test_like_factories_inherit_and_preserve_strides():
    src = dt.arange(12, dtype=dt.int32).view(3, 4).t()
    e = dt.empty_like(src)
    assert e.dtype == dt.int32 and meta(e) == ((4, 3), (1, 4), 0)
    z = dt.zeros_like(src, dtype=dt.float64)
    assert z.dtype == dt.float64 and meta(z) == ((4, 3), (1, 4), 0) and (z.numpy() == 0).all()
    o = dt.ones_like(src[:, ::2])  # not dense: dense strides in its own order, as torch
    assert meta(o) == ((4, 2), (1, 4), 0) and (o.numpy() == 1).all()
    f = dt.full_like(src, 7)
    assert f.dtype == dt.int32 and (f.numpy() == 7).all()
    r = dt.rand_like(dt.zeros(3, 2, dtype=dt.float64))
    assert r.dtype == dt.float64 and r.shape == (3, 2)
    assert dt.randn_like(dt.zeros(4)).shape == (4,)
    with pytest.raises(DTypeError, match="floating-point"):
        dt.rand_like(src)
    assert dt.zeros_like(np.ones((2, 2), np.float64)).dtype == dt.float64


def test_device_strings_and_missing_cupy():
    assert _backend.as_device("cpu") is _backend.CPU and _backend.as_device(None) is _backend.CPU
    d = _backend.as_device("cuda:1")
    assert d.type == "cuda" and d.index == 1 and str(d) == "cuda:1" and d == "cuda:1"
    assert repr(d) == "device(type='cuda', index=1)" and _backend.as_device(0) == "cuda:0"
    assert _backend.CPU != "cuda" and hash(_backend.CPU) == hash("cpu")
    with pytest.raises(ValueError, match="Invalid device string"):
        _backend.as_device("cuda:x")
    with pytest.raises(ValueError, match="Expected one of cpu, cuda"):
        _backend.as_device("tpu")
    try:
        import cupy  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="needs cupy"):
            dt.zeros(2, device="cuda")


# -------------------------------------------------------------- distributed hand-off


def test_factories_with_a_mesh_call_the_distributed_factory(monkeypatch):
    from dtensor.distributed import factory as dfactory

    calls = []

    def fake(req, mesh, placements):
        calls.append((req, mesh, placements))
        return "dtensor"

    monkeypatch.setattr(dfactory, "distributed_factory", fake)
    mesh, pl = object(), ("S0",)
    assert dt.zeros(4, 2, device_mesh=mesh, placements=pl) == "dtensor"
    dt.full((3,), 2, device_mesh=mesh)
    dt.randint(5, (6,), device_mesh=mesh, placements=pl)
    dt.arange(1, 7, 2, device_mesh=mesh)
    dt.rand(2, 2, dtype=dt.float64, device_mesh=mesh, device="cpu")
    req, got_mesh, got_pl = calls[0]
    assert (req.name, req.size, req.dtype, req.device, req.values) == (
        "zeros", (4, 2), dt.float32, None, {}
    )
    assert got_mesh is mesh and got_pl == pl
    req, _, got_pl = calls[1]
    assert (req.name, req.size, req.dtype, req.values, got_pl) == (
        "full", (3,), dt.int64, {"fill_value": 2}, None
    )
    req = calls[2][0]
    assert (req.name, req.size, req.dtype, req.values) == (
        "randint", (6,), dt.int64, {"low": 0, "high": 5}
    )
    req = calls[3][0]
    assert (req.name, req.size, req.dtype, req.values) == (
        "arange", (3,), dt.int64, {"start": 1, "step": 2}
    )
    assert calls[4][0].dtype == dt.float64 and calls[4][0].device == "cpu"

    x = dt.distribute_tensor(np.zeros((5, 3), np.float32), dt.init_device_mesh((1,)),
                             [dt.Shard(0)])
    dt.ones_like(x)
    req, got_mesh, got_pl = calls[5]
    assert (req.name, req.size, req.dtype) == ("ones", (5, 3), dt.float32)
    assert got_mesh is x.device_mesh and got_pl == x.placements
    dt.zeros_like(x, placements=[dt.Replicate()])
    assert calls[6][2] == [dt.Replicate()]
    with pytest.raises(PlacementError, match="without device_mesh"):
        dt.zeros(2, placements=pl)


# ------------------------------------------------------------------------- random


def test_same_seed_same_values_and_the_offset_advances():
    dt.manual_seed(1234)
    a = dt.rand(3, 4)
    b = dt.rand(3, 4)
    dt.manual_seed(1234)
    a2 = dt.rand(3, 4)
    assert dt.initial_seed() == 1234
    np.testing.assert_array_equal(a.numpy(), a2.numpy())
    assert not np.array_equal(a.numpy(), b.numpy())
    dt.manual_seed(1234)
    flat = dt.rand(24)  # one draw of 24 covers the counters of the two draws of 12
    np.testing.assert_array_equal(flat.numpy()[:12], a.numpy().reshape(-1))
    np.testing.assert_array_equal(flat.numpy()[12:], b.numpy().reshape(-1))
    dt.manual_seed(1235)
    assert not np.array_equal(dt.rand(3, 4).numpy(), a.numpy())


def test_rng_state_round_trip():
    dt.manual_seed(7)
    dt.randn(5)
    state = dt.get_rng_state()
    assert state.dtype == dt.uint8 and state.shape == (16,)
    x = dt.randn(10)
    dt.set_rng_state(state)
    np.testing.assert_array_equal(dt.randn(10).numpy(), x.numpy())
    dt.set_rng_state(bytes(state.numpy()))
    np.testing.assert_array_equal(dt.randn(10).numpy(), x.numpy())
    with pytest.raises(ValueError, match="16-byte"):
        dt.set_rng_state(b"123")


def test_default_seed_is_a_constant():
    # every rank of an mpirun job must start from the same generator state
    assert _random.DEFAULT_SEED == 67280421310721


def test_random_values_ranges_and_distributions():
    dt.manual_seed(0)
    u = dt.rand(200_000, dtype=dt.float64).numpy()
    assert u.min() >= 0.0 and u.max() < 1.0 and abs(u.mean() - 0.5) < 0.005
    assert np.histogram(u, bins=10, range=(0, 1))[0].min() > 19_000
    h = dt.rand(100_000, dtype=dt.float16).numpy()
    assert h.dtype == np.float16 and h.max() < 1.0 and h.min() >= 0.0
    f = dt.rand(100_000).numpy()
    assert f.dtype == np.float32 and f.max() < 1.0
    n = dt.randn(200_000, dtype=dt.float64).numpy()
    assert abs(n.mean()) < 0.01 and abs(n.std() - 1.0) < 0.01
    assert abs((np.abs(n) < 1).mean() - 0.6827) < 0.005
    r = dt.randint(-3, 4, (50_000,)).numpy()
    assert r.dtype == np.int64 and set(np.unique(r)) == set(range(-3, 4))
    r2 = dt.randint(10, size=(3, 3))
    assert r2.shape == (3, 3) and r2.numpy().min() >= 0 and r2.numpy().max() < 10
    assert dt.randint(0, 5, (4,), dtype=dt.float32).dtype == dt.float32
    big = dt.randint(-(2**63), 2**63 - 1, (1000,)).numpy()
    assert big.min() < -(2**61) and big.max() > 2**61
    with pytest.raises(ValueError, match="from=5 >= to=5"):
        dt.randint(5, 5, (2,))
    with pytest.raises(DTypeError, match="floating-point"):
        dt.rand(2, dtype=dt.int32)


def test_normal_uses_two_streams():
    from dtensor.local.rng import _bits

    c = np.arange(1000, dtype=np.uint64)
    s0, s1 = _bits(c, 5, 0, np), _bits(c, 5, 1, np)
    assert not np.array_equal(s0, s1)
    assert abs(np.corrcoef(s0 >> np.uint64(11), s1 >> np.uint64(11))[0, 1]) < 0.1


@pytest.mark.parametrize(
    "kind,dtype",
    [
        ("uniform", np.float32),
        ("normal", np.float64),
        ("randint", np.int64),
        ("uniform", np.float16),
    ],
)
def test_random_block_equals_the_slice_of_the_full_tensor(kind, dtype):
    shape = (5, 7, 3)
    full = _random.random_block(kind, shape, (0, 0, 0), shape, dtype, 99, 1000, np, low=-4, high=9)
    assert full.shape == shape and full.dtype == dtype
    for starts, sizes in [
        ((1, 2, 0), (3, 4, 3)),
        ((4, 6, 2), (1, 1, 1)),
        ((0, 3, 1), (5, 0, 2)),
        ((2, 0, 0), (2, 7, 3)),
    ]:
        block = _random.random_block(
            kind, shape, starts, sizes, dtype, 99, 1000, np, low=-4, high=9
        )
        sl = tuple(slice(s, s + n) for s, n in zip(starts, sizes))
        np.testing.assert_array_equal(block, full[sl])


def test_factories_match_random_block_from_the_reserved_offset():
    dt.manual_seed(42)
    seed, offset = _random._reserve(0)
    t = dt.randn(4, 6, dtype=dt.float64)
    expected = _random.random_block("normal", (4, 6), (0, 0), (4, 6), np.float64, seed, offset, np)
    np.testing.assert_array_equal(t.numpy(), expected)
    assert _random._reserve(0) == (seed, offset + 24)
    s = dt.rand(())
    assert s.shape == () and 0 <= s.item() < 1


@pytest.mark.parametrize("make,op", [
    (lambda: dt.empty(2**62), "empty"),
    (lambda: dt.zeros(2**40, 2**30), "zeros"),
    (lambda: dt.full((2**31, 2**31), 1.0), "full"),
    (lambda: dt.rand(2**62, dtype=dt.float64), "rand"),
    (lambda: dt.empty(1 << 40), "empty"),  # 4 TiB: fits the address space, not the machine
    (lambda: dt.empty(2**62, device_mesh=dt.init_device_mesh((1,))), "dt.empty"),
])
def test_a_tensor_too_large_to_allocate_raises_naming_the_op(make, op):
    # numpy's "array is too big" ValueError (and a bare MemoryError) named no op
    from dtensor.errors import AllocationError

    with pytest.raises(AllocationError, match=rf"^{op}: cannot allocate a tensor of shape") as e:
        make()
    assert isinstance(e.value, MemoryError) and " bytes" in str(e.value)
