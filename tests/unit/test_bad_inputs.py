"""Bad inputs in one process: each raises the catalogued error type with a useful message.

Every case gives a callable, the expected type (a :mod:`dtensor.errors` type), the message
fragments that must appear (the op, the values, the placements), and the tensors that must
be unchanged afterwards (a failed op, in-place ones included, writes nothing).

DTensors live on simulated meshes (see ``test_dispatch.py``) whose communicators are None:
an op that tried to communicate would fail with an AttributeError, so a catalogued error
from a DTensor op here also shows that it was raised before any communication.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_dispatch import SimMesh, dtensor_of

import dtensor as dt
from dtensor import errors
from placements import Partial, Replicate, Shard
from placements.spec import DTensorSpec
from redistribute import comm as _comm
from redistribute.plan import plan

R = Replicate()
S0 = Shard(0)
A = np.arange(24, dtype=np.float32).reshape(4, 6)
MESH = SimMesh((2,))
OTHER = SimMesh((2,), name="other")


def t():
    return dt.tensor(A.copy())


def d(arr=A, placements=(S0,), mesh=MESH):
    return dtensor_of(np.asarray(arr), mesh, placements)


def snapshot(*tensors):
    return [(x, np.array(_local(x).numpy(), copy=True)) for x in tensors]


def _local(x):
    return x.to_local() if isinstance(x, dt.DTensor) else x


def expect(fn, exc, *fragments, unchanged=()):
    """``fn()`` raises ``exc`` whose message holds every fragment; ``unchanged`` keep values."""
    before = snapshot(*unchanged)
    with pytest.raises(exc) as info:
        fn()
    msg = str(info.value)
    for frag in fragments:
        assert frag in msg, f"{frag!r} not in {msg!r}"
    for x, values in before:
        np.testing.assert_array_equal(_local(x).numpy(), values)
    return info.value


# -- placements, specs, plans ---------------------------------------------------------------


def test_shard_dim_not_int():
    expect(lambda: Shard("x"), errors.PlacementError, "Shard(dim='x')", "int")


def test_partial_unknown_op():
    expect(lambda: Partial("foo"), errors.PlacementError, "'foo'", "sum, avg, max, min")


def test_spec_placements_length_not_mesh_ndim():
    expect(
        lambda: DTensorSpec(MESH, [Shard(0), R], (4, 6), np.float32),
        errors.PlacementError,
        "2 placements [S(0), R]",
        "1-D mesh of shape (2,)",
    )


def test_spec_shard_dim_out_of_range():
    expect(
        lambda: DTensorSpec(MESH, [Shard(3)], (4, 6), np.float32),
        errors.ShardDimError,
        "Shard(dim=3)",
        "2-D tensor of shape (4, 6)",
    )


def test_plan_to_invalid_target():
    spec = DTensorSpec(MESH, [Shard(0)], (4, 6), np.float32)
    expect(lambda: plan(spec, (Shard(5),)), errors.ShardDimError, "Shard(dim=5)", "(4, 6)")


# -- local tensors --------------------------------------------------------------------------


def test_view_incompatible_with_strides():
    x = t()
    expect(lambda: x.T.view(24), errors.ViewError, "view size is not compatible", ".reshape(")


def test_view_bad_size():
    x = t()
    expect(lambda: x.view(5, 5), errors.ViewError, "[5, 5]", "size 24", unchanged=[x])


def test_reshape_bad_size():
    expect(lambda: t().reshape(7, -1), errors.ViewError, "[7, -1]", "size 24")


def test_view_two_inferred_dims():
    expect(lambda: t().view(-1, -1), errors.ViewError, "only one dimension can be inferred")


def test_expand_bad():
    expect(lambda: t().expand(3, 4, 7), errors.ViewError, "expanded size", "(7)", "(6)")


def test_permute_duplicate_dims():
    expect(lambda: t().permute(0, 0), errors.ViewError, "permute", "[0, 0]")


def test_narrow_out_of_range():
    expect(lambda: t().narrow(0, 3, 4), errors.ViewError, "start (3)", "length (4)")


def test_sum_dim_out_of_range():
    expect(lambda: t().sum(dim=3), IndexError, "Dimension out of range", "got 3")


def test_transpose_dim_out_of_range():
    expect(lambda: t().transpose(0, 5), IndexError, "[-2, 1]", "got 5")


def test_index_out_of_range():
    expect(lambda: t()[10], IndexError, "index 10", "size 4")


def test_bitwise_on_float():
    expect(lambda: dt.bitwise_and(t(), t()), errors.DTypeError, "bitwise_and", "Float")


def test_softmax_on_int():
    expect(lambda: dt.softmax(dt.tensor(np.arange(4)), dim=0), errors.DTypeError, "softmax", "Long")


def test_mean_of_int():
    expect(lambda: dt.tensor(np.arange(4)).mean(), errors.DTypeError, "mean", "Long")


def test_where_float_condition():
    expect(lambda: dt.where(t(), t(), t()), errors.DTypeError, "where", "boolean", "Float")


def test_matmul_0d():
    expect(lambda: dt.matmul(dt.tensor(1.0), t()), errors.ShardingError, "matmul", "0D and 2D")


def test_cat_mismatched():
    expect(
        lambda: dt.cat([t(), dt.ones(3, 5)], dim=0),
        errors.ShardingError,
        "cat",
        "Expected size 6 but got size 5",
    )


def test_inplace_dtype_leaves_input_unchanged():
    x = dt.tensor(np.arange(4))
    expect(lambda: x.add_(dt.ones(4)), errors.DTypeError, "add", "Long", unchanged=[x])


def test_inplace_broadcast_leaves_input_unchanged():
    x = t()
    expect(
        lambda: x.mul_(dt.ones(2, 4, 6)), errors.ShardingError, "mul", "[2, 4, 6]", unchanged=[x]
    )


def test_default_dtype_int():
    expect(lambda: dt.set_default_dtype(dt.int64), errors.DTypeError, "set_default_dtype", "int64")


def test_unknown_dtype():
    expect(lambda: dt.zeros(3, dtype="float128x"), errors.DTypeError, "'float128x'")


# -- DTensors on a simulated mesh (dispatcher and rules, no communication) -------------------


def test_operands_on_different_meshes():
    x, y = d(), d(mesh=OTHER)
    expect(lambda: x + y, errors.MeshError, "add", "different meshes", unchanged=[x, y])


def test_shapes_that_do_not_broadcast_name_global_shapes_and_placements():
    x, y = d(), d(np.ones((4, 5), np.float32), (R,))
    expect(
        lambda: x + y,
        errors.ShardingError,
        "add",
        "(4, 6)",
        "(4, 5)",
        "[S(0)]",
        "[R]",
        unchanged=[x, y],
    )


def test_inplace_broadcast_on_dtensor_names_specs_and_leaves_input_unchanged():
    x, y = d(), d(np.ones((2, 4, 6), np.float32), (R,))
    expect(
        lambda: x.add_(y),
        errors.ShardingError,
        "add_",
        "[4, 6]",
        "[2, 4, 6]",
        "[S(0)]",
        unchanged=[x, y],
    )


def test_inplace_dtype_on_dtensor_leaves_input_unchanged():
    x, y = d(np.arange(8).reshape(4, 2)), d(np.ones((4, 2), np.float32))
    expect(lambda: x.add_(y), errors.DTypeError, "add_", "int64", unchanged=[x, y])


def test_dtensor_dim_out_of_range():
    x = d()
    expect(lambda: x.sum(dim=3), IndexError, "Dimension out of range", "got 3", unchanged=[x])


def test_dtensor_softmax_dim_out_of_range():
    expect(lambda: dt.softmax(d(), dim=2), IndexError, "got 2")


def test_dtensor_cat_mismatched_names_specs():
    x, y = d(), d(np.ones((4, 5), np.float32))
    expect(
        lambda: dt.cat([x, y], dim=0),
        errors.ShardingError,
        "cat",
        "(4, 6), (4, 5)",
        "DTensor([S(0)], shape (4, 6), float32)",
    )


def test_dtensor_sum_repeated_dim():
    expect(lambda: d().sum(dim=(0, 0)), errors.ShardingError, "sum", "[0, 0]", "multiple")


def test_dtensor_bitwise_on_float():
    expect(lambda: dt.bitwise_and(d(), d()), errors.DTypeError, "bitwise_and", "Float")


def test_no_rule_advanced_indexing():
    x = d()
    expect(lambda: x[[0, 1]], errors.NoRuleError, "__getitem__", "advanced indexing", "[0, 1]")


def test_no_rule_max_of_two_dtensors_with_hint():
    expect(lambda: d().max(d()), errors.NoRuleError, "max", "maximum(input, other)")


def test_no_rule_unknown_op_suggests_closest():
    from placements.rules import get_rule

    expect(lambda: get_rule("softmx"), errors.NoRuleError, "'softmx'", "'softmax'")


# -- the communication layer ----------------------------------------------------------------


def test_reduction_dtype_names_the_op_and_the_description():
    comm = _comm.world()
    buf = np.ones(3, np.complex64)
    expect(
        lambda: comm.allreduce(buf, op="max", what="redistribute step 1/1 P(max) -> R"),
        errors.DTypeError,
        "all_reduce (redistribute step 1/1 P(max) -> R)",
        "complex64",
        "'max'",
    )
    np.testing.assert_array_equal(buf, np.ones(3, np.complex64))


def test_reduction_avg_of_int():
    comm = _comm.world()
    expect(
        lambda: comm.allreduce(np.ones(3, np.int64), op="avg"),
        errors.DTypeError,
        "all_reduce",
        "'avg'",
        "int64",
    )


def test_unknown_reduce_op():
    expect(
        lambda: _comm.world().allreduce(np.ones(3), op="median"),
        errors.DTypeError,
        "'median'",
    )


def test_watchdog_env_not_a_number(monkeypatch):
    monkeypatch.setenv("DTENSOR_WATCHDOG", "soon")
    expect(_comm.configure_from_env, errors.ConfigError, "DTENSOR_WATCHDOG='soon'")
    monkeypatch.delenv("DTENSOR_WATCHDOG")
    _comm.configure_from_env()


def test_watchdog_non_positive_timeout():
    expect(lambda: _comm.set_watchdog(0), errors.ConfigError, "> 0", "0")


def test_remove_unknown_observer():
    expect(lambda: _comm.remove_observer(print), errors.CommError, "not a registered observer")


def test_mesh_comms_non_integer_grid():
    expect(
        lambda: _comm.make_mesh_comms(_comm.world(), np.array([0.5])),
        errors.MeshError,
        "integer",
        "float64",
    )


def test_catalogue_types_subclass_the_builtins():
    pairs = [
        (errors.ShardingError, ValueError),
        (errors.PlacementError, ValueError),
        (errors.MeshError, ValueError),
        (errors.ConfigError, ValueError),
        (errors.DTypeError, TypeError),
        (errors.ViewError, RuntimeError),
        (errors.CommError, RuntimeError),
        (errors.NoRuleError, NotImplementedError),
        (errors.DimError, IndexError),
        (errors.ShardDimError, errors.PlacementError),
        (errors.ShardDimError, errors.DimError),
    ]
    for sub, builtin in pairs:
        assert issubclass(sub, errors.DTensorError) and issubclass(sub, builtin)


# -- dims out of range: DimError naming the op, local and distributed alike ------------------

# (op named in the message, the call on a 2-D tensor of shape (4, 6), the bad dim, its range)
DIM_CASES = [
    ("sum", lambda x: x.sum(dim=3), 3, "[-2, 1]"),
    ("sum", lambda x: x.sum(dim=(0, -3)), -3, "[-2, 1]"),
    ("mean", lambda x: x.mean(dim=2), 2, "[-2, 1]"),
    ("amax", lambda x: dt.amax(x, dim=-3), -3, "[-2, 1]"),
    ("argmax", lambda x: x.argmax(dim=2), 2, "[-2, 1]"),
    ("max", lambda x: x.max(dim=2), 2, "[-2, 1]"),
    ("cumsum", lambda x: x.cumsum(dim=2), 2, "[-2, 1]"),
    ("softmax", lambda x: dt.softmax(x, dim=2), 2, "[-2, 1]"),
    ("log_softmax", lambda x: dt.log_softmax(x, dim=-3), -3, "[-2, 1]"),
    ("transpose", lambda x: x.transpose(0, 5), 5, "[-2, 1]"),
    ("permute", lambda x: x.permute(0, 2), 2, "[-2, 1]"),
    ("movedim", lambda x: x.movedim(2, 0), 2, "[-2, 1]"),
    ("squeeze", lambda x: x.squeeze(4), 4, "[-2, 1]"),
    ("unsqueeze", lambda x: x.unsqueeze(3), 3, "[-3, 2]"),
    ("flatten", lambda x: x.flatten(0, 2), 2, "[-2, 1]"),
    ("narrow", lambda x: x.narrow(2, 0, 1), 2, "[-2, 1]"),
    ("select", lambda x: x.select(-3, 0), -3, "[-2, 1]"),
    ("split", lambda x: x.split(2, dim=2), 2, "[-2, 1]"),
    ("unbind", lambda x: x.unbind(2), 2, "[-2, 1]"),
    ("cat", lambda x: dt.cat([x, x], dim=2), 2, "[-2, 1]"),
    ("stack", lambda x: dt.stack([x, x], dim=3), 3, "[-3, 2]"),
    ("flip", lambda x: dt.flip(x, (2,)), 2, "[-2, 1]"),
    ("roll", lambda x: dt.roll(x, 1, 2), 2, "[-2, 1]"),
]


@pytest.mark.parametrize("make", [t, d], ids=["Tensor", "DTensor"])
@pytest.mark.parametrize("op, fn, bad, valid", DIM_CASES, ids=[f"{c[0]}{c[2]}" for c in DIM_CASES])
def test_dim_out_of_range_is_a_dim_error_naming_op_value_and_range(make, op, fn, bad, valid):
    x = make()
    e = expect(
        lambda: fn(x),
        errors.DimError,
        f"{op}: Dimension out of range (expected to be in range of {valid}, but got {bad})",
        unchanged=[x],
    )
    assert isinstance(e, IndexError)  # what code that predates the catalogue catches


def test_local_index_out_of_range_is_a_dim_error_naming_the_op():
    x = t()
    before = x.numpy().copy()
    expect(lambda: x[10], errors.DimError, "__getitem__", "index 10", "dimension 0", "size 4")
    expect(lambda: x[:, 7], errors.DimError, "__getitem__", "index 7", "dimension 1", "size 6")
    expect(lambda: x[0, 0, 0], errors.DimError, "__getitem__", "too many indices", "tensor")
    expect(lambda: x[np.array([0, 9])], errors.DimError, "__getitem__", "index 9")
    expect(lambda: x.__setitem__(5, 1.0), errors.DimError, "__setitem__", "index 5")
    expect(lambda: dt.tensor(1.0)[0], errors.DimError, "__getitem__", "0-dimensional")
    np.testing.assert_array_equal(x.numpy(), before)  # a failed write changed nothing


def test_size_and_stride_dim_out_of_range():
    x = t()
    expect(lambda: x.size(2), errors.DimError, "size: Dimension out of range", "got 2")
    expect(lambda: x.stride(-3), errors.DimError, "stride:", "[-2, 1]", "got -3")
    expect(lambda: dt.tensor(1.0).size(0), errors.DimError, "size:", "no dimensions")
    y = d()
    expect(lambda: y.size(2), errors.DimError, "size:", "[-2, 1]", "got 2")
    expect(lambda: y.stride(-3), errors.DimError, "stride:", "[-2, 1]", "got -3")


@pytest.mark.parametrize(
    "make",
    [lambda: dt.tensor(1.0), lambda: dtensor_of(np.float32(1), MESH, (R,))],
    ids=["Tensor", "DTensor"],
)
def test_dim_of_a_0d_tensor_is_checked(make):
    # a 0-d tensor accepts dims 0 and -1 only (PyTorch's rule)
    x = make()
    assert float(_local(x.sum(dim=-1)).item()) == 1.0
    expect(lambda: x.sum(dim=1), errors.DimError, "sum:", "[-1, 0]", "got 1", unchanged=[x])
    expect(lambda: x.sum(dim=(0, -1)), errors.ShardingError, "sum", "multiple")


@pytest.mark.parametrize("make", [t, d], ids=["Tensor", "DTensor"])
def test_dim_that_is_not_an_int(make):
    x = make()
    expect(lambda: x.sum(dim=1.0), TypeError, "sum: dim must be an int", "float (1.0)")
    expect(lambda: x.transpose("a", 0), TypeError, "transpose:", "str ('a')")


def test_dtensor_getitem_out_of_bounds_is_a_dim_error():
    x = d()
    expect(lambda: x[:, 7], errors.DimError, "__getitem__", "index 7", "dimension 1", "size 6")
    expect(lambda: x[0, 0, 0], errors.DimError, "__getitem__", "too many indices", "2")


IDX = np.array([[0, 1], [2, 9]])  # 9 is out of range for the 4 rows of A


@pytest.mark.parametrize(
    "idx, w",
    [(lambda: dt.tensor(IDX), t), (lambda: d(IDX, (R,)), lambda: d(A, (R,)))],
    ids=["Tensor", "DTensor"],
)
def test_embedding_index_out_of_range_is_a_dim_error(idx, w):
    idx, w = idx(), w()
    expect(
        lambda: dt.embedding(idx, w),
        errors.DimError,
        "embedding",
        "index 9",
        "num_embeddings 4",
        unchanged=[idx, w],
    )


def test_embedding_index_out_of_range_with_row_sharded_weight():
    # indices outside the local rows give zeros (a P(sum) output); outside the GLOBAL rows
    # they raise, as the unsharded embedding does
    idx, w = d(IDX, (R,)), d(A, (S0,))
    expect(lambda: dt.embedding(idx, w), errors.DimError, "embedding", "index 9")


def test_dtensor_select_index_out_of_range_names_the_global_size():
    # the rule checks the index against the global size, before any redistribution
    x = d()
    expect(lambda: x.select(0, 9), errors.DimError, "select", "index 9", "size [4, 6]")


def test_cross_entropy_target_out_of_range_is_a_dim_error():
    x, target = t(), dt.tensor(np.array([0, 1, 7, 2]))
    expect(
        lambda: dt.cross_entropy(x, target),
        errors.DimError,
        "cross_entropy",
        "target 7",
        "0..5",
        unchanged=[x, target],
    )


# -- products: global shapes and placements, before any kernel or communication ---------------


def test_matmul_mismatch_names_global_shapes_and_placements():
    x, w = d(), d(np.ones((5, 2), np.float32), (R,))
    # the local shards are (2, 6): a local check would report (2, 6), not (4, 6)
    expect(
        lambda: x @ w,
        errors.ShardingError,
        "matmul: shapes (4, 6) and (5, 2) cannot be multiplied (6 != 5)",
        "DTensor([S(0)], shape (4, 6), float32)",
        "DTensor([R], shape (5, 2), float32)",
        "mesh (2,)",
        unchanged=[x, w],
    )


@pytest.mark.parametrize(
    "call, fragments",
    [
        (lambda: dt.mm(d(), d()), ["mm: shapes (4, 6) and (4, 6) cannot be multiplied (6 != 4)"]),
        (
            lambda: dt.bmm(d(np.ones((2, 3, 4), np.float32)), d(np.ones((3, 4, 5), np.float32))),
            ["bmm: shapes (2, 3, 4) and (3, 4, 5)", "(2 != 3)"],
        ),
        (
            lambda: dt.matmul(d(np.ones((2, 3, 4), np.float32)), d(np.ones((3, 4, 5)), (R,))),
            ["matmul: shapes (2, 3, 4) and (3, 4, 5)", "(2 != 3)", "[R]"],
        ),
        (
            lambda: dt.linear(d(), d(np.ones((3, 5), np.float32), (R,))),
            ["linear: shapes (4, 6) and (3, 5) cannot be multiplied (6 != 5)"],
        ),
        (
            lambda: dt.dot(d(np.ones(4, np.float32)), d(np.ones(5, np.float32), (R,))),
            ["dot: shapes (4,) and (5,)", "(4 != 5)"],
        ),
        (
            lambda: dt.addmm(d(np.ones((4, 3), np.float32), (R,)), d(), d(np.ones((5, 3)), (R,))),
            ["addmm: shapes (4, 6) and (5, 3)", "(6 != 5)"],
        ),
        (
            lambda: dt.einsum("ij,jk->ik", d(), d()),
            [
                (
                    "einsum: subscript 'j' of equation 'ij,jk->ik' is 6 in dim 1 of operand 0 "
                    "of shape (4, 6) but 4 in dim 0 of operand 1 of shape (4, 6)"
                )
            ],
        ),
        (
            lambda: dt.einsum(
                "...i,...i->...", d(np.ones((4, 3), np.float32)), d(np.ones((5, 3), np.float32))
            ),
            ["einsum: subscript '...'", "is 4 in dim 0 of operand 0 of shape (4, 3) but 5"],
        ),
    ],
    ids=["mm", "bmm-batch", "matmul-batch", "linear", "dot", "addmm", "einsum", "einsum-ellipsis"],
)
def test_product_mismatch_is_raised_from_global_shapes(call, fragments):
    # both operands sharded: a redistribution would come first (and fail on the simulated
    # mesh), so the ShardingError proves the check ran before any communication
    expect(call, errors.ShardingError, *fragments, "[op ", "inputs: DTensor([")


def test_product_rule_check_depends_only_on_global_shapes():
    # the message is a function of the global shapes: every rank, whatever its shard, and
    # every placement of the operands gives the same error
    from placements.rules import ArgMeta, OpSchema, get_rule

    msgs = set()
    for pa in [(R,), (S0,), (Shard(1),), (Partial("sum"),)]:
        for pb in [(R,), (S0,), (Shard(1),)]:
            args = (
                ArgMeta((4, 6), np.dtype(np.float32), pa),
                ArgMeta((5, 2), np.dtype(np.float32), pb),
            )
            with pytest.raises(errors.ShardingError) as info:
                get_rule("matmul")(OpSchema("matmul", args, (), (2,)))
            msgs.add(str(info.value))
    assert msgs == {"matmul: shapes (4, 6) and (5, 2) cannot be multiplied (6 != 5)"}


def test_einsum_broadcasts_size_one_like_the_local_kernel():
    # a size-1 operand dim broadcasts (numpy's einsum does): no error, same values
    a, b = np.arange(4, dtype=np.float32).reshape(4, 1), np.ones((3, 5), np.float32)
    got = dt.einsum("ij,jk->ik", d(a, (R,)), d(b, (R,)))
    np.testing.assert_array_equal(got.to_local().numpy(), np.einsum("ij,jk->ik", a, b))


# -- dtypes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [t, d], ids=["Tensor", "DTensor"])
def test_embedding_float_indices_is_a_dtype_error(make):
    idx, w = make(), make()
    expect(
        lambda: dt.embedding(idx, w),
        errors.DTypeError,
        "embedding",
        "integer",
        "float32",
        unchanged=[idx, w],
    )


@pytest.mark.parametrize("bad, kind", [("abc", "str"), (["a", "b"], "list"), (object(), "object")])
def test_from_local_of_non_numeric_data_names_the_op(bad, kind):
    expect(
        lambda: dt.DTensor.from_local(bad, MESH, [R]),
        errors.DTypeError,
        "DTensor.from_local",
        f"got a {kind}",
        "could not infer a dtype",
    )


@pytest.mark.parametrize("make", [t, d], ids=["Tensor", "DTensor"])
def test_unknown_dtype_argument_is_a_dtype_error(make):
    x = make()
    expect(lambda: x.sum(dtype="float128x"), errors.DTypeError, "'float128x'", unchanged=[x])
    expect(lambda: x.to("tpu"), errors.DTypeError, "'tpu'", unchanged=[x])


@pytest.mark.parametrize("make", [t, d], ids=["Tensor", "DTensor"])
def test_torch_dtype_names_mean_the_same_locally_and_distributed(make):
    # "float" is float32 (PyTorch), not numpy's float64, in the kernel and in the rule alike
    r = make().sum(dtype="float")
    assert r.dtype == dt.float32 and _local(r).dtype == dt.float32


# -- other unclear errors -------------------------------------------------------------------


@pytest.mark.parametrize("make", [t, d], ids=["Tensor", "DTensor"])
def test_unflatten_bad_sizes_names_the_op(make):
    x = make()
    expect(
        lambda: x.unflatten(1, (4, 2)),
        errors.ViewError,
        "unflatten",
        "[4, 2]",
        "dim 1 (6)",
        unchanged=[x],
    )


@pytest.mark.parametrize("make", [t, d], ids=["Tensor", "DTensor"])
def test_flip_repeated_dim(make):
    x = make()
    expect(
        lambda: dt.flip(x, (0, -2)),
        errors.ShardingError,
        "flip",
        "[0, -2]",
        "multiple",
        unchanged=[x],
    )
