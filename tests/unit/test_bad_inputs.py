"""Bad inputs in one process: each raises the catalogued error type with a useful message.

Every case gives a callable, the expected type (a :mod:`dtensor.errors` type, or the builtin
where the catalogue's subtype is still missing: those gaps are the ``xfail(strict=True)``
cases at the end, which start passing, and then fail as XPASS, once they are fixed), the
message fragments that must appear (the op, the values, the placements), and the tensors
that must be unchanged afterwards (a failed op, in-place ones included, writes nothing).

DTensors live on simulated meshes (see ``test_dispatch.py``), so nothing here communicates.
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
        errors.PlacementError,
        "Shard(dim=3)",
        "2-D tensor of shape (4, 6)",
    )


def test_plan_to_invalid_target():
    spec = DTensorSpec(MESH, [Shard(0)], (4, 6), np.float32)
    expect(lambda: plan(spec, (Shard(5),)), errors.PlacementError, "Shard(dim=5)", "(4, 6)")


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
    ]
    for sub, builtin in pairs:
        assert issubclass(sub, errors.DTensorError) and issubclass(sub, builtin)


# -- known gaps (outside this module's files; see the report) --------------------------------


@pytest.mark.xfail(strict=True, reason="dim errors are builtin IndexError, not DimError")
def test_gap_dim_out_of_range_is_dim_error():
    expect(lambda: d().sum(dim=3), errors.DimError, "sum", "got 3")


@pytest.mark.xfail(strict=True, reason="DTensor matmul shape check reports local shapes")
def test_gap_matmul_mismatch_names_global_shapes_and_placements():
    x, w = d(), d(np.ones((5, 2), np.float32), (R,))
    expect(lambda: x @ w, errors.ShardingError, "matmul", "(4, 6)", "(5, 2)", "[S(0)]")


def test_gap_unsupported_argument_type_is_dtype_error():
    expect(lambda: d() + "abc", errors.DTypeError, "add", "str")


def test_gap_negative_size_is_a_dtensor_error():
    expect(lambda: dt.zeros(-1, 3), errors.DTensorError, "negative dimension -1")


def test_gap_arange_zero_step_is_a_dtensor_error():
    expect(lambda: dt.arange(0, 10, 0), errors.DTensorError, "arange", "step")


@pytest.mark.xfail(strict=True, reason="embedding with float indices is a ShardingError")
def test_gap_embedding_float_indices_is_a_dtype_error():
    expect(lambda: dt.embedding(d(), d()), errors.DTypeError, "embedding", "float32")


@pytest.mark.xfail(strict=True, reason="from_local of a str does not name the op")
def test_gap_from_local_of_a_string_names_the_op():
    expect(lambda: dt.DTensor.from_local("abc", MESH, [R]), errors.DTypeError, "from_local")
