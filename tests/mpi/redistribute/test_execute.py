"""MPI tests of the redistribute executor and of ``scatter_from``.

Every test starts from global data made from the session seed (identical on all ranks),
builds this rank's source shard (Partial sources: per-rank contributions that reduce to the
global data), runs the plan with :func:`redistribute.execute.execute`, and compares with
numpy: targets without Partial shard-by-shard, targets with Partial by gathering every
rank's result and reducing it. Run with
``mpiexec -n K python -m pytest tests/mpi/redistribute/test_execute.py --with-mpi`` for K = 1..4.
"""

from __future__ import annotations

import functools
import itertools
import os

import numpy as np
import pytest
from mpi4py import MPI

from placements import DTensorSpec, MeshShape, Partial, Replicate, Shard, local_slices
from placements.errors import DTypeError, ShardingError
from placements.layout import partial_fill
from redistribute import comm as C
from redistribute import execute as E
from redistribute.execute import programs as EP
from redistribute.plan import plan

WORLD = MPI.COMM_WORLD.Get_size()
OPTIONS = (
    Shard(0),
    Shard(1),
    Replicate(),
    Partial("sum"),
    Partial("avg"),
    Partial("max"),
    Partial("min"),
)
SHAPES = ((8, 6), (5, 3), (1, 7), (0, 4), (3, 2), (4, 5, 3))
DTYPES = (np.float32, np.float64, np.int64, np.bool_)

pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.mode_independent]  # see tests/conftest.py
on_2x2 = pytest.mark.skipif(WORLD != 4, reason="the 2x2 mesh needs exactly 4 ranks")


# -- fixtures -----------------------------------------------------------------------------


# 3-D meshes: at 4 ranks two with a size-1 dim (three mesh dims in every plan, the nested
# order of two sharded dims), at 8 ranks the full 2x2x2 cube
MESHES_3D = {4: [(2, 1, 2), (1, 2, 2)], 8: [(2, 2, 2)]}.get(WORLD, [])


@pytest.fixture(scope="module")
def meshes():
    """Mesh shape -> (coord, comms) for the 1-D world mesh, at 4 ranks the 2x2 mesh, and
    the 3-D meshes of ``MESHES_3D``."""
    world = C.world()
    shapes = [(WORLD,)] + ([(2, 2)] if WORLD == 4 else []) + MESHES_3D
    out = {s: C.make_mesh_comms(world, np.arange(WORLD).reshape(s)) for s in shapes}
    yield out
    for _, comms in out.values():
        for c in comms:
            c.free()


# Code paths of the executor, chosen by its size thresholds: the default thresholds; peer
# exchange (alltoallw) for every gather, strided blocks staged; and peer exchange with every
# strided block received through a derived datatype.
PATHS = {
    "default": {},
    "staged": {"_MAX_ALLGATHER_BYTES": 0},
    "typed": {"_MAX_ALLGATHER_BYTES": 0, "_MIN_TYPED_RUN": 0},
}


@pytest.fixture
def path(request, monkeypatch):
    """Run the test with the thresholds of ``PATHS[request.param]`` (fresh programs)."""
    EP.PROGRAMS.clear()
    for name, value in PATHS[request.param].items():
        monkeypatch.setattr(EP, name, value)
    yield request.param
    EP.PROGRAMS.clear()


@pytest.fixture
def observed():
    """(kind, nbytes, mesh dim) of every collective issued during the test."""
    seen = []

    def observer(kind, nbytes, comm):
        seen.append((kind, nbytes, comm.mesh_dim))

    C.add_observer(observer)
    yield seen
    C.remove_observer(observer)


# -- data ---------------------------------------------------------------------------------


def global_data(shape, dtype, seed):
    rng = np.random.default_rng([seed, *shape, np.dtype(dtype).num])
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    if np.dtype(dtype).kind == "b":
        return rng.random(shape) < 0.5
    return rng.integers(-100, 100, shape).astype(dtype)


def split(value, op, k, rng):
    """k contributions whose reduction by ``op`` is ``value``."""
    owner = rng.integers(0, k, value.shape)
    if value.dtype == bool:
        if op == "min":  # logical and
            return [value | (owner != j) for j in range(k)]
        return [value & (owner == j) for j in range(k)]  # sum, max: logical or
    if op in ("max", "min"):
        sign = -1 if op == "max" else 1
        noise = [np.abs(rng.integers(1, 5, value.shape)).astype(value.dtype) for _ in range(k)]
        return [np.where(owner == j, value, value + sign * noise[j]) for j in range(k)]
    total = value * k if op == "avg" else value
    if value.dtype.kind == "f":
        parts = [rng.standard_normal(value.shape).astype(value.dtype) for _ in range(k - 1)]
    else:
        parts = [rng.integers(-5, 5, value.shape).astype(value.dtype) for _ in range(k - 1)]
    return parts + [(total - sum(parts, np.zeros_like(value))).astype(value.dtype)]


def source_shard(data, spec, coord, seed):
    """This coordinate's shard of ``data`` under ``spec`` (Partial dims split top-down)."""
    value = data
    for m, p in enumerate(spec.placements):
        if p.is_partial():
            rng = np.random.default_rng([seed, 7, m, *coord[:m]])
            value = split(value, p.reduce_op, spec.mesh_shape[m], rng)[coord[m]]
    return value[local_slices(data.shape, spec.mesh_shape, spec.placements, coord)]


def with_layout(arr, layout):
    """``arr``'s values with C strides ("c") or as a transposed, non-contiguous view ("t")."""
    if layout == "c":
        return np.ascontiguousarray(arr)
    view = np.ascontiguousarray(arr.T).T
    assert np.array_equal(view, arr)
    return view


def _reduce(arrays, op):
    if op == "avg":
        return (sum(a.astype(np.float64) for a in arrays) / len(arrays)).astype(arrays[0].dtype)
    ufunc = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}[op]
    return functools.reduce(ufunc, arrays)


def assemble(pieces, spec):
    """The global value that ``pieces`` (coord -> local) represent under ``spec``.

    Mesh dims are folded from the highest down: Partial dims reduce, Shard dims stitch,
    Replicate dims must agree.
    """
    mesh_shape, placements = spec.mesh_shape, spec.placements
    vals, masks = {}, {}
    for coord, local in pieces.items():
        full = np.zeros(spec.shape, dtype=local.dtype)
        mask = np.zeros(spec.shape, dtype=bool)
        sl = local_slices(spec.shape, mesh_shape, placements, coord)
        full[sl], mask[sl] = local, True
        vals[coord], masks[coord] = full, mask
    for m in reversed(range(len(mesh_shape))):
        p = placements[m]
        for coord in [c for c in vals if c[m] == 0]:
            group = [coord[:m] + (j,) + coord[m + 1 :] for j in range(mesh_shape[m])]
            arrays = [vals.pop(c) for c in group]
            group_masks = [masks.pop(c) for c in group]
            if p.is_partial():
                value, mask = _reduce(arrays, p.reduce_op), group_masks[0]
            elif p.is_shard():
                value, mask = arrays[0], group_masks[0]
                for a, msk in zip(arrays[1:], group_masks[1:]):
                    assert not (mask & msk).any(), "overlapping shards"
                    value, mask = np.where(msk, a, value), mask | msk
            else:
                for a in arrays[1:]:
                    assert_close(a, arrays[0], "replicas differ")
                value, mask = arrays[0], group_masks[0]
            vals[coord], masks[coord] = value, mask
    ((coord, value),) = vals.items()
    assert masks[coord].all(), "the shards do not cover the tensor"
    return value


def assert_close(got, want, context):
    if np.dtype(got.dtype).kind in "fc" or np.dtype(want.dtype).kind in "fc":
        tol = 1e-4 if np.float32 in (got.dtype, want.dtype) else 1e-10
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=context)
    else:
        np.testing.assert_array_equal(got, want, err_msg=context)


def placement_lists(mesh_shape, dtype):
    """Every placement list over OPTIONS for the mesh (no 'avg' for integer and bool)."""
    options = [p for p in OPTIONS if np.dtype(dtype).kind == "f" or not p.is_partial("avg")]
    return list(itertools.product(options, repeat=len(mesh_shape)))


def check_pair(data, src, dst, mesh_shape, coord, comms, seed, layout="c", pending=None):
    """Redistribute ``data`` from ``src`` to ``dst`` and compare with numpy. A target with
    Partial needs every rank's output: it is appended to ``pending`` for
    :func:`check_pending` (or checked at once when ``pending`` is None)."""
    spec = DTensorSpec(MeshShape(mesh_shape), src, data.shape, data.dtype)
    local = with_layout(source_shard(data, spec, coord, seed), layout)
    before = local.copy()
    steps = plan(spec, dst)
    out = E.execute(steps, local, spec, coord, comms)
    dst_spec = spec.with_placements(dst)
    context = f"{spec!r} -> {dst_spec!r} at {coord} via {steps}"
    assert out.dtype == data.dtype, context
    assert out.shape == dst_spec.local_shape(coord), context
    np.testing.assert_array_equal(local, before, err_msg="input modified: " + context)
    if dst_spec.has_partial():
        check_pending(data, [(dst_spec, out, context)] if pending is None else None, coord)
        if pending is not None:
            pending.append((dst_spec, out, context))
    else:
        want = data[local_slices(data.shape, mesh_shape, dst, coord)]
        assert_close(out, want, context)
    return out


def check_pending(data, pending, coord):
    """Gather the outputs of Partial targets from every rank (one collective) and compare
    their reductions with ``data``."""
    if pending is None:
        return
    everyone = MPI.COMM_WORLD.allgather((coord, [out for _, out, _ in pending]))
    for i, (dst_spec, _, context) in enumerate(pending):
        pieces = {c: outs[i] for c, outs in everyone}
        assert_close(assemble(pieces, dst_spec), data, context)


def run_all_pairs(mesh_shape, shape, dtype, meshes, seed, layout="c", limit=None):
    """Every (source, target) pair of the mesh's placement lists, or ``limit`` of them drawn
    with the session's seed (the same on every rank; all of them with
    ``HYPOTHESIS_PROFILE=long``)."""
    coord, comms = meshes[mesh_shape]
    data = global_data(shape, dtype, seed)
    lists = placement_lists(mesh_shape, dtype)
    pairs = [(src, dst) for src in lists for dst in lists]
    if limit is not None and limit < len(pairs) and os.environ.get("HYPOTHESIS_PROFILE") != "long":
        rng = np.random.default_rng([seed, *mesh_shape, *shape])
        pairs = [pairs[i] for i in sorted(rng.choice(len(pairs), limit, replace=False))]
    pending = []
    for src, dst in pairs:
        check_pair(data, src, dst, mesh_shape, coord, comms, seed, layout, pending)
    check_pending(data, pending, coord)


# -- placement pairs ----------------------------------------------------------------------


def _id(value):
    return np.dtype(value).name if isinstance(value, type) else str(value)


# every dtype on the default path; data moves as bytes, so the other paths take one
# 8-byte and one 1-byte dtype
CASES_1D = [
    (shape, dtype, path)
    for path in PATHS
    for dtype in DTYPES
    for shape in SHAPES
    if path == "default" or dtype in (np.float64, np.bool_)
]


@pytest.mark.parametrize(("shape", "dtype", "path"), CASES_1D, indirect=["path"], ids=_id)
def test_all_pairs_1d(shape, dtype, path, meshes, seed):
    run_all_pairs((WORLD,), shape, dtype, meshes, seed)


@pytest.mark.parametrize("path", list(PATHS), indirect=True)
@pytest.mark.parametrize("shape", [(8, 6), (5, 3), (4, 5, 3)], ids=str)
def test_all_pairs_1d_transposed_input(shape, path, meshes, seed):
    run_all_pairs((WORLD,), shape, np.float64, meshes, seed, layout="t")


# 2401 pairs per case (each costs a few collectives; 4 ranks usually share fewer cores):
# float64 on every shape, int64 and bool (reductions of their own) on one each. The uneven
# and the empty shapes run every pair; the others a sample of PAIRS_2X2, drawn anew in each
# session (tests/unit/redistribute/test_plan.py simulates every 2x2 pair on every shape)
CASES_2X2 = [(shape, np.float64) for shape in ((8, 6), (5, 3), (1, 7), (0, 4), (3, 2))] + [
    ((5, 3), np.int64),
    ((8, 6), np.bool_),
]
EVERY_PAIR_2X2 = {((5, 3), np.float64), ((0, 4), np.float64)}
PAIRS_2X2 = 400


@on_2x2
@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize(("shape", "dtype"), CASES_2X2, ids=_id)
def test_all_pairs_2x2(shape, dtype, meshes, seed):
    limit = None if (shape, dtype) in EVERY_PAIR_2X2 else PAIRS_2X2
    run_all_pairs((2, 2), shape, dtype, meshes, seed, limit=limit)


@on_2x2
@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize(
    ("shape", "path"), [((8, 6), "typed"), ((5, 3), "staged")], indirect=["path"], ids=_id
)
def test_all_pairs_2x2_transposed_input(shape, path, meshes, seed):
    run_all_pairs((2, 2), shape, np.float32, meshes, seed, layout="t", limit=PAIRS_2X2)


def run_sampled_pairs(mesh_shape, shape, dtype, meshes, seed, count, layout="c", to_r=None):
    """``count`` (source, target) pairs drawn from every placement list of the mesh (the
    same draw on every rank), plus each list (or ``to_r`` lists drawn) to and from
    all-Replicate."""
    coord, comms = meshes[mesh_shape]
    data = global_data(shape, dtype, seed)
    lists = placement_lists(mesh_shape, dtype)
    rng = np.random.default_rng([seed, *mesh_shape, *shape])
    replicate = tuple(Replicate() for _ in mesh_shape)
    pairs = [(lists[i], lists[j]) for i, j in rng.integers(0, len(lists), (count, 2))]
    if to_r is not None and to_r < len(lists):
        lists = [lists[i] for i in sorted(rng.choice(len(lists), to_r, replace=False))]
    pairs += [(p, replicate) for p in lists] + [(replicate, p) for p in lists]
    pending = []
    for src, dst in pairs:
        check_pair(data, src, dst, mesh_shape, coord, comms, seed, layout, pending)
    check_pending(data, pending, coord)


# uneven and empty shards on every mesh dim: 5 rows over 2x2 gives shards 2,1 / 1,1 and
# (3, ...) nested over 2x2 leaves a coordinate empty
SHAPES_3D = ((8, 6), (5, 3), (3, 7), (4, 5, 3), (0, 4))


@pytest.mark.skipif(
    not MESHES_3D,
    reason="3-D meshes are tested at 4 ranks (2x1x2, 1x2x2) and 8 ranks (2x2x2, launched by "
    "tests/unit/launch/test_examples.py::test_3d_meshes_at_8_ranks)",
)
@pytest.mark.parametrize("shape", SHAPES_3D, ids=str)
def test_sampled_pairs_3d(shape, meshes, seed):
    # 4 and 8 ranks run two and four ranks per core here: a sample of the pairs (the seed
    # changes from run to run; tests/unit/redistribute/test_plan.py simulates every 2x2x2 pair)
    # (at 8 ranks, 40 of the 216 lists also go to and from Replicate)
    for mesh_shape in MESHES_3D:
        count, to_r = (60, None) if WORLD < 8 else (20, 40)
        run_sampled_pairs(mesh_shape, shape, np.float64, meshes, seed, count=count, to_r=to_r)


@pytest.mark.skipif(not MESHES_3D, reason="see test_sampled_pairs_3d")
@pytest.mark.parametrize("path", ["typed", "staged"], indirect=True)
def test_sampled_pairs_3d_transposed_input(path, meshes, seed):
    for mesh_shape in MESHES_3D:
        run_sampled_pairs(mesh_shape, (5, 6), np.float32, meshes, seed, count=60, layout="t",
                          to_r=None if WORLD < 8 else 40)


@pytest.mark.skipif(not MESHES_3D, reason="see test_sampled_pairs_3d")
def test_sampled_pairs_3d_integers(meshes, seed):
    for mesh_shape in MESHES_3D:
        run_sampled_pairs(mesh_shape, (6, 5), np.int64, meshes, seed, count=60,
                          to_r=None if WORLD < 8 else 40)


@pytest.mark.parametrize("shape", [(160, 200), (257, 129), (7, 300, 9)], ids=str)
def test_large_blocks(shape, meshes, seed):
    """Tensors above the all-gather threshold under the default thresholds: peer exchange,
    strided blocks received through derived types (or staged at more ranks)."""
    mesh_shape = (WORLD,)
    coord, comms = meshes[mesh_shape]
    data = global_data(shape, np.float32, seed)
    pairs = [
        (Shard(0), Replicate()),
        (Shard(1), Replicate()),
        (Shard(0), Shard(1)),
        (Shard(1), Shard(0)),
        (Partial("sum"), Shard(1)),
        (Partial("max"), Replicate()),
    ]
    for src, dst in pairs:
        for layout in "ct":
            check_pair(data, (src,), (dst,), mesh_shape, coord, comms, seed, layout)


# -- round trips and local steps ----------------------------------------------------------


@pytest.mark.parametrize("shape", [(8, 6), (5, 3), (0, 4), (4, 5, 3)], ids=str)
def test_round_trips_are_exact(shape, meshes, seed):
    for mesh_shape, (coord, comms) in meshes.items():
        data = global_data(shape, np.float32, seed)
        lists = placement_lists(mesh_shape, np.float32)
        plain = [p for p in lists if not any(q.is_partial() for q in p)]
        for src in plain:
            spec = DTensorSpec(MeshShape(mesh_shape), src, shape, data.dtype)
            local = source_shard(data, spec, coord, seed)
            for dst in plain:
                there = E.execute(plan(spec, dst), local, spec, coord, comms)
                dst_spec = spec.with_placements(dst)
                back = E.execute(plan(dst_spec, src), there, dst_spec, coord, comms)
                np.testing.assert_array_equal(back, local, err_msg=f"{src} -> {dst} -> {src}")


def test_local_chunk_is_a_view(meshes, seed):
    coord, comms = meshes[(WORLD,)]
    data = global_data((9, 4), np.float64, seed)
    spec = DTensorSpec(MeshShape((WORLD,)), (Replicate(),), data.shape, data.dtype)
    for dim in (0, 1):
        out = E.execute(plan(spec, (Shard(dim),)), data, spec, coord, comms)
        assert out.base is data or out is data
        np.testing.assert_array_equal(
            out, data[local_slices(data.shape, (WORLD,), (Shard(dim),), coord)]
        )


def test_partition_partial_layout(meshes, seed):
    """R -> P(sum): coordinate 0 keeps the value (a view), the others hold zeros;
    R -> P(max)/P(avg): everyone keeps the value."""
    coord, comms = meshes[(WORLD,)]
    data = global_data((5, 3), np.float32, seed)
    spec = DTensorSpec(MeshShape((WORLD,)), (Replicate(),), data.shape, data.dtype)
    out = E.execute(plan(spec, (Partial("sum"),)), data, spec, coord, comms)
    if coord[0] == 0:
        assert out is data
    else:
        np.testing.assert_array_equal(out, np.zeros_like(data))
    for op in ("max", "avg", "min"):
        assert E.execute(plan(spec, (Partial(op),)), data, spec, coord, comms) is data


@pytest.mark.parametrize("path", ["default", "typed"], indirect=True)
def test_collectives_issued(path, meshes, seed, observed):
    """One collective of the expected kind per communicating step, reported with the size
    of its largest buffer (the whole output of a gather, whichever path moves it); none for
    R->S, and none at all on a group of one rank (its block is already the whole).
    """
    coord, comms = meshes[(WORLD,)]
    data = global_data((8, 6), np.float32, seed)

    def one(kind):
        return [(kind, data.nbytes, 0)] if WORLD > 1 else []

    cases = [
        ((Shard(0),), (Replicate(),), one("all_gather")),
        ((Shard(1),), (Replicate(),), one("all_gather")),
        ((Partial("sum"),), (Replicate(),), one("all_reduce")),
        ((Partial("sum"),), (Shard(0),), one("reduce_scatter")),
        ((Replicate(),), (Shard(0),), []),
    ]
    for src, dst, want in cases:
        spec = DTensorSpec(MeshShape((WORLD,)), src, data.shape, data.dtype)
        local = source_shard(data, spec, coord, seed)
        observed.clear()
        E.execute(plan(spec, dst), local, spec, coord, comms)
        assert observed == want, (src, dst)


def test_all_to_all_moves_only_peer_blocks(meshes, seed, monkeypatch):
    """S(0)->S(1): the bytes passed to MPI are the off-diagonal blocks only (this rank's own
    block is copied locally)."""
    coord, comms = meshes[(WORLD,)]
    data = global_data((8, 6), np.float64, seed)
    spec = DTensorSpec(MeshShape((WORLD,)), (Shard(0),), data.shape, data.dtype)
    dst = spec.with_placements((Shard(1),))
    local = source_shard(data, spec, coord, seed)
    seen = []
    real = C.Comm.alltoallw

    def spy(self, send, scounts, sdispls, stypes, recv, rcounts, rdispls, rtypes, *rest):
        sent = sum(c * t.Get_size() for c, t in zip(scounts, stypes))
        got = sum(c * t.Get_size() for c, t in zip(rcounts, rtypes))
        seen.append((sent, got))
        return real(self, send, scounts, sdispls, stypes, recv, rcounts, rdispls, rtypes, *rest)

    monkeypatch.setattr(C.Comm, "alltoallw", spy)
    EP.PROGRAMS.clear()  # recompile, so the exchange goes through the spy
    out = E.execute(plan(spec, (Shard(1),)), local, spec, coord, comms)
    mine = np.prod(spec.local_shape(coord)) * data.itemsize
    diagonal = np.prod(dst.local_shape(coord)[1:]) * spec.local_shape(coord)[0] * data.itemsize
    sent = mine - diagonal
    received = np.prod(dst.local_shape(coord)) * data.itemsize - diagonal
    assert seen == ([(sent, received)] if WORLD > 1 else [])
    np.testing.assert_array_equal(out, data[local_slices(data.shape, (WORLD,), (Shard(1),), coord)])


# -- errors -------------------------------------------------------------------------------


def test_shape_and_dtype_mismatch_raise(meshes):
    coord, comms = meshes[(WORLD,)]
    spec = DTensorSpec(MeshShape((WORLD,)), (Shard(0),), (8, 6), np.float32)
    steps = plan(spec, (Replicate(),))
    with pytest.raises(ShardingError, match="does not match"):
        E.execute(steps, np.zeros((9, 6), np.float32), spec, coord, comms)
    with pytest.raises(DTypeError, match="does not match"):
        E.execute(steps, np.zeros(spec.local_shape(coord), np.float64), spec, coord, comms)


def test_avg_of_integers_raises_on_every_rank(meshes):
    coord, comms = meshes[(WORLD,)]
    spec = DTensorSpec(MeshShape((WORLD,)), (Partial("avg"),), (4, 2), np.int64)
    with pytest.raises(DTypeError, match="avg"):
        E.execute(plan(spec, (Replicate(),)), np.ones((4, 2), np.int64), spec, coord, comms)
    MPI.COMM_WORLD.Barrier()  # every rank got here: nobody is stuck in a collective


def test_program_cache_is_bounded_and_frees_types(meshes, seed, monkeypatch):
    coord, comms = meshes[(WORLD,)]
    EP.PROGRAMS.clear()
    freed = []
    real_free = C.free_types
    monkeypatch.setattr(C, "free_types", lambda types: (freed.extend(types), real_free(types)))
    monkeypatch.setattr(EP.PROGRAMS, "maxsize", 3)
    for name, value in PATHS["typed"].items():
        monkeypatch.setattr(EP, name, value)
    made = 0
    for rows in range(2, 10):  # 8 distinct programs; gathering dim 1 needs derived types
        data = global_data((rows, 4 * WORLD + 1), np.float32, seed)
        check_pair(data, (Shard(1),), (Replicate(),), (WORLD,), coord, comms, seed)
        assert len(EP.PROGRAMS) == min(rows - 1, 3)
        made += sum(len(runner.types) for runner in next(reversed(EP.PROGRAMS.data.values())))
    kept = sum(len(runner.types) for program in EP.PROGRAMS.data.values() for runner in program)
    assert len(freed) == made - kept  # evicted programs released their types
    EP.PROGRAMS.clear()
    assert len(freed) == made and not EP.PROGRAMS
    assert made == (8 * (WORLD - 1) if WORLD > 1 else 0)


# -- scatter_from -------------------------------------------------------------------------


# float32 on every shape; int64 and bool (their own Partial identities) on two each
SCATTER_CASES = [(shape, np.float32) for shape in ((8, 6), (5, 3), (1, 7), (0, 4), (4, 5, 3))]
SCATTER_CASES += [((5, 3), np.int64), ((1, 7), np.int64), ((8, 6), np.bool_), ((0, 4), np.bool_)]


@pytest.mark.parametrize(("shape", "dtype"), SCATTER_CASES, ids=_id)
def test_scatter_from(shape, dtype, meshes, seed):
    """Every rank gets its block (holders of a Partial value: the data; the others: the
    identity) and the blocks of all ranks represent the data."""
    world = C.world()
    data = global_data(shape, dtype, seed)
    for mesh_shape, (coord, _) in meshes.items():
        lists = placement_lists(mesh_shape, dtype) + [(Partial("prod"),) * len(mesh_shape)]
        if len(mesh_shape) == 2:
            lists += [(Partial("prod"), Partial("sum")), (Partial("sum"), Partial("prod"))]
        pending = []
        for placements in lists:
            spec = DTensorSpec(MeshShape(mesh_shape), placements, shape, np.dtype(dtype))
            for src in sorted({0, WORLD - 1}):
                out = E.scatter_from(src, data if world.rank == src else None, spec, coord, world)
                assert out.dtype == data.dtype and out.flags.c_contiguous
                assert out.shape == spec.local_shape(coord)
                if partial_fill(placements, coord) is None:
                    want = data[local_slices(shape, mesh_shape, placements, coord)]
                    np.testing.assert_array_equal(out, want, err_msg=f"{spec!r} from {src}")
                pending.append((spec, out, f"{spec!r} from {src}"))
        check_pending(data, pending, coord)


def test_scatter_from_uses_one_collective_after_the_metadata(meshes, seed, observed):
    world = C.world()
    coord, _ = meshes[(WORLD,)]
    data = global_data((6, 4), np.float32, seed)
    for placements, kind in [((Shard(0),), "scatter"), ((Replicate(),), "broadcast")]:
        observed.clear()
        spec = DTensorSpec(MeshShape((WORLD,)), placements, data.shape, data.dtype)
        E.scatter_from(0, data if world.rank == 0 else None, spec, coord, world)
        assert [k for k, _, _ in observed] == ["all_gather_ints", kind]


def test_scatter_from_bad_source_raises_everywhere(meshes):
    world = C.world()
    coord, _ = meshes[(WORLD,)]
    spec = DTensorSpec(MeshShape((WORLD,)), (Shard(0),), (6, 4), np.float32)
    with pytest.raises(ShardingError, match="source rank 0"):
        E.scatter_from(0, np.zeros((5, 4), np.float32), spec, coord, world)
