"""Ops on DTensors equal numpy on the global data, for many input placements.

Every op family (pointwise, reductions, matmul/einsum, views, tensor ops, nn, in-place)
runs on DTensors laid out by :func:`dtensor.testing.distribute_random` on a 1-D mesh of the
world and, at 4 ranks, a 2x2 mesh: a Partial input (sum, avg, max or min) holds random
contributions that differ from rank to rank, so an op that keeps the wrong Partial kind
gives wrong numbers. The ``full_tensor()`` of the result must equal numpy on the global
arrays, with the dtype of the same op on local Tensors. Test bodies are rank-independent in
control flow.
"""

from __future__ import annotations

import itertools
import warnings
import zlib

import numpy as np
import pytest
from helpers.mpi import meshes_dp_tp as meshes
from mpi4py import MPI

import dtensor as dt
from dtensor.testing import distribute_random
from placements.rules import Candidate, RuleResult

WORLD = MPI.COMM_WORLD
R, S, P = dt.Replicate(), dt.Shard, dt.Partial


def data(shape, dtype=np.float32, seed=0, positive=False):
    rng = np.random.default_rng(seed)
    if np.dtype(dtype) == np.bool_:
        return rng.random(shape) > 0.5
    if np.dtype(dtype).kind in "iu":
        return rng.integers(-9, 10, size=shape).astype(dtype)
    a = rng.standard_normal(shape) * 3
    return (np.abs(a) + 0.5 if positive else a).astype(dtype)


PARTIALS = [P("sum"), P("max"), P("min"), P("avg")]


def options(mesh, ndim, partial=True, limit=None, seed=0, dtype=np.float32):
    """Placement tuples for a tensor of ``ndim`` dims (of ``dtype``) on ``mesh``; on 2-D
    meshes a fixed sample of at most ``limit`` of them (the same on every rank). P(avg)
    only for floats: averaging integers has no exact result, and is refused."""
    kinds = PARTIALS if np.dtype(dtype).kind in "fc" else PARTIALS[:3]
    per_dim = [R] + [S(d) for d in range(ndim)] + (kinds if partial else [])
    combos = list(itertools.product(per_dim, repeat=mesh.ndim))
    if limit is not None and len(combos) > limit:
        keep = np.random.default_rng(seed).choice(len(combos), limit, replace=False)
        combos = [combos[i] for i in sorted(keep)]
    return combos


def dist(arr, mesh, placements):
    """``arr`` on ``mesh``; a Partial mesh dim holds random per-rank contributions, seeded by
    the data and the placements (so every rank draws the same split)."""
    seed = zlib.crc32(np.ascontiguousarray(arr).tobytes() + repr(tuple(placements)).encode())
    return distribute_random(arr, mesh, placements, seed=seed)


def full(x):
    assert isinstance(x, dt.DTensor), f"expected a DTensor, got {type(x).__name__}"
    return x.full_tensor().numpy()


def tol(dtype):
    return {"rtol": 1e-4, "atol": 1e-4} if np.dtype(dtype) == np.float32 else {"rtol": 1e-10}


def check(fn, np_fn, arrays, placements_list, msg=""):
    """``fn`` on DTensors equals ``np_fn`` on the globals and has the local op's dtype."""
    mesh = placements_list[0][0]
    dts = [dist(a, mesh, pl) for a, (_, pl) in zip(arrays, placements_list)]
    out = fn(*dts)
    local = fn(*[dt.from_numpy(a) for a in arrays])
    expected = np.asarray(np_fn(*arrays))
    got = full(out)
    where = f"{msg} on mesh {mesh.shape} with {[pl for _, pl in placements_list]}"
    assert out.shape == expected.shape, where
    assert got.dtype == local.dtype, where
    if got.dtype.kind in "biu":
        ok = got.shape == expected.shape and np.array_equal(got, expected)
    else:
        ok = np.allclose(got, expected, **tol(got.dtype))
    if WORLD.allreduce(not ok, op=MPI.LOR):  # every rank takes part in the diagnosis
        where += "\n" + diagnose(fn, dts, out, expected)
    if got.dtype.kind in "biu":
        np.testing.assert_array_equal(got, expected, err_msg=where)
    else:
        np.testing.assert_allclose(got, expected, **tol(got.dtype), err_msg=where)
    return out


def diagnose(fn, dts, out, expected):
    """What every rank held when a check failed (collective): NaN in its local inputs and
    output, the output's placements, and whether running the op again gives the expected
    value (a transient fault) or not."""
    def nan(x):
        a = x.to_local().numpy()
        return bool(a.dtype.kind in "fc" and np.isnan(a).any())

    again = fn(*dts)
    mine = {
        "rank": WORLD.rank,
        "inputs_nan": [nan(x) for x in dts],
        "local_shapes": [tuple(x.to_local().shape) for x in dts],
        "out_placements": out.placements,
        "out_local_shape": tuple(out.to_local().shape),
        "out_local_nan": nan(out),
        "rerun_ok": bool(np.allclose(full(again), expected, rtol=1e-4, atol=1e-4)),
    }
    return "diagnosis per rank:\n" + "\n".join(map(str, WORLD.allgather(mine)))


def for_each_unary(fn, np_fn, shape, msg, partial=True, limit=12, arr=None):
    arr = data(shape) if arr is None else arr
    for mesh in meshes():
        for pl in options(mesh, len(shape), partial, limit, dtype=arr.dtype):
            check(fn, np_fn, [arr], [(mesh, pl)], msg)


def for_each_binary(fn, np_fn, a, b, msg, partial=True, limit=24):
    for mesh in meshes():
        pa = options(mesh, a.ndim, partial, dtype=a.dtype)
        pb = options(mesh, b.ndim, partial, dtype=b.dtype)
        pairs = list(itertools.product(pa, pb))
        if mesh.ndim > 1:
            keep = np.random.default_rng(1).choice(len(pairs), limit, replace=False)
            pairs = [pairs[i] for i in sorted(keep)]
        for pla, plb in pairs:
            check(fn, np_fn, [a, b], [(mesh, pla), (mesh, plb)], msg)


SHAPES = [(8, 6), (5, 3)]  # even and uneven (on 2, 3 and 4 ranks)


# -- pointwise ---------------------------------------------------------------------------------
UNARY = [
    ("relu", lambda x: x.relu(), lambda a: np.maximum(a, 0)),
    ("neg", lambda x: -x, np.negative),
    ("abs", abs, np.abs),
    ("exp", dt.exp, np.exp),
    ("tanh", dt.tanh, np.tanh),
    ("sigmoid", dt.sigmoid, lambda a: 1 / (1 + np.exp(-a))),
    ("square", dt.square, np.square),
    ("floor", dt.floor, np.floor),
]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name,fn,np_fn", UNARY, ids=[u[0] for u in UNARY])
def test_unary(name, fn, np_fn, shape):
    for_each_unary(fn, np_fn, shape, name)


@pytest.mark.mpi(min_size=1)
def test_unary_on_positive_domain():
    arr = data((5, 3), positive=True)
    for_each_unary(dt.sqrt, np.sqrt, (5, 3), "sqrt", arr=arr)
    for_each_unary(dt.log, np.log, (5, 3), "log", arr=arr)
    for_each_unary(dt.rsqrt, lambda a: 1 / np.sqrt(a), (5, 3), "rsqrt", arr=arr)


BINARY = [
    ("add", lambda x, y: x + y, np.add),
    ("sub", lambda x, y: x - y, np.subtract),
    ("mul", lambda x, y: x * y, np.multiply),
    ("div", lambda x, y: x / y, np.divide),
    ("maximum", dt.maximum, np.maximum),
    ("add-alpha", lambda x, y: dt.add(x, y, alpha=2), lambda a, b: a + 2 * b),
    ("lt", lambda x, y: x < y, np.less),
    ("eq", lambda x, y: x == y, np.equal),
]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name,fn,np_fn", BINARY, ids=[b[0] for b in BINARY])
def test_binary_same_shape(name, fn, np_fn):
    a, b = data((5, 6)), data((5, 6), seed=1, positive=True)
    for_each_binary(fn, np_fn, a, b, name)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name,fn,np_fn", BINARY[:4], ids=[b[0] for b in BINARY[:4]])
def test_binary_broadcasting(name, fn, np_fn):
    a, row, col = data((6, 5)), data((5,), seed=1, positive=True), data((6, 1), seed=2)
    for_each_binary(fn, np_fn, a, row, name + " (6,5)x(5,)")
    for_each_binary(fn, np_fn, col, a, name + " (6,1)x(6,5)", limit=12)


SCALAR_OPS = [
    ("x+2.5", lambda x: x + 2.5, lambda a: a + np.float32(2.5)),
    ("2.5+x", lambda x: 2.5 + x, lambda a: np.float32(2.5) + a),
    ("x-3", lambda x: x - 3, lambda a: a - np.float32(3)),
    ("3-x", lambda x: 3 - x, lambda a: np.float32(3) - a),
    ("x*2", lambda x: x * 2, lambda a: a * np.float32(2)),
    ("x/4", lambda x: x / 4.0, lambda a: a / np.float32(4)),
    ("1/x", lambda x: 1.0 / x, lambda a: np.float32(1) / a),
    ("x**2", lambda x: x**2, lambda a: a**2),
    ("2**x", lambda x: 2.0**x, lambda a: np.float32(2) ** a),
    ("x>0", lambda x: x > 0, lambda a: a > 0),
    ("clamp", lambda x: dt.clamp(x, -1.0, 2.0), lambda a: np.clip(a, -1, 2)),
]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name,fn,np_fn", SCALAR_OPS, ids=[s[0] for s in SCALAR_OPS])
def test_python_scalars_both_sides(name, fn, np_fn):
    for_each_unary(fn, np_fn, (5, 3), name, arr=data((5, 3), seed=3, positive=True))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", ["uint8", "int8", "int32", "int64"])
def test_a_python_int_out_of_the_dtype_range_wraps(dtype):
    # as on local tensors and in PyTorch, the int wraps like a C cast (uint8: -1 is 255),
    # whatever the shard size: (6, 5) shards take the short path (a raw ufunc on the
    # compiled front's hits), (2, 4096) ones and 0-d tensors the kernels' slow path
    ops = {"lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal,
           "eq": np.equal, "ne": np.not_equal, "add": np.add, "sub": np.subtract,
           "mul": np.multiply}
    for mesh in meshes():
        for shape in [(), (6, 5), (2, 4096)]:
            a = np.asarray(data(shape, np.int64, seed=7) % 5).astype(dtype)
            for pl in [(R,) * mesh.ndim, (S(0),) + (R,) * (mesh.ndim - 1)][: 1 + bool(shape)]:
                x = dt.distribute_tensor(a, mesh, list(pl))
                for value in (-1, 200, 256, 300, 2**31 + 5):
                    w = np.asarray(value).astype(dtype)
                    for name, np_op in ops.items():
                        for _ in range(2):  # a propagation-cache miss, then a hit
                            got = getattr(dt, name)(x, value).full_tensor().numpy()
                            np.testing.assert_array_equal(got, np_op(a, w), f"{name} {value}")
                            got = getattr(dt, name)(value, x).full_tensor().numpy()
                            np.testing.assert_array_equal(got, np_op(w, a), f"{name} {value}")
                    np.testing.assert_array_equal((x < value).full_tensor().numpy(), a < w)
                    np.testing.assert_array_equal((value < x).full_tensor().numpy(), w < a)


def fp_error_cases(make):
    """Calls whose numpy computation raises a floating-point error (overflow, division by
    zero, invalid), on DTensors made by ``make`` from global arrays: name -> call."""
    h = make(np.full((8,), 60000, np.float16))
    big, huge = make(np.full((8, 8), 100.0, np.float32)), make(np.full((8, 8), 3e38, np.float32))
    one, zero = make(np.ones((8, 8), np.float32)), make(np.zeros((8, 8), np.float32))
    neg = make(-np.ones((8, 8), np.float32))
    return {
        "float16 sum": lambda: h.sum(), "exp": lambda: big.exp(),
        "dt.exp": lambda: dt.exp(big), "mul": lambda: huge * huge,
        "mul scalar": lambda: huge * 10.0, "x / 0": lambda: one / 0,
        "x / zeros": lambda: one / zero, "0 / 0": lambda: zero / zero,
        "log(-1)": lambda: neg.log(), "sqrt(-1)": lambda: neg.sqrt(),
        "mean": lambda: huge.mean(), "matmul": lambda: huge @ huge.T,
        "softmax": lambda: dt.softmax(neg * np.inf, 1),
    }


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("shard", [False, True], ids=["R", "S0"])
def test_floating_point_errors_never_warn(shard):
    # PyTorch gives inf/nan silently; numpy's RuntimeWarnings must not reach the caller on
    # any path (the compiled front's raw forms and kernels, the Python dispatcher), even
    # when it turns every warning into an error
    for mesh in meshes():
        pl = [S(0) if shard else R] + [R] * (mesh.ndim - 1)
        cases = fp_error_cases(lambda a, mesh=mesh, pl=pl: dt.distribute_tensor(a, mesh, pl))
        before = np.geterr()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for name, fn in cases.items():
                for _ in range(3):  # a propagation-cache miss, then hits
                    got = fn().full_tensor().numpy()
                assert not np.isfinite(got).all(), name
            assert np.geterr() == before
            with pytest.raises(RuntimeWarning, match="divide by zero"):
                np.ones(2) / np.zeros(2)  # the caller's own numpy code still warns


@pytest.mark.mpi(min_size=1)
def test_overflowing_partial_sums_and_casts_never_warn():
    # a float16 Partial(sum) reduced over shared memory (2 MiB: the ranks add each other's
    # blocks with numpy) or over MPI (16 B), and casts of DTensors, overflow to inf
    # silently, as in PyTorch
    from redistribute import shm

    mesh = dt.init_device_mesh((MPI.COMM_WORLD.size,))
    n = MPI.COMM_WORLD.size
    want = np.float16(np.inf if n > 1 else 60000)  # 60000 + 60000 overflows float16
    for size in (8, 1 << 20):
        part = dt.full((size,), 60000.0, dtype=np.float16)  # pooled: in shared memory
        before = dict(shm.counts)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for src, dst in (("sum", R), ("sum", S(0)), ("avg", R)):
                x = dt.DTensor.from_local(part, mesh, [dt.Partial(src)])
                got = x.redistribute(mesh, [dst]).full_tensor().numpy()
                assert got.dtype == np.float16
                np.testing.assert_array_equal(got, want, err_msg=f"{src}->{dst}")
            big = dt.distribute_tensor(np.full((4 * n,), 1e10, np.float32), mesh, [S(0)])
            assert np.isinf(big.to(np.float16).full_tensor().numpy()).all()
            assert np.isinf(big.half().full_tensor().numpy()).all()
        if size > 1 << 19 and n > 1 and shm.enabled():
            assert shm.counts.get("all_reduce", 0) > before.get("all_reduce", 0)


@pytest.mark.mpi(min_size=1)
def test_a_registered_kernel_keeps_its_own_numpy_warnings():
    # dtensor's kernels run quietly; a user's kernel (register_op) is the user's numpy code
    def rule(schema):
        a = schema.args[0]
        return RuleResult((a.shape,), (a.dtype,), (Candidate((R, R)),))

    f = dt.register_op("test_ops_halve_by_zero", lambda x: dt.from_numpy(x.numpy() / 0.0), rule)
    x = dt.distribute_tensor(np.ones(3, np.float32), meshes()[0], [R])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):  # a propagation-cache miss, then a hit
            with pytest.raises(RuntimeWarning, match="divide by zero"):
                f(x)


@pytest.mark.mpi(min_size=1)
def test_integer_and_bool_pointwise():
    ai, bi = data((5, 4), np.int64), data((5, 4), np.int64, seed=1)
    for_each_binary(lambda x, y: x + y, np.add, ai, bi, "int add", partial=False)
    for_each_binary(lambda x, y: x // 3 + y, lambda a, b: a // 3 + b, ai, bi, "int //")
    for_each_unary(lambda x: x * 2.5, lambda a: (a * 2.5).astype(np.float32), (5, 4),
                   "int * float", arr=ai)
    ab, bb = data((5, 4), np.bool_), data((5, 4), np.bool_, seed=1)
    for_each_binary(dt.logical_and, np.logical_and, ab, bb, "logical_and", partial=False)


@pytest.mark.mpi(min_size=1)
def test_where():
    cond = data((5, 6), np.bool_)
    a, b = data((5, 6), seed=1), data((6,), seed=2)
    for mesh in meshes():
        for pc, pa in itertools.product(options(mesh, 2, False, 6), options(mesh, 2, True, 6)):
            for pb in options(mesh, 1, True, 3):
                check(dt.where, np.where, [cond, a, b], [(mesh, pc), (mesh, pa), (mesh, pb)],
                      "where")


# -- reductions --------------------------------------------------------------------------------
REDUCTIONS = [
    ("sum", lambda x: x.sum(), lambda a: a.sum()),
    ("sum0", lambda x: x.sum(dim=0), lambda a: a.sum(0)),
    ("sum1k", lambda x: x.sum(dim=1, keepdim=True), lambda a: a.sum(1, keepdims=True)),
    ("sum01", lambda x: dt.sum(x, (0, 1)), lambda a: a.sum((0, 1))),
    ("mean", lambda x: x.mean(), lambda a: a.mean()),
    ("mean0", lambda x: x.mean(dim=0), lambda a: a.mean(0)),
    ("mean-1k", lambda x: x.mean(-1, keepdim=True), lambda a: a.mean(-1, keepdims=True)),
    ("amax1", lambda x: x.amax(dim=1), lambda a: a.max(1)),
    ("amin0", lambda x: dt.amin(x, 0), lambda a: a.min(0)),
    ("max", lambda x: x.max(), lambda a: a.max()),
    ("argmax1", lambda x: x.argmax(dim=1), lambda a: a.argmax(1)),
    ("prod0", lambda x: x.prod(dim=0), lambda a: a.prod(0)),
    ("var1", lambda x: x.var(dim=1), lambda a: a.var(1, ddof=1)),
    ("std", lambda x: x.std(), lambda a: a.std(ddof=1)),
    ("logsumexp1", lambda x: dt.logsumexp(x, 1), lambda a: np.log(np.exp(a).sum(1))),
    ("cumsum0", lambda x: x.cumsum(0), lambda a: a.cumsum(0)),
    ("norm", lambda x: x.norm(), lambda a: np.sqrt((a * a).sum())),
]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name,fn,np_fn", REDUCTIONS, ids=[r[0] for r in REDUCTIONS])
def test_reductions(name, fn, np_fn, shape):
    for_each_unary(fn, np_fn, shape, name)


@pytest.mark.mpi(min_size=1)
def test_max_with_dim_returns_values_and_indices():
    arr = data((5, 6))
    for mesh in meshes():
        for pl in options(mesh, 2, True, 10):
            out = dist(arr, mesh, pl).max(dim=0)
            assert isinstance(out.values, dt.DTensor) and isinstance(out.indices, dt.DTensor)
            values, indices = out
            np.testing.assert_allclose(full(values), arr.max(0), **tol(arr.dtype))
            np.testing.assert_array_equal(full(indices), arr.argmax(0))


@pytest.mark.mpi(min_size=1)
def test_bool_reductions():
    arr = data((5, 4), np.bool_)
    for_each_unary(lambda x: x.any(dim=1), lambda a: a.any(1), (5, 4), "any", False, arr=arr)
    for_each_unary(lambda x: x.all(), lambda a: a.all(), (5, 4), "all", False, arr=arr)
    for_each_unary(lambda x: x.sum(dim=0), lambda a: a.sum(0), (5, 4), "bool sum", False,
                   arr=arr)


# -- matmul / einsum ---------------------------------------------------------------------------
@pytest.mark.mpi(min_size=1)
def test_matmul_2d():
    a, b = data((7, 6)), data((6, 5), seed=1)
    for_each_binary(lambda x, y: x @ y, np.matmul, a, b, "matmul", limit=30)
    for_each_binary(dt.mm, np.matmul, a, b, "mm", partial=False, limit=10)


@pytest.mark.mpi(min_size=1)
def test_matmul_batched_and_vectors():
    a, b = data((3, 5, 4)), data((3, 4, 6), seed=1)
    for_each_binary(dt.bmm, np.matmul, a, b, "bmm", partial=False, limit=16)
    w = data((4, 2), seed=2)
    for_each_binary(dt.matmul, np.matmul, a, w, "batched @ 2-D", partial=False, limit=16)
    v, m = data((6,), seed=3), data((6, 4), seed=4)
    for_each_binary(dt.matmul, np.matmul, v, m, "vector @ matrix", limit=12)
    for_each_binary(dt.dot, np.dot, v, data((6,), seed=5), "dot", limit=12)
    for_each_binary(dt.outer, np.outer, v, data((4,), seed=5), "outer", limit=12)


@pytest.mark.mpi(min_size=1)
def test_einsum():
    a, b = data((4, 5, 6)), data((4, 6, 3), seed=1)
    for_each_binary(lambda x, y: dt.einsum("bij,bjk->bik", x, y),
                    lambda p, q: np.einsum("bij,bjk->bik", p, q), a, b, "einsum bmm", limit=16)
    c = data((5, 6), seed=2)
    for_each_binary(lambda x, y: dt.einsum("ij,kj->ik", x, y),
                    lambda p, q: np.einsum("ij,kj->ik", p, q), c, data((3, 6), seed=3),
                    "einsum ij,kj", limit=16)
    for_each_unary(lambda x: dt.einsum("ij->j", x), lambda p: p.sum(0), (5, 6), "einsum sum",
                   arr=c)


@pytest.mark.mpi(min_size=1)
def test_linear_and_addmm():
    x, w, bias = data((6, 5)), data((4, 5), seed=1), data((4,), seed=2)
    for mesh in meshes():
        for px, pw in itertools.product(options(mesh, 2, True, 5), options(mesh, 2, False, 4)):
            for pb in options(mesh, 1, False, 2):
                check(dt.linear, lambda p, q, r: p @ q.T + r, [x, w, bias],
                      [(mesh, px), (mesh, pw), (mesh, pb)], "linear")
    m1, m2 = data((6, 5), seed=3), data((5, 4), seed=4)
    c = data((6, 4), seed=5)
    for mesh in meshes():
        opts = options(mesh, 2, False, 4)
        for pls in itertools.islice(itertools.product(opts, opts, opts), 0, None, 7):
            check(lambda i, p, q: dt.addmm(i, p, q, beta=0.5, alpha=2.0),
                  lambda i, p, q: 0.5 * i + 2.0 * (p @ q), [c, m1, m2],
                  [(mesh, pl) for pl in pls], "addmm")


# -- views -------------------------------------------------------------------------------------
VIEWS = [
    ("view-1", lambda x: x.view(-1), lambda a: a.reshape(-1)),
    ("view(3,-1)", lambda x: x.view(3, -1), lambda a: a.reshape(3, -1)),
    ("reshape", lambda x: x.reshape((2, 3, 5)), lambda a: a.reshape(2, 3, 5)),
    ("transpose", lambda x: x.transpose(0, 1), lambda a: a.T),
    ("t", lambda x: x.t(), lambda a: a.T),
    ("T", lambda x: x.T, lambda a: a.T),
    ("permute", lambda x: x.permute(1, 0), lambda a: a.transpose(1, 0)),
    ("unsqueeze", lambda x: x.unsqueeze(1), lambda a: a[:, None]),
    ("flatten", lambda x: x.unsqueeze(0).flatten(), lambda a: a.reshape(-1)),
    ("getitem-slice", lambda x: x[1:5], lambda a: a[1:5]),
    ("getitem-step", lambda x: x[:, ::2], lambda a: a[:, ::2]),
    ("getitem-int", lambda x: x[2], lambda a: a[2]),
    ("narrow", lambda x: x.narrow(1, 1, 3), lambda a: a[:, 1:4]),
    ("contiguous", lambda x: x.t().contiguous(), lambda a: np.ascontiguousarray(a.T)),
]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name,fn,np_fn", VIEWS, ids=[v[0] for v in VIEWS])
def test_views(name, fn, np_fn):
    for_each_unary(fn, np_fn, (6, 5), name)


@pytest.mark.mpi(min_size=1)
def test_split_chunk_unbind():
    arr = data((7, 4))
    for mesh in meshes():
        for pl in options(mesh, 2, True, 8):
            x = dist(arr, mesh, pl)
            parts = x.split(3, dim=0)
            assert len(parts) == 3
            for got, want in zip(parts, np.split(arr, [3, 6])):
                np.testing.assert_allclose(full(got), want, **tol(arr.dtype))
            for got, want in zip(x.chunk(2, dim=1), np.split(arr, 2, axis=1)):
                np.testing.assert_allclose(full(got), want, **tol(arr.dtype))


# -- tensor ops --------------------------------------------------------------------------------
def sample_pairs(first, second, rng, limit):
    """The pairs of ``first`` x ``second``, or ``limit`` of them drawn with ``rng`` (the
    test's: the same on every rank, another sample in each session)."""
    pairs = list(itertools.product(first, second))
    if len(pairs) <= limit:
        return pairs
    return [pairs[i] for i in sorted(rng.choice(len(pairs), limit, replace=False))]


@pytest.mark.mpi(min_size=1)
def test_cat_and_stack(rng):
    a, b, a2 = data((5, 3)), data((2, 3), seed=1), data((5, 3), seed=2)
    for mesh in meshes():
        # 49 pairs on a 1-D mesh, 2,401 on the 2x2 one: a sample of each
        for pa, pb in sample_pairs(options(mesh, 2), options(mesh, 2), rng, 40):
            check(lambda x, y: dt.cat([x, y]), lambda p, q: np.concatenate([p, q]), [a, b],
                  [(mesh, pa), (mesh, pb)], "cat dim 0")
            check(lambda x, y: dt.stack([x, y], dim=1), lambda p, q: np.stack([p, q], 1),
                  [a, a2], [(mesh, pa), (mesh, pb)], "stack dim 1")


@pytest.mark.mpi(min_size=1)
def test_tensor_ops():
    shape = (6, 5)
    for_each_unary(lambda x: x.clone(), lambda a: a.copy(), shape, "clone")
    for_each_unary(lambda x: dt.tril(x), np.tril, shape, "tril")
    for_each_unary(lambda x: x.flip(0), lambda a: a[::-1], shape, "flip")
    for_each_unary(lambda x: dt.roll(x, 2, 1), lambda a: np.roll(a, 2, 1), shape, "roll")


# -- nn ----------------------------------------------------------------------------------------
def np_softmax(a, axis):
    e = np.exp(a - a.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


NN_UNARY = [
    ("softmax-1", lambda x: x.softmax(-1), lambda a: np_softmax(a, -1)),
    ("softmax0", lambda x: dt.softmax(x, 0), lambda a: np_softmax(a, 0)),
    ("log_softmax", lambda x: dt.log_softmax(x, 1), lambda a: np.log(np_softmax(a, 1))),
    ("gelu-tanh", lambda x: dt.gelu(x, approximate="tanh"),
     lambda a: 0.5 * a * (1 + np.tanh(np.sqrt(2 / np.pi) * (a + 0.044715 * a**3)))),
    ("silu", dt.silu, lambda a: a / (1 + np.exp(-a))),
    ("layer_norm", lambda x: dt.layer_norm(x, (5,)),
     lambda a: (a - a.mean(-1, keepdims=True)) / np.sqrt(a.var(-1, keepdims=True) + 1e-5)),
]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name,fn,np_fn", NN_UNARY, ids=[n[0] for n in NN_UNARY])
def test_nn_unary(name, fn, np_fn):
    for_each_unary(fn, np_fn, (6, 5), name)


@pytest.mark.mpi(min_size=1)
def test_layer_norm_with_affine():
    x, w, b = data((6, 5)), data((5,), seed=1), data((5,), seed=2)

    def np_ln(a, g, h):
        return (a - a.mean(-1, keepdims=True)) / np.sqrt(a.var(-1, keepdims=True) + 1e-5) * g + h

    for mesh in meshes():
        for px in options(mesh, 2, True, 8):
            for pw in options(mesh, 1, False, 2):
                check(lambda p, q, r: dt.layer_norm(p, (5,), q, r), np_ln, [x, w, b],
                      [(mesh, px), (mesh, pw), (mesh, pw)], "layer_norm affine")


@pytest.mark.mpi(min_size=1)
def test_embedding_with_row_sharded_weight():
    idx = np.array([[0, 3, 9], [8, 1, 3]], dtype=np.int64)
    weight = data((10, 4))
    for mesh in meshes():
        for pi, pw in itertools.product(options(mesh, 2, False, 6), options(mesh, 2, False, 6)):
            check(dt.embedding, lambda i, w: w[i], [idx, weight], [(mesh, pi), (mesh, pw)],
                  "embedding")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_and_mse(reduction):
    logits, target = data((7, 5)), np.array([0, 4, 2, 2, 1, 3, 0], dtype=np.int64)

    def np_ce(lg, t):
        ls = np.log(np_softmax(lg, 1))
        losses = -ls[np.arange(len(t)), t]
        return {"mean": losses.mean(), "sum": losses.sum(), "none": losses}[reduction]

    for mesh in meshes():
        for pl, pt in itertools.product(options(mesh, 2, True, 6), options(mesh, 1, False, 3)):
            check(lambda lg, t: dt.cross_entropy(lg, t, reduction=reduction), np_ce,
                  [logits, target], [(mesh, pl), (mesh, pt)], f"cross_entropy {reduction}")
    a, b = data((5, 4)), data((5, 4), seed=1)
    for_each_binary(lambda x, y: dt.mse_loss(x, y), lambda p, q: ((p - q) ** 2).mean(), a, b,
                    "mse_loss", limit=12)


# -- in-place ----------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=1)
def test_inplace_ops_write_the_shards(rng):
    a, b = data((6, 5)), data((6, 5), seed=1)
    for mesh in meshes():
        # self keeps its placements: no Partial(max/min) self (x * 2 keeps sum and avg only)
        selves = [
            pl for pl in options(mesh, 2)
            if not any(p.is_partial("max") or p.is_partial("min") for p in pl)
        ]
        for pa, pb in sample_pairs(selves, options(mesh, 2), rng, 40):
            x = dist(a.copy(), mesh, pa)
            y = dist(b, mesh, pb)
            local = x.to_local()
            x += y
            x.mul_(2.0)
            x.sub_(1.0)
            assert x.placements == pa and x.to_local() is local
            np.testing.assert_allclose(full(x), (a + b) * 2 - 1, rtol=1e-5, atol=1e-5,
                                       err_msg=f"{pa} += {pb}")
        for pa in options(mesh, 2, partial=False, limit=10):
            x = dist(a.copy(), mesh, pa)
            x.relu_()
            np.testing.assert_allclose(full(x), np.maximum(a, 0))


@pytest.mark.mpi(min_size=1)
def test_inplace_that_would_change_placements_raises_before_writing():
    a = data((6, 5))
    for mesh in meshes():
        pl = (P("sum"),) * mesh.ndim
        x = dist(a.copy(), mesh, pl)
        before = x.to_local().numpy().copy()
        with pytest.raises(dt.errors.ShardingError, match="relu_"):
            x.relu_()  # relu of a sum-partial needs the sum: it cannot stay Partial(sum)
        np.testing.assert_array_equal(x.to_local().numpy(), before)
        np.testing.assert_allclose(full(x), a, rtol=1e-6)


# -- regressions -------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
def test_neg_of_partial_max_is_partial_min():
    arr = np.array([[4.0, -3.0], [5.0, -7.0]], np.float32)
    for mesh in meshes():
        x = dist(arr, mesh, (P("max"),) * mesh.ndim)
        held = WORLD.allgather(x.to_local().numpy())
        assert any(not np.array_equal(h, held[0]) for h in held), "degenerate Partial input"
        y = -x
        assert y.placements == (P("min"),) * mesh.ndim, y.placements
        np.testing.assert_array_equal(full(y), -arr)


@pytest.mark.mpi(min_size=2)
def test_relu_of_partial_sum_reduces_first():
    arr = data((5, 3))
    for mesh in meshes():
        x = dist(arr, mesh, (P("sum"),) * mesh.ndim)
        y = x.relu()
        assert not any(p.is_partial() for p in y.placements), y.placements
        np.testing.assert_allclose(full(y), np.maximum(arr, 0), **tol(arr.dtype))


@pytest.mark.mpi(min_size=1)
def test_partial_sum_plus_scalar_adds_it_once():
    arr = data((5, 3))
    for mesh in meshes():
        pl = (P("sum"),) * mesh.ndim
        x = dist(arr, mesh, pl)
        y = x + 10.0
        assert y.placements == pl  # no hidden all-reduce
        np.testing.assert_allclose(full(y), arr + 10, rtol=1e-6)
        np.testing.assert_allclose(full(10.0 - x), 10 - arr, rtol=1e-6)
        np.testing.assert_allclose(full(x * 3 + 1), arr * 3 + 1, rtol=1e-5)


@pytest.mark.mpi(min_size=1)
def test_mean_over_uneven_shards():
    n = 2 * WORLD.size + 1
    arr = data((n, 3))
    for mesh in meshes():
        for pl in options(mesh, 2, partial=False):
            x = dist(arr, mesh, pl)
            np.testing.assert_allclose(full(x.mean()), arr.mean(), rtol=1e-5)
            np.testing.assert_allclose(full(x.mean(dim=0)), arr.mean(0), rtol=1e-5)


@pytest.mark.mpi(min_size=1)
def test_view_flat_of_uneven_shards():
    for shape in [(5, 3), (2 * WORLD.size + 1, 4), (3, 7)]:
        arr = data(shape)
        for mesh in meshes():
            for pl in options(mesh, 2):
                x = dist(arr, mesh, pl)
                np.testing.assert_allclose(full(x.view(-1)), arr.reshape(-1), **tol(arr.dtype))
                np.testing.assert_allclose(
                    full(x.reshape(-1, 1)), arr.reshape(-1, 1), **tol(arr.dtype)
                )


@pytest.mark.mpi(min_size=4)
def test_two_dim_uneven_shards():
    mesh = dt.init_device_mesh((2, 2))
    a, b = data((5, 3)), data((3, 7), seed=1)
    for pla, plb in [
        ((S(0), S(1)), (S(0), S(1))),
        ((S(0), S(0)), (R, S(1))),
        ((S(1), S(0)), (S(0), R)),
        ((S(0), S(1)), (S(1), S(0))),
    ]:
        check(lambda x, y: x @ y, np.matmul, [a, b], [(mesh, pla), (mesh, plb)], "2-D uneven @")
        check(lambda x: (x * 2).sum(dim=1), lambda p: (p * 2).sum(1), [a], [(mesh, pla)],
              "2-D uneven sum")
        check(lambda x: x.view(-1), lambda p: p.reshape(-1), [a], [(mesh, pla)], "2-D view")
        check(lambda x: x + x.T.T, lambda p: p + p, [a], [(mesh, pla)], "2-D add")


@pytest.mark.mpi(min_size=1)
def test_dispatching_functions_keep_local_behaviour():
    a = dt.from_numpy(data((4, 3)))
    out = dt.add(a, a, alpha=2)
    assert type(out) is dt.Tensor
    np.testing.assert_allclose(out.numpy(), data((4, 3)) * 3)
    assert type(dt.sum(a, dim=0)) is dt.Tensor
    assert type(dt.cat([a, a])) is dt.Tensor
