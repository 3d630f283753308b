"""Bad inputs in one process: each raises the catalogued error type with a useful message.

Every case gives a callable, the expected type (a :mod:`dtensor.errors` type), the message
fragments that must appear (the op, the values, the placements), and the tensors that must
be unchanged afterwards (a failed op, in-place ones included, writes nothing).

DTensors live on simulated meshes (see ``test_dispatch.py``) whose communicators are None:
an op that tried to communicate would fail with an AttributeError, so a catalogued error
from a DTensor op here also shows that it was raised before any communication.
"""

from __future__ import annotations

import ast
import operator
import pathlib
import types

import numpy as np
import pytest
from helpers.sim import dtensor_of

import dtensor as dt
from dtensor import errors
from dtensor.dispatch import dispatcher as _dispatch
from dtensor.dispatch import entry_points as _dtensor_ops
from dtensor.local import rng as _random
from dtensor.local.tensor import wrap_array
from placements import Partial, Replicate, Shard
from placements.spec import DTensorSpec
from redistribute import comm as _comm
from redistribute.plan import plan

R = Replicate()
S0 = Shard(0)
A = np.arange(24, dtype=np.float32).reshape(4, 6)
MESH = dt.AbstractMesh((2,), coord=(0,))
OTHER = dt.AbstractMesh((2,), ("other",), coord=(0,))


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


def test_advanced_indexing_out_of_range():
    x = d()
    expect(lambda: x[[0, 99]], errors.DimError, "__getitem__", "index 99", "out of bounds")


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
        (errors.ArgumentError, ValueError),
        (errors.SignatureError, TypeError),
        (errors.ValueConversionError, RuntimeError),
        (errors.UnavailableError, errors.ConfigError),
        (errors.UnavailableError, RuntimeError),
        (errors.CheckpointError, OSError),
        (errors.AutogradError, RuntimeError),
        (errors.MetadataOnlyError, RuntimeError),
        (errors.AllocationError, MemoryError),
        (errors.PipelineError, errors.ArgumentError),
        (errors.PipelineError, ValueError),
    ]
    for sub, builtin in pairs:
        assert issubclass(sub, errors.DTensorError) and issubclass(sub, builtin)
    # every name of the catalogue is a DTensorError and is covered above
    classes = {getattr(errors, n) for n in errors.__all__} - {errors.DTensorError}
    assert all(issubclass(c, errors.DTensorError) for c in classes)
    assert classes == {sub for sub, _ in pairs}


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
    expect(
        lambda: dt.tensor(1.0)[0], errors.DimError, "__getitem__", "too many indices", "dimension 0"
    )
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


# -- every check raises a catalogue type --------------------------------------------------------
# ``except dt.errors.DTensorError`` catches each of these, and ``except <builtin>`` still does.

TARGET = np.array([0, 1, 2, 3])  # class indices for the 4 rows of A


def _block(kind, **bounds):
    return _random.random_block(kind, (4,), (0,), (4,), np.dtype(np.int64), 7, 0, np, **bounds)


def _device_tensor():
    """A tensor whose data is not a numpy array: a stand-in for a cupy array on cuda:0."""
    return wrap_array(types.SimpleNamespace(device=types.SimpleNamespace(id=0)))


def _sched() -> types.SimpleNamespace:
    """A stand-in with a pipeline schedule's attributes (no communicator: a check that
    communicated first would fail with an AttributeError)."""
    return types.SimpleNamespace(timeline=[], comm=None, pp_rank=0, pp_size=2, num_stages=2,
                                 n_microbatches=2)


# (id, the call, its catalogue type, the builtin it also is, message fragments)
CATALOGUE_CASES = [
    # debug tools
    ("explain-no-dtensor", lambda: dt.debug.explain(dt.add, t(), t()), errors.DTypeError,
     TypeError, ["explain: add() got no DTensor argument"]),
    ("explain-placements-count", lambda: dt.debug.explain(d()), errors.SignatureError,
     TypeError, ["explain(x, placements", "exactly the target placements"]),
    ("explain-not-placements", lambda: dt.debug.explain(d(), [1, 2]), errors.DTypeError,
     TypeError, ["explain(x, placements", "not a list of placements: [1, 2]"]),
    ("explain-not-callable", lambda: dt.debug.explain(42), errors.DTypeError, TypeError,
     ["explain: expected a DTensor, an op or a callable, got 42"]),
    ("visualize-local-tensor", lambda: dt.debug.visualize_sharding(t()), errors.DTypeError,
     TypeError, ["visualize_sharding: expected a DTensor or a DTensorSpec", "Tensor"]),
    ("visualize-schedule-not-one", lambda: dt.debug.visualize_schedule(t()), errors.DTypeError,
     TypeError, ["visualize_schedule: expected a dt.pipelining schedule, got Tensor",
                 "no timeline, comm"]),
    ("visualize-schedule-width", lambda: dt.debug.visualize_schedule(_sched(), width=4),
     errors.ArgumentError, ValueError, ["visualize_schedule: width=4 must be an int >= 8"]),
    ("visualize-schedule-rank", lambda: dt.debug.visualize_schedule(_sched(), rank=2),
     errors.ArgumentError, ValueError, ["visualize_schedule: rank=2 is not a pp rank of [0, 2)"]),
    # pointwise options
    ("gelu-approximate", lambda: dt.gelu(t(), approximate="fast"), errors.ArgumentError,
     ValueError, ["gelu: approximate", "'fast'"]),
    ("div-rounding-mode", lambda: dt.div(t(), 2, rounding_mode="round"), errors.ArgumentError,
     ValueError, ["div: expected rounding_mode", "'round'"]),
    ("clamp-no-bounds", lambda: dt.clamp(t()), errors.SignatureError, TypeError,
     ["clamp: at least one of 'min' or 'max'"]),
    # DTensor construction and protocols
    ("from-local-of-a-dtensor", lambda: dt.DTensor.from_local(d(), MESH, [R]),
     errors.DTypeError, TypeError, ["DTensor.from_local", "expected a local tensor or array"]),
    ("dtensor-constructor", lambda: dt.DTensor(), errors.SignatureError, TypeError,
     ["DTensor: use dt.distribute_tensor(...)"]),
    ("len-of-0d-dtensor", lambda: len(d(np.float32(1), (R,))), errors.DTypeError, TypeError,
     ["len() of a 0-d DTensor"]),
    ("init-device-mesh-extra-positional", lambda: dt.init_device_mesh("cpu", (1,), ("a",), 5),
     errors.SignatureError, TypeError, ["init_device_mesh: unexpected positional", "[5]"]),
    # the dispatcher's binder and operands
    ("dispatch-unexpected-keyword", lambda: d().sum(axis_typo=1), errors.SignatureError,
     TypeError, ["sum() got an unexpected keyword argument 'axis_typo'"]),
    ("dispatch-multiple-values", lambda: d().sum(0, dim=0), errors.SignatureError, TypeError,
     ["sum() got multiple values for argument 'dim'"]),
    ("dispatch-missing-argument", lambda: dt.add(d()), errors.SignatureError, TypeError,
     ["add() missing required arguments: other"]),
    ("dispatch-too-many-positionals", lambda: d().relu(1, 2), errors.SignatureError, TypeError,
     ["relu() takes 1 positional arguments (input) but 3 were given"]),
    ("dispatch-no-dtensor-operand", lambda: dt.add(1.0, 2.0, alpha=d()), errors.DTypeError,
     TypeError, ["add: no DTensor among the tensor arguments (input, other)"]),
    ("set-prop-cache-size", lambda: dt.debug.set_prop_cache_size(0), errors.ConfigError,
     ValueError, ["set_prop_cache_size: maxsize must be at least 1, got 0"]),
    ("register-op-variadic-kernel",
     lambda: dt.register_op("catalogue_variadic_op", lambda *a: a, lambda schema: None),
     errors.DTypeError, TypeError, ["register_op('catalogue_variadic_op')", "*args"]),
    # factories and the generator
    ("from-numpy-of-a-list", lambda: dt.from_numpy([1, 2]), errors.DTypeError, TypeError,
     ["from_numpy: expected np.ndarray (got list)"]),
    ("randint-no-size", lambda: dt.randint(), errors.SignatureError, TypeError,
     ["randint() missing required argument 'size'"]),
    ("randint-too-many-bounds", lambda: dt.randint(1, 2, 3, (4,)), errors.SignatureError,
     TypeError, ["randint() takes (high, size) or (low, high, size)", "got 4 positional"]),
    ("randint-empty-range", lambda: dt.randint(5, 2, (3,)), errors.ArgumentError, ValueError,
     ["from=5 >= to=2"]),
    ("arange-zero-step", lambda: dt.arange(0, 4, 0), errors.ArgumentError, ValueError,
     ["arange: step must be nonzero"]),
    ("arange-step-sign", lambda: dt.arange(5, 0, 1), errors.ArgumentError, ValueError,
     ["arange:", "(start=5, end=0, step=1)"]),
    ("linspace-negative-steps", lambda: dt.linspace(0, 1, -1), errors.ArgumentError, ValueError,
     ["linspace: number of steps must be non-negative, got -1"]),
    ("manual-seed-range", lambda: dt.manual_seed(2**64), errors.ArgumentError, ValueError,
     ["manual_seed: seed must be within", str(2**64)]),
    ("set-rng-state-size", lambda: dt.set_rng_state(b"abc"), errors.ArgumentError, ValueError,
     ["set_rng_state: expected a 16-byte state, got 3 bytes"]),
    ("random-block-empty-range", lambda: _block("randint", low=5, high=2),
     errors.ArgumentError, ValueError, ["from=5 >= to=2"]),
    ("random-block-wide-range", lambda: _block("randint", low=-(2**63), high=2**64),
     errors.ArgumentError, ValueError, ["randint: range", "is wider than 2**64"]),
    ("random-block-unknown-kind", lambda: _block("poisson"), errors.ArgumentError, ValueError,
     ["random_block: unknown kind 'poisson'"]),
    # devices
    ("device-type", lambda: dt.Device("tpu"), errors.ArgumentError, ValueError,
     ["device type at start of device: tpu"]),
    ("device-index", lambda: dt.Device("cpu", 0), errors.ArgumentError, ValueError,
     ["invalid device index 0 for device type 'cpu'"]),
    ("device-string", lambda: dt.zeros(2, device="cuda:x"), errors.ArgumentError, ValueError,
     ["Invalid device string: 'cuda:x'"]),
    ("device-argument-type", lambda: dt.zeros(2, device=1.5), errors.DTypeError, TypeError,
     ["expected a device (str, dt.Device or int), got float (1.5)"]),
    # local tensors: indexing, Python protocols, copies
    ("getitem-step", lambda: t()[::-1], errors.ArgumentError, ValueError,
     ["__getitem__: step must be greater than zero (got -1)"]),
    ("getitem-tuple-step", lambda: t()[0, ::-2], errors.ArgumentError, ValueError,
     ["__getitem__: step must be greater than zero (got -2)"]),
    ("setitem-step", lambda: t().__setitem__(slice(None, None, -1), 0.0), errors.ArgumentError,
     ValueError, ["__setitem__: step must be greater than zero (got -1)"]),
    ("dtensor-getitem-step", lambda: d()[::-1], errors.ArgumentError, ValueError,
     ["__getitem__: step must be greater than zero (got -1)"]),
    ("getitem-not-an-index", lambda: t()[1.5], errors.DimError, IndexError,
     ["__getitem__: only integers, slices", "(got float)"]),
    ("setitem-not-an-index", lambda: t().__setitem__(1.5, 0.0), errors.DimError, IndexError,
     ["__setitem__: only integers, slices", "(got float)"]),
    ("len-of-0d", lambda: len(dt.tensor(1.0)), errors.DTypeError, TypeError,
     ["len() of a 0-d tensor"]),
    ("iter-of-0d", lambda: iter(dt.tensor(1.0)), errors.DTypeError, TypeError,
     ["iteration over a 0-d tensor"]),
    ("item-of-many", lambda: t().item(), errors.ValueConversionError, RuntimeError,
     ["a Tensor with 24 elements cannot be converted to Scalar"]),
    ("int-of-many", lambda: int(t()), errors.ValueConversionError, RuntimeError,
     ["a Tensor with 24 elements"]),
    ("float-of-many", lambda: float(t()), errors.ValueConversionError, RuntimeError,
     ["a Tensor with 24 elements"]),
    ("bool-of-many", lambda: bool(t()), errors.ValueConversionError, RuntimeError,
     ["Boolean value of Tensor with 24 values is ambiguous"]),
    ("index-of-float", lambda: operator.index(dt.tensor(1.0)), errors.DTypeError, TypeError,
     ["only integer tensors of a single element", "float32"]),
    ("array-without-copy", lambda: np.asarray(t(), dtype=np.int32, copy=False),
     errors.ArgumentError, ValueError, ["__array__: converting float32 to int32 needs a copy"]),
    ("numpy-of-a-device-tensor", lambda: _device_tensor().numpy(), errors.DTypeError,
     TypeError, ["can't convert cuda:0 tensor to numpy"]),
    ("copy-not-broadcastable", lambda: t().copy_(dt.ones(4)), errors.ShardingError, ValueError,
     ["copy_: source of shape (4,) cannot be broadcast to (4, 6)"]),
    ("fill-with-many", lambda: t().fill_(dt.ones(2)), errors.ArgumentError, ValueError,
     ["fill_ only supports 0-dimension value tensor", "1 dimensions"]),
    # nn options
    ("cross-entropy-reduction",
     lambda: dt.cross_entropy(t(), dt.tensor(TARGET), reduction="avg"), errors.ArgumentError,
     ValueError, ["cross_entropy: 'avg' is not a valid value for reduction"]),
    ("cross-entropy-label-smoothing",
     lambda: dt.cross_entropy(t(), dt.tensor(TARGET), label_smoothing=2.0),
     errors.ArgumentError, ValueError, ["cross_entropy: label_smoothing", "got 2.0"]),
    ("mse-loss-reduction", lambda: dt.mse_loss(t(), t(), reduction="avg"), errors.ArgumentError,
     ValueError, ["mse_loss: 'avg' is not a valid value for reduction"]),
    ("dropout-p", lambda: dt.dropout(t(), 1.5), errors.ArgumentError, ValueError,
     ["dropout probability has to be between 0 and 1, but got 1.5"]),
    # DTensor rules and the distributed dropout kernel
    ("dtensor-cross-entropy-reduction",
     lambda: dt.cross_entropy(d(), d(TARGET, (R,)), reduction="avg"), errors.ArgumentError,
     ValueError, ["cross_entropy: 'avg' is not a valid value for reduction"]),
    ("dtensor-mse-loss-reduction", lambda: dt.mse_loss(d(), d(), reduction="avg"),
     errors.ArgumentError, ValueError, ["mse_loss: 'avg' is not a valid value for reduction"]),
    ("dtensor-sharded-dropout-p", lambda: dt.dropout(d(), 1.5), errors.ArgumentError,
     ValueError, ["dropout probability has to be between 0 and 1, but got 1.5"]),
    # dims that are not ints (one check, local and distributed)
    ("dim-not-an-int", lambda: t().sum(dim=1.0), errors.DTypeError, TypeError,
     ["sum: dim must be an int, got float (1.0)"]),
    ("dtensor-dim-not-an-int", lambda: d().sum(dim=1.0), errors.DTypeError, TypeError,
     ["sum: dim must be an int, got float (1.0)"]),
]


@pytest.mark.parametrize(
    "call, exc, builtin, fragments",
    [c[1:] for c in CATALOGUE_CASES],
    ids=[c[0] for c in CATALOGUE_CASES],
)
def test_every_check_raises_a_catalogue_type(call, exc, builtin, fragments):
    e = expect(call, exc, *fragments)
    assert isinstance(e, errors.DTensorError) and isinstance(e, builtin)
    head, _, rest = str(e).partition(": ")
    assert not rest.startswith(head + ":"), f"the op is named twice: {e}"


@pytest.mark.parametrize(
    "write",
    [
        lambda x: x.copy_(dt.ones(4)),
        lambda x: x.fill_(dt.ones(2)),
        lambda x: x.__setitem__(slice(None, None, -1), 0.0),
        lambda x: x.__setitem__(1.5, 0.0),
    ],
    ids=["copy_", "fill_", "setitem-step", "setitem-not-an-index"],
)
def test_failed_writes_raise_a_catalogue_type_and_change_nothing(write):
    x = t()
    e = expect(lambda: write(x), errors.DTensorError, unchanged=[x])
    assert isinstance(e, (ValueError, IndexError))


@pytest.mark.parametrize(
    "raw, fragment",
    [("lots", "'lots' is not an integer"), ("0", "'0' must be at least 1")],
)
def test_prop_cache_size_env_is_a_config_error(monkeypatch, raw, fragment):
    monkeypatch.setenv("DTENSOR_PROP_CACHE_SIZE", raw)
    e = expect(_dispatch._env_cache_size, errors.ConfigError, f"DTENSOR_PROP_CACHE_SIZE={fragment}")
    assert isinstance(e, ValueError)


def test_set_fastpath_without_the_extension_is_unavailable(monkeypatch):
    monkeypatch.setattr(_dtensor_ops, "_FRONT", None)
    e = expect(
        lambda: dt.debug.set_fastpath(True),
        errors.UnavailableError,
        "set_fastpath(True): the compiled fast path is not available",
    )
    assert isinstance(e, errors.ConfigError) and isinstance(e, RuntimeError)


# Plain builtin raises that stay, each with its reason: (path, a fragment of the raise).
# Also outside the scan: placements/types.py's abstract ``raise NotImplementedError`` (not one
# of the scanned builtins), launch/ (CLI errors) and the fast path's compiled sources.
PLAIN_RAISES_KEPT = {
    ("dtensor/debug/_comm_mode.py", "this mode is already active"):
        "the debug tool's own error: re-entering one CommDebugMode object",
    ("dtensor/debug/_strict.py", "this mode is already active"):
        "the debug tool's own error: re-entering one no_implicit_redistribute object",
}
# the scanned names: the builtins, and the catalogue's base, which names no kind of error
PLAIN = {"ValueError", "TypeError", "RuntimeError", "IndexError", "DTensorError"}


def _plain_raises(root: pathlib.Path, packages) -> list:
    """``(path, source)`` of every ``raise <name>`` / ``raise <name>(...)`` with a name of
    :data:`PLAIN` in the packages (folders under ``root``), paths relative to ``root``."""
    found = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            text = path.read_text()
            for node in ast.walk(ast.parse(text)):
                exc = node.exc if isinstance(node, ast.Raise) else None
                if isinstance(exc, ast.Call):
                    exc = exc.func
                if isinstance(exc, ast.Name) and exc.id in PLAIN:
                    rel = path.relative_to(root).as_posix()
                    found.append((rel, ast.get_source_segment(text, node)))
    return found


def test_no_plain_builtin_raise_outside_the_kept_list():
    # the imported packages: the checkout, or the installed copy that the test runner uses
    root = pathlib.Path(dt.__file__).resolve().parents[1]
    found = _plain_raises(root, ("dtensor", "placements", "redistribute"))
    offenders = [
        f"{rel}: {src.splitlines()[0]}"
        for rel, src in found
        if not any(rel == p and frag in src for p, frag in PLAIN_RAISES_KEPT)
    ]
    assert not offenders, "raise a dtensor.errors type instead:\n" + "\n".join(offenders)
    # the kept list stays exact: each entry still matches a raise
    kept = {(p, frag) for p, frag in PLAIN_RAISES_KEPT for rel, src in found
            if rel == p and frag in src}
    assert kept == set(PLAIN_RAISES_KEPT)


def test_the_scan_finds_plain_raises(tmp_path):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "sub" / "m.py").write_text(
        "def f(x):\n"
        "    if x:\n"
        "        raise ValueError(\n            'bad'\n        )\n"
        "    raise IndexError\n"
        "def g():\n"
        "    raise KeyError('not scanned')\n"
    )
    found = _plain_raises(tmp_path, ("pkg",))
    assert sorted((rel, src.split("(")[0]) for rel, src in found) == [
        ("pkg/sub/m.py", "raise IndexError"),
        ("pkg/sub/m.py", "raise ValueError"),
    ]
