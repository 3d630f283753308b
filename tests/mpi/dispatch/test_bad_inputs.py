"""Bad inputs under MPI: every rank raises the catalogued error with a useful message.

Each case asserts the error type (a :mod:`dtensor.errors` type), message fragments naming
the op, the values and the placements/mesh, and that the inputs are unchanged afterwards.
Checks that are collective (``from_local(run_check=True)``, mesh creation) raise on every
rank even when only one rank's input is bad, so no rank is left waiting. Checks of op
arguments against global specs (dims, product shapes, dtypes) raise on every rank before any
collective runs (:func:`expect_no_comm`).
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import dtensor as dt
from dtensor import errors

WORLD = MPI.COMM_WORLD
W = WORLD.size
R, S, P = dt.Replicate(), dt.Shard, dt.Partial
A = np.arange(4 * 6, dtype=np.float32).reshape(4, 6)


@pytest.fixture(scope="module")
def mesh():
    return dt.init_device_mesh((W,))


def local_copy(x):
    return np.array((x.to_local() if isinstance(x, dt.DTensor) else x).numpy(), copy=True)


def expect(fn, exc, *fragments, unchanged=()):
    """``fn()`` raises ``exc`` on this rank, its message holds every fragment, and the
    tensors in ``unchanged`` keep their local values."""
    before = [(x, local_copy(x)) for x in unchanged]
    with pytest.raises(exc) as info:
        fn()
    msg = str(info.value)
    for frag in fragments:
        assert frag in msg, f"{frag!r} not in {msg!r}"
    for x, values in before:
        np.testing.assert_array_equal(local_copy(x), values)
    # every rank raised (a rank that did not would fail above, and the harness aborts)
    WORLD.Barrier()


def expect_no_comm(fn, exc, *fragments, unchanged=()):
    """As :func:`expect`, and ``fn`` issued no collective on this rank before raising."""
    mode = dt.debug.CommDebugMode()

    def observed():
        with mode:
            fn()

    expect(observed, exc, *fragments, unchanged=unchanged)
    assert mode.get_total_counts() == 0, mode.table()


def x_of(mesh, placements=None, arr=A):
    return dt.distribute_tensor(arr, mesh, placements or [S(0)])


# -- meshes -------------------------------------------------------------------------------


@pytest.mark.mpi(min_size=1)
def test_mesh_shape_not_matching_world_size():
    expect(
        lambda: dt.init_device_mesh((W + 1,)),
        errors.MeshError,
        f"mesh shape ({W + 1},)",
        f"needs {W + 1} ranks",
        f"has {W}",
    )


@pytest.mark.mpi(min_size=1)
def test_mesh_shape_with_zero():
    expect(lambda: dt.init_device_mesh((0,)), errors.MeshError, "(0,)", "0 ranks")


@pytest.mark.mpi(min_size=1)
def test_mesh_duplicate_dim_names():
    expect(
        lambda: dt.init_device_mesh((W, 1), mesh_dim_names=("a", "a")),
        errors.MeshError,
        "('a', 'a')",
        "not unique",
    )


@pytest.mark.mpi(min_size=1)
def test_mesh_dim_names_count():
    expect(
        lambda: dt.init_device_mesh((W,), mesh_dim_names=("a", "b")),
        errors.MeshError,
        "2 mesh_dim_names",
        f"1-D mesh of shape ({W},)",
    )


@pytest.mark.mpi(min_size=1)
def test_mesh_unknown_dim_name(mesh):
    expect(lambda: mesh["nope"], errors.MeshError, "'nope'")


@pytest.mark.mpi(min_size=1)
def test_mesh_dim_out_of_range(mesh):
    expect(lambda: mesh.size(5), errors.MeshError, "mesh dim 5", f"({W},)")


@pytest.mark.mpi(min_size=1)
def test_mesh_of_floats():
    expect(lambda: dt.DeviceMesh("cpu", np.arange(W) + 0.5), errors.MeshError, "integer", "float64")


@pytest.mark.mpi(min_size=2)
def test_mesh_with_duplicate_ranks():
    expect(
        lambda: dt.DeviceMesh("cpu", [0] * W),
        errors.MeshError,
        f"ranks {[0] * W}",
        f"size {W}",
    )


@pytest.mark.mpi(min_size=1)
def test_gap_mesh_unknown_device_type():
    expect(lambda: dt.DeviceMesh("tpu", list(range(W))), errors.MeshError, "'tpu'")


# -- distribute_tensor, factories, from_local ---------------------------------------------


@pytest.mark.mpi(min_size=1)
def test_distribute_shard_dim_out_of_range(mesh):
    expect(
        lambda: dt.distribute_tensor(A, mesh, [S(2)]),
        errors.PlacementError,
        "Shard(dim=2)",
        "shape (4, 6)",
        "[S(2)]",
    )


@pytest.mark.mpi(min_size=1)
def test_distribute_too_many_placements(mesh):
    expect(
        lambda: dt.distribute_tensor(A, mesh, [S(0), R]),
        errors.PlacementError,
        "distribute_tensor",
        "2 placements [S(0), R]",
        f"1-D mesh of shape ({W},)",
    )


@pytest.mark.mpi(min_size=1)
def test_distribute_not_a_placement(mesh):
    expect(
        lambda: dt.distribute_tensor(A, mesh, ["S0"]),
        errors.PlacementError,
        "distribute_tensor",
        "'S0' is not a placement",
    )


@pytest.mark.mpi(min_size=1)
def test_distribute_source_rank_not_in_mesh(mesh):
    expect(
        lambda: dt.distribute_tensor(A, mesh, [S(0)], src_data_rank=W + 3),
        errors.MeshError,
        f"src_data_rank={W + 3}",
    )


@pytest.mark.mpi(min_size=1)
def test_factory_shard_dim_out_of_range(mesh):
    expect(
        lambda: dt.zeros(4, 6, device_mesh=mesh, placements=[S(2)]),
        errors.PlacementError,
        "Shard(dim=2)",
        "(4, 6)",
    )


@pytest.mark.mpi(min_size=1)
def test_random_factory_placements_length(mesh):
    expect(
        lambda: dt.rand(4, 6, device_mesh=mesh, placements=[S(0), S(1)]),
        errors.PlacementError,
        "rand",
        "2 placements [S(0), S(1)]",
    )


@pytest.mark.mpi(min_size=1)
def test_from_local_placements_length(mesh):
    expect(
        lambda: dt.DTensor.from_local(dt.ones(3), mesh, [R, R]),
        errors.PlacementError,
        "from_local",
        "2 placements [R, R]",
    )


@pytest.mark.mpi(min_size=1)
def test_from_local_shard_dim_beyond_local_ndim(mesh):
    expect(
        lambda: dt.DTensor.from_local(dt.ones(3), mesh, [S(1)]),
        errors.ShardDimError,
        "from_local",
        "Shard(dim=1)",
        "(3,)",
    )


@pytest.mark.mpi(min_size=1)
def test_from_local_local_shape_not_matching_given_shape(mesh):
    # every rank's shard is wrong (one row too many); the check is local with shape=
    rows = -(-4 // W) + 1
    expect(
        lambda: dt.DTensor.from_local(dt.ones(rows, 6), mesh, [S(0)], shape=(4, 6)),
        errors.ShardingError,
        "from_local",
        f"local shape ({rows}, 6)",
        "global shape (4, 6)",
        "[S(0)]",
    )


@pytest.mark.mpi(min_size=2)
def test_from_local_run_check_shape_on_one_rank_raises_everywhere(mesh):
    n = 2 * W
    rows = 3 if WORLD.rank == W - 1 else 2  # only the last rank is wrong
    local = dt.ones(rows, 6)
    expect(
        lambda: dt.DTensor.from_local(local, mesh, [S(0)], shape=(n, 6), run_check=True),
        errors.ShardingError,
        "from_local(run_check=True)",
        f"global shape ({n}, 6)",
        "[S(0)]",
        f"(rank {W - 1}): local float32 (3, 6), expected float32 (2, 6)",
        unchanged=[local],
    )


@pytest.mark.mpi(min_size=2)
def test_from_local_run_check_dtype_on_one_rank_raises_everywhere(mesh):
    dtype = dt.float64 if WORLD.rank == 1 else dt.float32
    expect(
        lambda: dt.DTensor.from_local(
            dt.ones(2, 6, dtype=dtype), mesh, [S(0)], shape=(2 * W, 6), run_check=True
        ),
        errors.ShardingError,
        "run_check=True",
        "[S(0)]",
        # each rank compares with its own dtype: both dtypes are named
        "float64 (2, 6)",
        "float32 (2, 6)",
    )


# -- redistribute -------------------------------------------------------------------------


@pytest.mark.mpi(min_size=1)
def test_redistribute_to_shard_out_of_range(mesh):
    x = x_of(mesh)
    expect(
        lambda: x.redistribute(mesh, [S(3)]),
        errors.ShardDimError,
        "Shard(dim=3)",
        "(4, 6)",
        unchanged=[x],
    )
    assert x.placements == (S(0),)


@pytest.mark.mpi(min_size=1)
def test_redistribute_wrong_placement_count(mesh):
    x = x_of(mesh)
    expect(
        lambda: x.redistribute(mesh, [R, R]),
        errors.PlacementError,
        "redistribute",
        "2 placements [R, R]",
        unchanged=[x],
    )


@pytest.mark.mpi(min_size=1)
def test_redistribute_not_a_placement(mesh):
    x = x_of(mesh)
    expect(lambda: x.redistribute(mesh, ["R"]), errors.PlacementError, "'R' is not a placement")


@pytest.mark.mpi(min_size=1)
def test_redistribute_to_another_mesh(mesh):
    other = dt.init_device_mesh((W, 1))
    x = x_of(mesh)
    expect(
        lambda: x.redistribute(other, [R, R]),
        errors.MeshError,
        "redistribute",
        "another mesh",
        "[S(0)]",
        unchanged=[x],
    )


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", ["int64", "uint8", "bool"])
@pytest.mark.parametrize("route", ["from_local", "distribute_tensor", "distribute_local",
                                   "factory", "redistribute"])
def test_partial_avg_of_a_non_float_dtype_is_refused_where_it_is_built(mesh, route, dtype):
    # an average of integers has no exact integer value: refused when the DTensor is built
    # (not at its first reduction), before any collective, naming the op, dtype, placements
    ones = np.ones(3, dtype)
    dtype = getattr(dt, dtype)
    x = dt.distribute_tensor(ones, mesh, [R])
    fn, op = {
        "from_local": (lambda: dt.DTensor.from_local(dt.from_numpy(ones), mesh, [P("avg")]),
                       "DTensor.from_local"),
        "distribute_tensor": (lambda: dt.distribute_tensor(ones, mesh, [P("avg")]),
                              "distribute_tensor"),
        "distribute_local": (
            lambda: dt.distribute_tensor(ones, mesh, [P("avg")], src_data_rank=None),
            "distribute_tensor"),
        "factory": (lambda: dt.ones(3, dtype=dtype, device_mesh=mesh, placements=[P("avg")]),
                    "dt.ones"),
        "redistribute": (lambda: x.redistribute(mesh, [P("avg")]), "redistribute"),
    }[route]
    check = expect if route == "distribute_tensor" else expect_no_comm  # (the shape bcast)
    check(fn, errors.DTypeError, op, np.dtype(dtype).name, "[P(avg)]", "Partial(avg)",
          unchanged=[x])


@pytest.mark.mpi(min_size=1)
def test_no_op_makes_an_integer_partial_avg(mesh):
    # a float P(avg) summed to int64 is reduced first (no int P(avg) output); an int operand
    # of a float P(avg) may still be split into it (it keeps its value everywhere)
    r = mesh.get_coordinate()[0]
    f = dt.DTensor.from_local(dt.full((3,), 0.75 + r), mesh, [P("avg")])  # 0.75 + (W-1)/2
    s = f.sum(dtype=dt.int64)
    assert s.placements != (P("avg"),) and s.dtype == dt.int64
    assert s.full_tensor().item() == 3 * int(0.75 + (W - 1) / 2)
    y = f + dt.distribute_tensor(np.arange(3), mesh, [R])
    # (at one rank the cost model may as well reduce first: both are free there)
    assert y.placements == (P("avg"),) or W == 1, y.placements
    assert y.dtype == dt.float32
    np.testing.assert_allclose(y.full_tensor().numpy(), 0.75 + (W - 1) / 2 + np.arange(3))


@pytest.mark.mpi(min_size=1)
def test_partial_max_of_complex(mesh):
    p = dt.DTensor.from_local(dt.ones(3, dtype=dt.complex64), mesh, [P("max")])
    expect(p.full_tensor, errors.DTypeError, "'max'", "complex64", "P(max) -> R", unchanged=[p])


# -- ops ----------------------------------------------------------------------------------


@pytest.mark.mpi(min_size=1)
def test_operands_on_different_meshes(mesh):
    x, y = x_of(mesh), x_of(dt.init_device_mesh((W, 1)), [S(0), R])
    expect(lambda: x + y, errors.MeshError, "add", "different meshes", unchanged=[x, y])


@pytest.mark.mpi(min_size=1)
def test_shapes_do_not_broadcast(mesh):
    x, y = x_of(mesh), x_of(mesh, [R], np.ones((4, 5), np.float32))
    expect(
        lambda: x * y,
        errors.ShardingError,
        "mul",
        "(4, 6) and (4, 5)",
        "DTensor([S(0)], shape (4, 6), float32)",
        "DTensor([R], shape (4, 5), float32)",
        f"mesh ({W},)",
        unchanged=[x, y],
    )


@pytest.mark.mpi(min_size=1)
def test_inplace_broadcast_leaves_inputs_unchanged(mesh):
    x, y = x_of(mesh), x_of(mesh, [R], np.ones((2, 4, 6), np.float32))
    expect(lambda: x.add_(y), errors.ShardingError, "add_", "[2, 4, 6]", "[S(0)]", unchanged=[x, y])


@pytest.mark.mpi(min_size=1)
def test_inplace_dtype_leaves_inputs_unchanged(mesh):
    x = x_of(mesh, [S(0)], np.arange(8).reshape(4, 2))
    y = x_of(mesh, [R], np.ones((4, 2), np.float32))
    expect(lambda: x.add_(y), errors.DTypeError, "add_", "float32", "int64", unchanged=[x, y])


@pytest.mark.mpi(min_size=1)
def test_inplace_sqrt_of_ints(mesh):
    x = x_of(mesh, [S(0)], np.arange(8).reshape(4, 2))
    expect(x.sqrt_, errors.DTypeError, "sqrt_", "int64", unchanged=[x])


@pytest.mark.mpi(min_size=1)
def test_mean_of_ints(mesh):
    x = x_of(mesh, [S(0)], np.arange(8))
    expect(x.mean, errors.DTypeError, "mean", "int64", unchanged=[x])


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize(
    "op, call",
    [
        ("sum", lambda x: x.sum(dim=3)),
        ("softmax", lambda x: dt.softmax(x, dim=3)),
        ("transpose", lambda x: x.transpose(3, 0)),
        ("squeeze", lambda x: x.squeeze(3)),
        ("cat", lambda x: dt.cat([x, x], dim=3)),
        ("cumsum", lambda x: x.cumsum(3)),
    ],
    ids=["sum", "softmax", "transpose", "squeeze", "cat", "cumsum"],
)
def test_dim_out_of_range(mesh, op, call):
    x = x_of(mesh)
    expect_no_comm(
        lambda: call(x),
        errors.DimError,
        f"{op}: Dimension out of range (expected to be in range of [-2, 1], but got 3)",
        unchanged=[x],
    )


@pytest.mark.mpi(min_size=1)
def test_dim_out_of_range_is_still_an_index_error(mesh):
    x = x_of(mesh)
    expect(lambda: x.size(-3), IndexError, "Dimension out of range", "got -3")


@pytest.mark.mpi(min_size=1)
def test_view_bad_size(mesh):
    x = x_of(mesh)
    expect(lambda: x.view(5, 5), errors.ViewError, "[5, 5]", "size 24", unchanged=[x])


@pytest.mark.mpi(min_size=1)
def test_advanced_indexing_with_a_dtensor_index(mesh):
    # a DTensor index is gathered (as nonzero gathers) and indexes as its values; a float
    # one then raises on every rank as a float ndarray does
    x = x_of(mesh)
    i = dt.distribute_tensor(np.array([0, 1]), mesh, [dt.Replicate()] * mesh.ndim)
    np.testing.assert_array_equal(x[i].full_tensor().numpy(), A[[0, 1]])
    f = dt.distribute_tensor(np.array([0.0, 1.0]), mesh, [dt.Replicate()] * mesh.ndim)
    expect(lambda: x[f], errors.DTypeError, "float64")


@pytest.mark.mpi(min_size=1)
def test_where_with_float_condition(mesh):
    x = x_of(mesh)
    expect(lambda: dt.where(x, x, x), errors.DTypeError, "where", "boolean")


@pytest.mark.mpi(min_size=1)
def test_matmul_mismatch_names_global_shapes(mesh):
    x, w = x_of(mesh), x_of(mesh, [R], np.ones((5, 2), np.float32))
    expect_no_comm(
        lambda: x @ w,
        errors.ShardingError,
        "matmul: shapes (4, 6) and (5, 2) cannot be multiplied (6 != 5)",
        "DTensor([S(0)], shape (4, 6), float32)",
        "DTensor([R], shape (5, 2), float32)",
        f"mesh ({W},)",
        unchanged=[x, w],
    )


@pytest.mark.mpi(min_size=1)
def test_mm_of_two_sharded_operands_raises_before_redistributing(mesh):
    # both S(0): any strategy would gather first; the shapes are refused before that
    x, y = x_of(mesh), x_of(mesh, [S(1)])
    expect_no_comm(
        lambda: dt.mm(x, y),
        errors.ShardingError,
        "mm: shapes (4, 6) and (4, 6) cannot be multiplied (6 != 4)",
        "[S(0)]",
        "[S(1)]",
        unchanged=[x, y],
    )


@pytest.mark.mpi(min_size=1)
def test_bmm_batch_mismatch_names_global_shapes(mesh):
    a = x_of(mesh, [S(0)], np.ones((2 * W, 3, 4), np.float32))
    b = x_of(mesh, [R], np.ones((2 * W + 1, 4, 5), np.float32))
    expect_no_comm(
        lambda: dt.bmm(a, b),
        errors.ShardingError,
        f"bmm: shapes ({2 * W}, 3, 4) and ({2 * W + 1}, 4, 5)",
        f"({2 * W} != {2 * W + 1})",
        unchanged=[a, b],
    )


@pytest.mark.mpi(min_size=1)
def test_einsum_mismatch_names_global_shapes(mesh):
    x = x_of(mesh)
    expect_no_comm(
        lambda: dt.einsum("ij,jk->ik", x, x),
        errors.ShardingError,
        "einsum: subscript 'j' of equation 'ij,jk->ik' is 6",
        "shape (4, 6)",
        "[S(0)]",
        unchanged=[x],
    )


@pytest.mark.mpi(min_size=1)
def test_embedding_with_float_indices(mesh):
    idx, w = x_of(mesh), x_of(mesh, [R])
    expect_no_comm(
        lambda: dt.embedding(idx, w),
        errors.DTypeError,
        "embedding",
        "integer",
        "float32",
        unchanged=[idx, w],
    )


@pytest.mark.mpi(min_size=1)
def test_embedding_index_outside_the_global_rows_of_a_row_sharded_weight(mesh):
    # every rank holds some rows (or none); index 9 is outside all 4 rows on every rank
    idx = x_of(mesh, [R], np.array([[0, 1], [2, 9]]))
    w = x_of(mesh, [S(0)], np.arange(24, dtype=np.float32).reshape(4, 6))
    expect(lambda: dt.embedding(idx, w), errors.DimError, "embedding", "index 9",
           "num_embeddings 4", unchanged=[idx, w])


@pytest.mark.mpi(min_size=1)
def test_select_index_outside_the_global_size(mesh):
    x = x_of(mesh)  # S(0): selecting on dim 0 would gather first; the index is checked before
    expect_no_comm(lambda: x.select(0, 9), errors.DimError, "select", "index 9", "size [4, 6]",
                   unchanged=[x])
    np.testing.assert_array_equal(x.select(0, -1).full_tensor().numpy(), A[-1])


@pytest.mark.mpi(min_size=1)
def test_from_local_of_a_string(mesh):
    expect(
        lambda: dt.DTensor.from_local("abc", mesh, [R]),
        errors.DTypeError,
        "DTensor.from_local",
        "got a str",
    )


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize(
    "name,fn",
    [
        ("add", lambda x: x + 2**70),
        ("sub", lambda x: 2**70 - x),
        ("mul", lambda x: x * -(2**64)),
        ("add", lambda x: x.add_(2**70)),
        ("clamp", lambda x: x.clamp(0, 2**70)),
    ],
)
def test_python_int_beyond_64_bits_names_the_op(mesh, name, fn):
    x = dt.distribute_tensor(np.arange(4 * W, dtype=np.int32), mesh, [S(0)])
    expect(lambda: fn(x), errors.DTypeError, f"{name}: the python int", "int32",
           unchanged=[x])
    expect(lambda: fn(x.to_local()), errors.DTypeError, f"{name}: the python int",
           unchanged=[x])
