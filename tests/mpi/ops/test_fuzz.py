"""Fuzzing DTensor programs against numpy under MPI (hypothesis).

Hypothesis draws a mesh (1-D over the world; also 2x2 and 2x1x2 at 4 ranks, 2x4 and
2x2x2 at 8 ranks), a global shape of up to 3 dims with sizes 0..5 (so shards are even,
uneven and empty), a dtype (float64, float32, int64, bool), the kind of values (small
integers, non-integer floats, or floats with NaN and infinities), source placements
(Shard, Replicate, Partial sum/avg/max/min) and a short program of ops: unary and scalar
pointwise ops, comparisons, casts, binary ops with a broadcast operand of its own
placements, reductions, softmax, matmul, views (transpose, reshape, unsqueeze, narrow) and
redistributes. The dtype changes along the program as the ops say (a comparison gives
bool, a bool sum int64...). Partial operands hold random per-coordinate contributions
(:func:`dtensor.testing.distribute_random`), so a rule that keeps the wrong Partial kind
gives wrong numbers. Every rank runs the same program on DTensors and compares the global
result with numpy on the same data (NaN equal to NaN). The program runs under the SPMD
check, so a divergence between ranks shows as an error instead of a hang, and each
example's verdict is agreed by all ranks, so all of them fail (and shrink) together.

Each run draws other programs: hypothesis is seeded with the session seed of
``tests/mpi/conftest.py`` (chosen on rank 0 and sent to every rank, printed in the report
header as ``DTENSOR_TEST_SEED``), or with ``DTENSOR_FUZZ_SEED=<int>`` when set; a failure
names the seed that reproduces it. Examples per test: ``DTENSOR_FUZZ_EXAMPLES`` if set,
else 2.5 times the hypothesis profile's (150 under the ``ci`` profile);
``HYPOTHESIS_PROFILE=long`` also allows longer programs. The long run::

    HYPOTHESIS_PROFILE=long timeout 3600 mpiexec -n 4 python -m pytest tests/mpi/ops/test_fuzz.py \
        --with-mpi -q
"""

from __future__ import annotations

import os
import traceback

import hypothesis
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mpi4py import MPI

import dtensor as dt
from dtensor.debug._spmd import check_spmd
from dtensor.testing import distribute_random

WORLD = MPI.COMM_WORLD
R, S, P = dt.Replicate(), dt.Shard, dt.Partial

_LONG = os.environ.get("HYPOTHESIS_PROFILE") == "long"
EXAMPLES = int(
    os.environ.get("DTENSOR_FUZZ_EXAMPLES", settings.default.max_examples * 5 // 2)
)
MAX_STEPS = 6 if _LONG else 4

DTYPES = {"float64": np.float64, "float32": np.float32, "int64": np.int64, "bool": np.bool_}
FLOATS = ("float32", "float64")
# Relative to the largest magnitude of the result: floats are not integers here, so
# float32 results differ from numpy's by rounding in another order (sums over shards).
TOL = {"float64": 1e-9, "float32": 1e-4, "int64": 0, "bool": 0}
# Partial kinds a value of each dtype can be placed as (avg needs a floating dtype).
PARTIALS = {
    "float64": ("sum", "avg", "max", "min"),
    "float32": ("sum", "avg", "max", "min"),
    "int64": ("sum", "max", "min"),
    "bool": ("sum", "max", "min"),
}
# The values of a program: small integers (exact in every dtype), non-integer floats, or
# non-integer floats with some NaN, inf and -inf.
VALUE_KINDS = ("int", "frac", "special")

_meshes: dict[tuple, dt.DeviceMesh] = {}


def mesh_shapes() -> list[tuple[int, ...]]:
    shapes = [(WORLD.size,)]
    if WORLD.size == 4:
        shapes += [(2, 2), (2, 1, 2)]  # 3-D: placements over three mesh dims
    if WORLD.size == 8:  # launched by tests/unit/launch/test_examples.py
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


SEEDS = st.integers(0, 2**31)


@st.composite
def programs(draw):
    mesh_shape = draw(st.sampled_from(mesh_shapes()))
    m = len(mesh_shape)
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.integers(0, 5)) for _ in range(ndim))
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    kind = draw(st.sampled_from(VALUE_KINDS)) if dtype in FLOATS else "int"
    src = placements_for(draw, ndim, m, PARTIALS[dtype])
    steps = []
    cur, cur_dtype = shape, dtype
    for _ in range(draw(st.integers(1, MAX_STEPS))):
        nd = len(cur)
        is_float, is_bool = cur_dtype in FLOATS, cur_dtype == "bool"
        kinds = ["unary", "scalar", "binary", "redistribute", "reduce", "cast"]
        if not is_bool:
            kinds.append("compare")
        if nd >= 1:
            kinds += ["reshape", "narrow"] + ([] if is_bool else ["matmul"])
        if nd >= 2:
            kinds.append("transpose")
        if nd < 3:
            kinds.append("unsqueeze")
        if is_float and nd >= 1:
            kinds.append("softmax")
        step = draw(st.sampled_from(kinds))
        if step == "unary":
            fns = (["logical_not"] if is_bool else ["neg", "abs", "relu"]
                   + (["tanh", "exp"] if is_float else []))
            steps.append(("unary", draw(st.sampled_from(fns))))
        elif step == "scalar":
            # a bool tensor and an int scalar compute in int64, as in PyTorch
            ops = ["add", "mul"] + ([] if is_bool else ["sub"])
            value = draw(st.sampled_from([-2, 3] + ([0.5, -1.25] if is_float else [])))
            steps.append(("scalar", draw(st.sampled_from(ops)), value))
            if is_bool:
                cur_dtype = "int64"
        elif step == "compare":
            op = draw(st.sampled_from(["gt", "lt", "eq", "ne"]))
            if draw(st.booleans()):
                steps.append(("compare", op, 0))
            else:
                other = sub_shape(draw, cur)
                pl = placements_for(draw, len(other), m, PARTIALS[cur_dtype])
                steps.append(("compare", op, (other, pl, draw(SEEDS))))
                cur = np.broadcast_shapes(cur, other)
            cur_dtype = "bool"
        elif step == "cast":
            # no float -> integer cast: NaN and infinities have no integer value
            targets = ["bool", "float32", "float64"] + ([] if is_float else ["int64"])
            cur_dtype = draw(st.sampled_from(targets))
            steps.append(("cast", cur_dtype))
        elif step == "binary":
            other = sub_shape(draw, cur)
            pl = placements_for(draw, len(other), m, PARTIALS[cur_dtype])
            ops = ["add", "mul", "maximum"] + ([] if is_bool else ["sub"])
            steps.append(("binary", draw(st.sampled_from(ops)), other, pl, draw(SEEDS)))
            cur = np.broadcast_shapes(cur, other)
        elif step == "redistribute":
            steps.append(("redistribute", placements_for(draw, nd, m, PARTIALS[cur_dtype])))
        elif step == "reduce":
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
            if op == "sum" and cur_dtype in ("bool", "int64"):
                cur_dtype = "int64"
            if dim is None:
                cur = ()
            else:
                d = dim % nd
                cur = cur[:d] + ((1,) if keep else ()) + cur[d + 1 :]
        elif step == "matmul":
            k = draw(st.integers(0, 4))
            pl = placements_for(draw, 2, m, PARTIALS[cur_dtype])
            steps.append(("matmul", k, pl, draw(SEEDS)))
            cur = cur[:-1] + (k,)
        elif step == "reshape":
            steps.append(("reshape",))
            cur = (int(np.prod(cur)),)
        elif step == "narrow":
            d = draw(st.integers(0, nd - 1))
            start = draw(st.integers(0, cur[d]))
            length = draw(st.integers(0, cur[d] - start))
            steps.append(("narrow", d, start, length))
            cur = cur[:d] + (length,) + cur[d + 1 :]
        elif step == "transpose":
            d0, d1 = draw(st.integers(0, nd - 1)), draw(st.integers(0, nd - 1))
            steps.append(("transpose", d0, d1))
            cur = list(cur)
            cur[d0], cur[d1] = cur[d1], cur[d0]
        elif step == "unsqueeze":
            d = draw(st.integers(0, nd))
            steps.append(("unsqueeze", d))
            cur = cur[:d] + (1,) + cur[d:]
        elif step == "softmax":
            steps.append(("softmax", draw(st.integers(0, nd - 1))))
        cur = tuple(cur)
    return mesh_shape, shape, dtype, kind, src, tuple(steps), draw(SEEDS)


# -- running a program --------------------------------------------------------------------


def values(shape, dtype, kind, seed):
    """Global values, the same on every rank: bools, small integers, or (floats of ``kind``
    ``frac``/``special``) non-integer floats, ``special`` with NaN/inf/-inf at about one
    element in six."""
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.random(shape) < 0.5
    if kind == "int" or dtype == "int64":
        return rng.integers(-3, 4, size=shape).astype(DTYPES[dtype])
    out = np.asarray(rng.standard_normal(shape) * 2).astype(DTYPES[dtype])
    if kind == "special":
        special = rng.random(shape) < 1 / 6
        out[special] = rng.choice([np.nan, np.inf, -np.inf], size=int(special.sum()))
    return out


def place(value, mesh, placements, seed):
    """``value`` laid out as ``placements``: Partial mesh dims hold random contributions."""
    if any(p.is_partial() for p in placements):
        return distribute_random(value, mesh, list(placements), seed=seed)
    return dt.distribute_tensor(value, mesh, list(placements))


def _softmax(a, dim):
    e = np.exp(a - a.max(axis=dim, keepdims=True)) if a.size else a
    return e / e.sum(axis=dim, keepdims=True) if a.size else a


def _replicate_summed(x, mesh):
    """``x`` with its Partial(sum/avg) mesh dims replicated."""
    summed = [p.is_partial() and p.reduce_op in ("sum", "avg") for p in x.placements]
    if not any(summed):
        return x
    return x.redistribute(mesh, [R if s else p for p, s in zip(x.placements, summed)])


def _no_inf_times_partial_sum(x, a, y, b, mesh):
    """DTensors ``x`` and ``y`` (global values ``a`` and ``b``) of a product, the
    Partial(sum/avg) one replicated first when the other holds NaN or infinities.

    Such a product has no single answer: ``inf * 2`` is inf, but held as ``P(sum)`` of
    ``3`` and ``-1`` it is ``inf * 3 + inf * -1``, NaN; a zero contribution gives
    ``inf * 0``, NaN too. The rules keep the Partial (as PyTorch's do), so the oracle would
    depend on the contributions.
    """
    if not np.isfinite(b).all():
        x = _replicate_summed(x, mesh)
    if not np.isfinite(a).all():
        y = _replicate_summed(y, mesh)
    return x, y


def run_step(step, ref, x, mesh, kind):
    """Apply one step to the numpy reference and to the DTensor."""
    op = step[0]
    dtype = ref.dtype.name
    if op == "unary":
        fn = step[1]
        np_fns = {"neg": np.negative, "abs": np.abs, "tanh": np.tanh, "exp": np.exp,
                  "logical_not": np.logical_not}
        ref = np.maximum(ref, ref.dtype.type(0)) if fn == "relu" else np_fns[fn](ref)
        return ref, getattr(dt, fn)(x)
    if op == "scalar":
        _, name, value = step
        res = getattr(np, {"add": "add", "mul": "multiply", "sub": "subtract"}[name])(ref, value)
        # PyTorch: a python scalar matters only when its category is higher (bool + int is
        # int64); int tensors never meet float scalars here
        rt = np.int64 if ref.dtype == np.bool_ else ref.dtype
        return res.astype(rt), getattr(dt, name)(x, value)
    if op == "compare":
        _, name, other = step
        np_op = {"gt": np.greater, "lt": np.less, "eq": np.equal, "ne": np.not_equal}[name]
        if other == 0:
            return np_op(ref, 0), getattr(dt, name)(x, 0)
        shape, pl, seed = other
        y = values(shape, dtype, kind, seed)
        return np_op(ref, y), getattr(dt, name)(x, place(y, mesh, pl, seed))
    if op == "cast":
        return ref.astype(DTYPES[step[1]]), x.to(getattr(dt, step[1]))
    if op == "binary":
        _, name, shape, pl, seed = step
        other = values(shape, dtype, kind, seed)
        y = place(other, mesh, pl, seed)
        if name == "mul":
            x, y = _no_inf_times_partial_sum(x, ref, y, other, mesh)
        np_op = {"add": np.add, "mul": np.multiply, "sub": np.subtract, "maximum": np.maximum}
        return np_op[name](ref, other), getattr(dt, name)(x, y)
    if op == "redistribute":
        return ref, x.redistribute(mesh, list(step[1]))
    if op == "reduce":
        _, name, dim, keep = step
        np_op = {"sum": np.sum, "mean": np.mean, "amax": np.amax, "amin": np.amin}[name]
        rt = np.int64 if name == "sum" and ref.dtype.kind in "bi" else ref.dtype
        res = np.asarray(np_op(ref, axis=dim, keepdims=keep)).astype(rt)
        if dim is None:
            return res, getattr(dt, name)(x)
        return res, getattr(dt, name)(x, dim=dim, keepdim=keep)
    if op == "matmul":
        _, k, pl, seed = step
        w = values((ref.shape[-1], k), dtype, kind, seed)
        x, y = _no_inf_times_partial_sum(x, ref, place(w, mesh, pl, seed), w, mesh)
        return ref @ w, x @ y
    if op == "reshape":
        return ref.reshape(-1), x.reshape(-1)
    if op == "narrow":
        _, d, start, length = step
        index = (slice(None),) * d + (slice(start, start + length),)
        return ref[index], x.narrow(d, start, length)
    if op == "transpose":
        return np.swapaxes(ref, step[1], step[2]), x.transpose(step[1], step[2])
    if op == "unsqueeze":
        return np.expand_dims(ref, step[1]), x.unsqueeze(step[1])
    if op == "softmax":
        return _softmax(ref, step[1]), dt.softmax(x, dim=step[1])
    raise AssertionError(f"unknown step {step}")


def undecided(step, ref, kind, tol: float):
    """Elements of a comparison or a cast to bool that rounding may decide either way:
    float inputs within ``tol`` (relative to their largest finite magnitude) of what they
    are compared with (0 for the cast). None when there are none."""
    if ref.dtype.kind != "f":
        return None
    if step == ("cast", "bool") or step[0] == "compare" and step[2] == 0:
        a, b = np.broadcast_arrays(ref, np.zeros((), ref.dtype))
    elif step[0] == "compare":
        shape, _, seed = step[2]
        a, b = np.broadcast_arrays(ref, values(shape, ref.dtype.name, kind, seed))
    else:
        return None
    finite = np.abs(np.concatenate([a[np.isfinite(a)], b[np.isfinite(b)]]))
    near = np.abs(a - b) <= tol * max(1.0, float(finite.max(initial=0)))
    return near if near.any() else None


def mismatch(got, ref, tol: float) -> bool:
    """Whether a DTensor result differs from numpy's (NaN equal to NaN; floats within
    ``tol`` relative to the largest finite magnitude of ``ref``)."""
    if got.shape != ref.shape or got.dtype != ref.dtype:
        return True
    if ref.dtype.kind in "biu":
        return not np.array_equal(got, ref)
    finite = np.abs(ref[np.isfinite(ref)])
    atol = tol * max(1.0, float(finite.max(initial=0)))
    return not np.allclose(got, ref, rtol=tol, atol=atol, equal_nan=True)


def run_program(case) -> str | None:
    """Run one program; None when DTensor and numpy agree, else a description."""
    mesh_shape, shape, dtype, kind, src, steps, seed = case
    mesh = get_mesh(mesh_shape)
    ref = values(shape, dtype, kind, seed)
    try:
        # overflow in exp and the like gives inf on both sides; no warnings
        with check_spmd(), np.errstate(all="ignore"):
            x = place(ref, mesh, src, seed)
            tol = TOL[dtype]
            for i, step in enumerate(steps):
                free = undecided(step, ref, kind, tol)
                ref, x = run_step(step, ref, x, mesh, kind)
                # a float64 value cast from float32 keeps float32's rounding errors
                tol = max(tol, TOL[ref.dtype.name])
                got = x.full_tensor().numpy()
                if free is not None:
                    # rounding decides these: every rank takes rank 0's answer there
                    ref = np.where(free, WORLD.bcast(got, root=0), ref)
                bad = mismatch(got, ref, tol)
                # all ranks stop after the step any rank finds wrong (their results may
                # differ: a bug), so that they all run the same collectives
                if WORLD.allreduce(bad, op=MPI.LOR):
                    if not bad:
                        return None
                    return (
                        f"step {i} {step}: placements {x.placements}\n got {got!r}\n"
                        f" numpy {ref!r}"
                    )
    except Exception:  # noqa: BLE001 - a DTensor error on a valid program is a failure
        return traceback.format_exc()
    return None


@pytest.mark.mpi(min_size=1)
def test_programs_match_numpy(seed):
    # one seed on every rank: the environment may differ between ranks, rank 0's counts
    fuzz_seed = WORLD.bcast(int(os.environ.get("DTENSOR_FUZZ_SEED", seed)), root=0)

    @hypothesis.seed(fuzz_seed)
    @settings(max_examples=EXAMPLES)
    @given(case=programs())
    def check(case):
        problem = run_program(case)
        # every rank takes the same verdict, so they fail and shrink together
        problems = WORLD.allgather(problem)
        failed = [(r, p) for r, p in enumerate(problems) if p is not None]
        assert not failed, f"reproduce with DTENSOR_FUZZ_SEED={fuzz_seed}\n" + "\n".join(
            f"rank {r}: {p}" for r, p in failed
        )

    check()


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


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(
    "op", ["float", "add_scalar", "mul_scalar", "sum", "where", "mean", "cumsum", "int32"]
)
def test_bool_partial_sum_made_numbers(op):
    # found by the fuzzer: (R + P(sum)) of bools holds True on several ranks (a bool P(sum)
    # reduces by logical or); cast to float32, plus or times an int, or summed, it stayed
    # P(sum) and those Trues added up (2.0 for True). Made numbers, such an input is now
    # reduced first (as .long() always did).
    mesh = get_mesh((WORLD.size,))
    x = dt.DTensor.from_local(dt.tensor([True, False]), mesh, [P("sum")])
    cond = dt.DTensor.from_local(dt.tensor([True, True]), mesh, [R])
    y, expected = {
        "float": (lambda: x.to(dt.float32), [1.0, 0.0]),
        "add_scalar": (lambda: x + 1, [2, 1]),
        "mul_scalar": (lambda: x * 3, [3, 0]),
        "sum": (lambda: x.sum(), 1),
        "where": (lambda: dt.where(cond, x, 0.5), [1.0, 0.0]),
        "mean": (lambda: x.mean(dtype=dt.float32), 0.5),
        "cumsum": (lambda: x.cumsum(0), [1, 1]),
        "int32": (lambda: x.to(dt.int32), [1, 0]),
    }[op]
    ok = np.array_equal(y().full_tensor().numpy(), expected)
    assert all(WORLD.allgather(ok))  # the verdict of every rank


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", ["amax", "amin"])
def test_nan_survives_amax_over_shards(op):
    # found by the fuzzer: amax/amin over a sharded dim give a P(max)/P(min) whose NaN sits
    # on one rank; MPI's MAX/MIN all-reduce dropped it on some ranks and kept it on others
    # (now NaN-propagating ops, see test_reduction_edges).
    mesh = get_mesh((WORLD.size,))
    x = dt.distribute_tensor(np.array([1.0] + [np.nan] * (WORLD.size - 1)), mesh, [S(0)])
    ok = bool(np.isnan(getattr(x, op)().full_tensor().numpy()))
    assert all(WORLD.allgather(ok))  # the verdict of every rank
