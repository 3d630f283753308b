"""Fuzzing DTensor programs against numpy under MPI (hypothesis).

Hypothesis draws a mesh (1-D over the world; also 2x2 and 2x1x2 at 4 ranks, 2x4 and
2x2x2 at 8 ranks), a global shape of up to
3 dims with sizes 0..5 (so shards are even, uneven and empty), a dtype, source placements
(Shard, Replicate, Partial sum/max/avg) and a short program of ops: unary and scalar
pointwise ops, binary ops with a broadcast operand of its own placements, reductions,
softmax, matmul, views (transpose, reshape, unsqueeze, narrow) and redistributes. Every rank runs the same program
(the MPI profile derandomizes hypothesis) on DTensors and compares the global result with
numpy on the same data. The program runs under the SPMD check, so a divergence between
ranks shows as an error instead of a hang, and each example's verdict is agreed by all
ranks, so all of them fail (and shrink) together.

Examples per test: ``DTENSOR_FUZZ_EXAMPLES`` if set, else 1000 under
``HYPOTHESIS_PROFILE=long`` (which also allows longer programs) and 150 otherwise (CI).
``DTENSOR_FUZZ_SEED=<int>`` draws another set of examples. The long run::

    HYPOTHESIS_PROFILE=long timeout 3600 mpiexec -n 4 python -m pytest tests/mpi/test_fuzz.py \
        --with-mpi -q
"""

from __future__ import annotations

import os
import traceback

import numpy as np
import pytest
from hypothesis import given, seed, settings
from hypothesis import strategies as st
from mpi4py import MPI

import dtensor as dt
from dtensor.debug._spmd import check_spmd

WORLD = MPI.COMM_WORLD
R, S, P = dt.Replicate(), dt.Shard, dt.Partial

_LONG = os.environ.get("HYPOTHESIS_PROFILE") == "long"
EXAMPLES = int(os.environ.get("DTENSOR_FUZZ_EXAMPLES", "1000" if _LONG else "150"))
MAX_STEPS = 6 if _LONG else 4
# another set of examples (the same on every rank): DTENSOR_FUZZ_SEED=<int>
_SEED = os.environ.get("DTENSOR_FUZZ_SEED")

DTYPES = {"float64": np.float64, "float32": np.float32, "int64": np.int64}
TOL = {"float64": 1e-9, "float32": 2e-5, "int64": 0}

_meshes: dict[tuple, dt.DeviceMesh] = {}


def mesh_shapes() -> list[tuple[int, ...]]:
    shapes = [(WORLD.size,)]
    if WORLD.size == 4:
        shapes += [(2, 2), (2, 1, 2)]  # 3-D: placements over three mesh dims
    if WORLD.size == 8:  # launched by tests/unit/test_examples.py
        shapes += [(2, 4), (2, 2, 2)]
    return shapes


def get_mesh(shape: tuple[int, ...]) -> dt.DeviceMesh:
    # created on first use, in the same order on every rank (examples are identical)
    if shape not in _meshes:
        _meshes[shape] = dt.init_device_mesh(shape)
    return _meshes[shape]


# -- strategies ---------------------------------------------------------------------------


def placements_for(draw, ndim: int, mesh_ndim: int, partials: tuple = ()) -> tuple:
    choices = [R] + [S(d) for d in range(ndim)] + [P(op) for op in partials]
    return tuple(draw(st.sampled_from(choices)) for _ in range(mesh_ndim))


def sub_shape(draw, shape: tuple) -> tuple:
    """A shape that broadcasts against ``shape`` (trailing dims, some set to 1)."""
    keep = draw(st.integers(0, len(shape)))
    tail = shape[len(shape) - keep :]
    return tuple(1 if draw(st.booleans()) else n for n in tail)


@st.composite
def programs(draw):
    mesh_shape = draw(st.sampled_from(mesh_shapes()))
    m = len(mesh_shape)
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.integers(0, 5)) for _ in range(ndim))
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    is_float = dtype != "int64"
    # Partial kinds a global value can be placed as (avg needs a floating dtype)
    partials = ("sum", "max", "avg") if is_float else ("sum", "max")
    src = placements_for(draw, ndim, m, partials)
    steps = []
    cur = shape
    for _ in range(draw(st.integers(1, MAX_STEPS))):
        nd = len(cur)
        kinds = ["unary", "scalar", "binary", "redistribute", "reduce"]
        if nd >= 1:
            kinds += ["matmul", "reshape", "narrow"]
        if nd >= 2:
            kinds.append("transpose")
        if nd < 3:
            kinds.append("unsqueeze")
        if is_float and nd >= 1:
            kinds.append("softmax")
        kind = draw(st.sampled_from(kinds))
        if kind == "unary":
            fns = ["neg", "abs", "relu"] + (["tanh", "exp"] if is_float else [])
            steps.append(("unary", draw(st.sampled_from(fns))))
        elif kind == "scalar":
            value = draw(st.sampled_from([-2, 3] + ([0.5] if is_float else [])))
            steps.append(("scalar", draw(st.sampled_from(["add", "mul", "sub"])), value))
        elif kind == "binary":
            other = sub_shape(draw, cur)
            pl = placements_for(draw, len(other), m)
            op = draw(st.sampled_from(["add", "mul", "sub", "maximum"]))
            steps.append(("binary", op, other, pl, draw(st.integers(0, 2**31))))
            cur = np.broadcast_shapes(cur, other)
        elif kind == "redistribute":
            steps.append(("redistribute", placements_for(draw, nd, m, partials)))
        elif kind == "reduce":
            ops = ["sum"] + (["mean"] if is_float else [])
            if all(cur):
                ops += ["amax", "amin"]
            op = draw(st.sampled_from(ops))
            if nd == 0 or draw(st.booleans()):
                dim, keep = None, False
            else:
                dim, keep = draw(st.integers(-nd, nd - 1)), draw(st.booleans())
            if op == "mean" and (0 in cur if dim is None else cur[dim] == 0):
                op = "sum"  # numpy warns and PyTorch gives nan: compared elsewhere
            steps.append(("reduce", op, dim, keep))
            if dim is None:
                cur = ()
            else:
                d = dim % nd
                cur = cur[:d] + ((1,) if keep else ()) + cur[d + 1 :]
        elif kind == "matmul":
            k = draw(st.integers(0, 4))
            pl = placements_for(draw, 2, m)
            steps.append(("matmul", k, pl, draw(st.integers(0, 2**31))))
            cur = cur[:-1] + (k,)
        elif kind == "reshape":
            steps.append(("reshape",))
            cur = (int(np.prod(cur)),)
        elif kind == "narrow":
            d = draw(st.integers(0, nd - 1))
            start = draw(st.integers(0, cur[d]))
            length = draw(st.integers(0, cur[d] - start))
            steps.append(("narrow", d, start, length))
            cur = cur[:d] + (length,) + cur[d + 1 :]
        elif kind == "transpose":
            d0, d1 = draw(st.integers(0, nd - 1)), draw(st.integers(0, nd - 1))
            steps.append(("transpose", d0, d1))
            cur = list(cur)
            cur[d0], cur[d1] = cur[d1], cur[d0]
            cur = tuple(cur)
        elif kind == "unsqueeze":
            d = draw(st.integers(0, nd))
            steps.append(("unsqueeze", d))
            cur = cur[:d] + (1,) + cur[d:]
        elif kind == "softmax":
            steps.append(("softmax", draw(st.integers(0, nd - 1))))
        cur = tuple(cur)
    seed = draw(st.integers(0, 2**31))
    return mesh_shape, shape, dtype, src, tuple(steps), seed


# -- running a program --------------------------------------------------------------------


def values(shape, dtype, seed):
    """Small integers (exact in every dtype), the same on every rank."""
    return np.random.default_rng(seed).integers(-3, 4, size=shape).astype(DTYPES[dtype])


def _softmax(a, dim):
    e = np.exp(a - a.max(axis=dim, keepdims=True)) if a.size else a
    return e / e.sum(axis=dim, keepdims=True) if a.size else a


def run_step(step, ref, x, mesh, dtype):
    """Apply one step to the numpy reference and to the DTensor."""
    kind = step[0]
    if kind == "unary":
        fn = step[1]
        np_fns = {"neg": np.negative, "abs": np.abs, "tanh": np.tanh, "exp": np.exp}
        ref = np.maximum(ref, 0) if fn == "relu" else np_fns[fn](ref)
        return ref.astype(ref.dtype), getattr(dt, fn)(x)
    if kind == "scalar":
        _, op, value = step
        res = getattr(np, {"add": "add", "mul": "multiply", "sub": "subtract"}[op])(ref, value)
        return res.astype(ref.dtype), getattr(dt, op)(x, value)
    if kind == "binary":
        _, op, shape, pl, seed = step
        other = values(shape, dtype, seed)
        y = dt.distribute_tensor(other, mesh, list(pl))
        np_op = {"add": np.add, "mul": np.multiply, "sub": np.subtract, "maximum": np.maximum}
        return np_op[op](ref, other), getattr(dt, op)(x, y)
    if kind == "redistribute":
        return ref, x.redistribute(mesh, list(step[1]))
    if kind == "reduce":
        _, op, dim, keep = step
        np_op = {"sum": np.sum, "mean": np.mean, "amax": np.amax, "amin": np.amin}[op]
        res = np.asarray(np_op(ref, axis=dim, keepdims=keep)).astype(ref.dtype)
        if dim is None:
            return res, getattr(dt, op)(x)
        return res, getattr(dt, op)(x, dim=dim, keepdim=keep)
    if kind == "matmul":
        _, k, pl, seed = step
        w = values((ref.shape[-1], k), dtype, seed)
        return ref @ w, x @ dt.distribute_tensor(w, mesh, list(pl))
    if kind == "reshape":
        return ref.reshape(-1), x.reshape(-1)
    if kind == "narrow":
        _, d, start, length = step
        index = (slice(None),) * d + (slice(start, start + length),)
        return ref[index], x.narrow(d, start, length)
    if kind == "transpose":
        return np.swapaxes(ref, step[1], step[2]), x.transpose(step[1], step[2])
    if kind == "unsqueeze":
        return np.expand_dims(ref, step[1]), x.unsqueeze(step[1])
    if kind == "softmax":
        return _softmax(ref, step[1]), dt.softmax(x, dim=step[1])
    raise AssertionError(f"unknown step {step}")


def run_program(case) -> str | None:
    """Run one program; None when DTensor and numpy agree, else a description."""
    mesh_shape, shape, dtype, src, steps, seed = case
    mesh = get_mesh(mesh_shape)
    ref = values(shape, dtype, seed)
    try:
        # overflow in exp and the like gives inf on both sides; no warnings
        with check_spmd(), np.errstate(all="ignore"):
            x = dt.distribute_tensor(ref, mesh, list(src))
            for i, step in enumerate(steps):
                ref, x = run_step(step, ref, x, mesh, dtype)
                got = x.full_tensor().numpy()
                if got.shape != ref.shape:
                    return f"step {i} {step}: shape {got.shape}, numpy {ref.shape}"
                tol = TOL[dtype] * max(1.0, float(np.abs(ref).max(initial=0)))
                if not np.allclose(got, ref, rtol=TOL[dtype], atol=tol, equal_nan=True):
                    return (
                        f"step {i} {step}: placements {x.placements}\n got {got!r}\n numpy {ref!r}"
                    )
    except Exception:  # noqa: BLE001 - a DTensor error on a valid program is a failure
        return traceback.format_exc()
    return None


def _seeded(fn):
    return seed(int(_SEED))(fn) if _SEED else fn


@pytest.mark.mpi(min_size=1)
@_seeded
@settings(max_examples=EXAMPLES)
@given(case=programs())
def test_programs_match_numpy(case):
    problem = run_program(case)
    # every rank takes the same verdict, so they fail and shrink together
    problems = WORLD.allgather(problem)
    failed = [(r, p) for r, p in enumerate(problems) if p is not None]
    assert not failed, "\n".join(f"rank {r}: {p}" for r, p in failed)


# -- failures found by the fuzzer, kept as regression tests -------------------------------


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", ["neg", "add_scalar"])
def test_int_amax_over_empty_shards_then_neg_or_scalar_add(op):
    # found by the fuzzer: ((4,), (1,), 'int64', (S(0),), (amax, neg)). The empty shards of
    # ranks >= 1 hold int64's min (the identity of max) in a P(max) result; neg (P(max) ->
    # P(min)) and adding a scalar (P(max) kept) overflowed that identity; integer results
    # now reduce first.
    mesh = get_mesh((WORLD.size,))
    x = dt.distribute_tensor(np.array([2]), mesh, [S(0)])
    y = -x.amax() if op == "neg" else x.amax() + (-3)
    assert y.full_tensor().numpy() == (-2 if op == "neg" else -1)
