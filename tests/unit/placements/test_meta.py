"""PyTorch's metadata semantics (placements.meta) against PyTorch's documented behaviour:
each function's results and its errors (types and messages) on normal, edge (0-d, empty,
negative dims, -1 sizes) and bad inputs. Expected values are facts about PyTorch (what
``torch`` gives for the same call), written out by hand.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import numpy as np
import pytest

from placements import meta as M
from placements.errors import ArgumentError, DimError, DTypeError, ShardingError, ViewError

pytestmark = pytest.mark.mode_independent  # see tests/conftest.py

F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)
C64, C128 = np.dtype(np.complex64), np.dtype(np.complex128)
I8, I16, I32, I64 = (np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64))
U8, BOOL = np.dtype(np.uint8), np.dtype(np.bool_)


@contextlib.contextmanager
def raises(exc, *fragments):
    """pytest.raises whose message must contain every fragment (literal text)."""
    with pytest.raises(exc) as info:
        yield info
    for f in fragments:
        assert f in str(info.value), (f, str(info.value))


# -- dims ----------------------------------------------------------------------------------------
def test_norm_dim_wraps_like_maybe_wrap_dim():
    assert [M.norm_dim(d, 3) for d in (0, 2, -1, -3)] == [0, 2, 2, 0]
    assert M.norm_dim(np.int64(-2), 2) == 0  # numpy ints are ints
    assert M.norm_dim(0, 0) == 0 and M.norm_dim(-1, 0) == 0  # a 0-d tensor takes 0 and -1


def test_norm_dim_errors():
    with raises(DimError, "sum: Dimension out of range (expected to be in range of [-2, 1], "
                "but got 2)"):
        M.norm_dim(2, 2, "sum")
    with raises(DimError, "Dimension out of range (expected to be in range of [-1, 0], but got 1)"):
        M.norm_dim(1, 0)
    with raises(IndexError, "got -3"):  # a DimError is an IndexError, as in PyTorch
        M.norm_dim(-3, 2)
    with raises(DTypeError, "sum: dim must be an int, got float (1.0)"):
        M.norm_dim(1.0, 2, "sum")


def test_nonscalar_dim():
    assert M.nonscalar_dim(-1, 2, "unbind") == 1
    with raises(DimError, "unbind: dimension specified as 0 but tensor has no dimensions"):
        M.nonscalar_dim(0, 0, "unbind")


def test_norm_dims_of_reductions():
    assert M.norm_dims("sum", None, 3) == (0, 1, 2)
    assert M.norm_dims("sum", (), 3) == (0, 1, 2)  # an empty list reduces every dim
    assert M.norm_dims("sum", (-1, 0), 3) == (0, 2)
    assert M.norm_dims("sum", 1, 3) == (1,)
    assert M.norm_dims("sum", 0, 0) == () and M.norm_dims("sum", (-1,), 0) == ()
    with raises(ShardingError, "sum: dim [0, -3] has a dim that appears multiple times"):
        M.norm_dims("sum", [0, -3], 3)
    with raises(DimError, "amax: Dimension out of range"):
        M.norm_dims("amax", (0, 3), 3)


def test_as_dims():
    assert M.as_dims(2) == (2,) and M.as_dims(np.int64(2)) == (2,)
    assert M.as_dims([0, 1]) == (0, 1) and M.as_dims((1,)) == (1,) and M.as_dims(()) == ()
    assert M.as_dims(range(2)) == (0, 1) and M.as_dims("a") == ("a",)


# -- broadcasting and reductions -----------------------------------------------------------------
def test_broadcast_shapes():
    assert M.broadcast_shapes("add", [(5, 1), (7,)]) == (5, 7)
    assert M.broadcast_shapes("add", [(), (3,)]) == (3,)
    assert M.broadcast_shapes("add", [(0, 1), (1, 4)]) == (0, 4)
    assert M.broadcast_shapes("add", []) == ()
    with raises(ShardingError, "add: shapes (2, 3) and (4,) do not broadcast (size 3 vs 4 at "
                "dimension -1)"):
        M.broadcast_shapes("add", [(2, 3), (4,)])


def test_reduced_shape():
    assert M.reduced_shape((4, 5, 6), (0, 2), False) == (5,)
    assert M.reduced_shape((4, 5, 6), (0, 2), True) == (1, 5, 1)
    assert M.reduced_shape((4, 5), None, False) == () and M.reduced_shape((4, 5), None, True) == (
        1, 1)
    assert M.reduced_shape((), (), True) == ()


# -- dtypes --------------------------------------------------------------------------------------
def test_promote_types_follows_torch_promote_types():
    assert M.promote_types(I32, I64) == I64
    assert M.promote_types(U8, I8) == I16  # torch.promote_types(uint8, int8) is int16
    assert M.promote_types(I64, F16) == F16  # the float category wins with its own width
    assert M.promote_types(BOOL, I8) == I8
    assert M.promote_types(F32, C64) == C64 and M.promote_types(F64, C64) == C128
    assert M.promote_types(None, F32) == F32 and M.promote_types(F32, None) == F32


def _arg(shape, dtype, scalar=False):
    return SimpleNamespace(shape=shape, dtype=np.dtype(dtype), is_scalar=scalar)


def test_result_dtype_three_tiers():
    # torch.result_type: tensor int32 + python 2.5 -> default float; float32 + 2.5 -> float32
    assert M.result_dtype([_arg((3,), I32), _arg((), F64, True)], F32) == F32
    assert M.result_dtype([_arg((3,), I32), _arg((), F64, True)], F64) == F64
    assert M.result_dtype([_arg((3,), F16), _arg((), F64, True)], F32) == F16
    assert M.result_dtype([_arg((3,), I32), _arg((), I64, True)], F32) == I32
    assert M.result_dtype([_arg((3,), BOOL), _arg((), I64, True)], F32) == I64
    # a 0-d tensor matters only when its category is higher
    assert M.result_dtype([_arg((3,), I32), _arg((), F64)], F32) == F64
    assert M.result_dtype([_arg((3,), F32), _arg((), F64)], F32) == F32
    assert M.result_dtype([_arg((3,), I8), _arg((), I64)], F32) == I8
    assert M.result_dtype([_arg((3,), F32), _arg((), C128, True)], F32) == C64
    assert M.result_dtype([None, _arg((2,), U8)], F32) == U8
    assert M.result_dtype([], F32) == F32


def test_combine_and_scalar_dtypes():
    assert M.combine_categories(I32, F64) == F64 and M.combine_categories(F16, F64) == F16
    assert M.combine_categories(F64, C64) == C128  # float with complex widens
    assert M.combine_categories(None, I8) == I8 and M.combine_categories(I8, None) == I8
    assert M.scalar_dtype(np.dtype(np.float64), F32) == F32
    assert M.scalar_dtype(C128, F64) == C128 and M.scalar_dtype(C128, F32) == C64
    assert M.scalar_dtype(I8, F32) == I64 and M.scalar_dtype(BOOL, F32) == BOOL


def test_can_cast_is_torch_can_cast():
    assert M.can_cast(I64, F16) and M.can_cast(BOOL, I8) and M.can_cast(F64, C64)
    assert not M.can_cast(F32, I64) and not M.can_cast(C64, F64) and not M.can_cast(I8, BOOL)


def test_dtype_arguments():
    assert M.as_dtype("float", F64) == F32 and M.as_dtype("int", F32) == I32  # torch names
    assert M.as_dtype("long", F32) == I64 and M.as_dtype("cdouble", F32) == C128
    assert M.as_dtype(float, F64) == F64 and M.as_dtype(int, F32) == I64
    assert M.as_dtype(complex, F32) == C64 and M.as_dtype(complex, F64) == C128
    assert M.as_dtype("float64", F32) == F64 and M.as_dtype(np.int16, F32) == I16
    assert M.TORCH_DTYPE_NAMES["half"] == F16
    with raises(DTypeError, "cannot interpret 'nope' as a dtype"):
        M.as_dtype("nope", F32)
    assert M.float_dtype(I64, F64) == F64 and M.float_dtype(F16, F64) == F16
    assert M.real_dtype(C64) == F32 and M.real_dtype(C128) == F64 and M.real_dtype(I8) == I8


def test_check_embedding_indices_takes_integer_dtypes_only():
    for dtype in (I8, I32, I64, U8):
        M.check_embedding_indices(dtype)
    for dtype in (F32, BOOL, C64):
        with raises(
            DTypeError,
            f"embedding: expected indices of an integer dtype (int64, int32...), got {dtype.name}",
        ):
            M.check_embedding_indices(dtype)


# -- view shapes ---------------------------------------------------------------------------------
def test_infer_size():
    assert M.infer_size((2, -1), 12) == (2, 6)
    assert M.infer_size((-1,), 0) == (0,)
    assert M.infer_size((), 1) == ()
    assert M.infer_size((0, 3), 0) == (0, 3)
    assert M.infer_size([np.int64(2), -1], 6) == (2, 3)
    with raises(ViewError, "shape '[3, 5]' is invalid for input of size 8"):
        M.infer_size((3, 5), 8)
    with raises(ViewError, "shape '[-1, 3]' is invalid for input of size 8"):
        M.infer_size((-1, 3), 8)
    with raises(ViewError, "only one dimension can be inferred"):
        M.infer_size((-1, -1), 8)
    with raises(ViewError, "invalid shape dimension -2"):
        M.infer_size((-2, 4), 8)
    with raises(ViewError, "cannot reshape tensor of 0 elements into shape [-1, 0] because the "
                "unspecified dimension size -1 can be any value and is ambiguous"):
        M.infer_size((-1, 0), 0)
    with raises(ViewError, "shape '[-1, 0]' is invalid for input of size 3"):
        M.infer_size((-1, 0), 3)
    with raises(DTypeError, "shape must be a sequence of ints", "float at pos 1"):
        M.infer_size((2, 1.5), 3)


def test_expand_shape():
    assert M.expand_shape((3, 1), (-1, 4)) == (3, 4)
    assert M.expand_shape((3, 1), (2, 3, 4)) == (2, 3, 4)
    assert M.expand_shape((), (2, 3)) == (2, 3)
    assert M.expand_shape((1, 0), (5, 0)) == (5, 0)
    assert M.expand_shape((2,), (0, 2)) == (0, 2)  # a new dim may be empty
    with raises(ViewError, "The expanded size of the tensor (4) must match the existing size (3) "
                "at non-singleton dimension 1.  Target sizes: [2, 4].  Tensor sizes: [2, 3]"):
        M.expand_shape((2, 3), (2, 4))
    with raises(ViewError, "The expanded size of the tensor (-1) isn't allowed in a leading, "
                "non-existing dimension 0"):
        M.expand_shape((3,), (-1, 3))
    with raises(ViewError, "expand: the number of sizes provided (1) must be greater or equal to "
                "the number of dimensions in the tensor (2)"):
        M.expand_shape((2, 3), (3,))
    with raises(ViewError, "expand: invalid size -2 at dimension 0"):
        M.expand_shape((1,), (-2,))


def test_narrow_args():
    assert M.narrow_args((5, 6), 1, 2, 3) == (1, 2, 3)
    assert M.narrow_args((5, 6), -1, -2, 2) == (1, 4, 2)  # a negative start counts from the end
    assert M.narrow_args((5,), 0, 5, 0) == (0, 5, 0)  # start == size with length 0 is allowed
    assert M.narrow_args((0,), 0, 0, 0) == (0, 0, 0)
    with raises(ViewError, "start (2) + length (2) exceeds dimension size (3)."):
        M.narrow_args((3,), 0, 2, 2)
    with raises(DimError, "narrow(): start out of range (expected to be in range of [-3, 3], but "
                "got 4)"):
        M.narrow_args((3,), 0, 4, 0)
    with raises(ViewError, "narrow(): length must be non-negative."):
        M.narrow_args((3,), 0, 0, -1)
    with raises(ViewError, "narrow() cannot be applied to a 0-dim tensor."):
        M.narrow_args((), 0, 0, 0)
    with raises(DimError, "narrow: Dimension out of range"):
        M.narrow_args((3,), 1, 0, 0)


def test_select_args():
    assert M.select_args((3, 4), 1, -1) == (1, 3)
    assert M.select_args((3, 4), -2, 2) == (0, 2)
    with raises(DimError, "select(): index 5 out of range for tensor of size [3, 4] at "
                "dimension 0"):
        M.select_args((3, 4), 0, 5)
    with raises(DimError, "select(): index -5 out of range for tensor of size [3, 4] at "
                "dimension 1"):
        M.select_args((3, 4), 1, -5)
    with raises(DimError, "index 0 out of range for tensor of size [0] at dimension 0"):
        M.select_args((0,), 0, 0)
    with raises(DimError, "select() cannot be applied to a 0-dim tensor."):
        M.select_args((), 0, 0)


def test_squeeze_dims():
    assert M.squeeze_dims((5, 1, 7, 1)) == (1, 3)
    assert M.squeeze_dims((5, 1, 7, 1), -1) == (3,)
    assert M.squeeze_dims((5, 1, 7), 0) == ()  # a dim whose size is not 1 stays
    assert M.squeeze_dims((1, 1, 2), (1, 0)) == (0, 1)
    assert M.squeeze_dims((), 0) == () and M.squeeze_dims(()) == ()
    assert M.squeeze_dims((0, 1), None) == (1,)
    with raises(DimError, "squeeze: Dimension out of range"):
        M.squeeze_dims((5, 1), 2)


def test_permutations():
    assert M.permute_dims(3, (2, 0, 1)) == (2, 0, 1)
    assert M.permute_dims(3, [-1, 0, 1]) == (2, 0, 1)
    assert M.permute_dims(0, ()) == ()
    with raises(ViewError, "permute(): duplicate dims are not allowed: [0, 0]"):
        M.permute_dims(2, (0, 0))
    with raises(ViewError, "permute(): number of dimensions in the tensor input does not match "
                "the length of the desired ordering of dimensions i.e. input.dim() = 2 is not "
                "equal to len(dims) = 1"):
        M.permute_dims(2, 0)
    with raises(DimError, "permute: Dimension out of range"):
        M.permute_dims(2, (0, 2))
    assert M.transpose_dims(3, 0, -1) == (2, 1, 0)
    assert M.transpose_dims(0, 0, -1) == ()  # a 0-d tensor transposes to itself
    with raises(DimError, "swapaxes: Dimension out of range (expected to be in range of [-1, 0], "
                "but got 1)"):
        M.transpose_dims(0, 0, 1, "swapaxes")
    assert M.t_dims(2) == (1, 0) and M.t_dims(1) == (0,) and M.t_dims(0) == ()
    with raises(ViewError, "t() expects a tensor with <= 2 dimensions, but self is 3D"):
        M.t_dims(3)


def test_movedim_dims():
    # torch.movedim(x of shape (2, 3, 4), 0, -1) has shape (3, 4, 2)
    assert M.movedim_dims(3, 0, -1) == (1, 2, 0)
    assert M.movedim_dims(3, (0, 1), (2, 0)) == (1, 2, 0)
    assert M.movedim_dims(2, (), ()) == (0, 1)
    with raises(ViewError, "movedim: Invalid source or destination dims: source ([0, 1] dims) "
                "should contain the same number of dims as destination ([0] dims)"):
        M.movedim_dims(3, (0, 1), 0)
    with raises(ViewError, "movedim: repeated dim in `source` ([0, 0])"):
        M.movedim_dims(3, (0, -3), (0, 1))
    with raises(ViewError, "movedim: repeated dim in `destination` ([1, 1])"):
        M.movedim_dims(3, (0, 2), (1, -2))
    with raises(DimError, "movedim: Dimension out of range"):
        M.movedim_dims(3, 3, 0)


def test_flatten_and_unflatten_shapes():
    assert M.flatten_shape((2, 3, 4)) == (24,)
    assert M.flatten_shape((2, 3, 4), 1) == (2, 12)
    assert M.flatten_shape((2, 3, 4), -2, -2) == (2, 3, 4)
    assert M.flatten_shape((2, 0, 4), 0, 1) == (0, 4)
    assert M.flatten_shape(()) == (1,)  # a 0-d tensor flattens to one element
    with raises(ViewError, "flatten() has invalid args: start_dim cannot come after end_dim"):
        M.flatten_shape((2, 3, 4), 2, 1)
    with raises(DimError, "flatten: Dimension out of range (expected to be in range of [-1, 0], "
                "but got 1)"):
        M.flatten_shape((), 1)
    assert M.unflatten_shape((6, 5), 0, (2, 3)) == (2, 3, 5)
    assert M.unflatten_shape((6, 5), -1, (5, -1)) == (6, 5, 1)
    assert M.unflatten_shape((0, 2), 0, (-1, 4)) == (0, 4, 2)
    with raises(ViewError, "unflatten: Provided sizes [2, 2] don't multiply up to the size of dim "
                "0 (5) in the input tensor"):
        M.unflatten_shape((5,), 0, (2, 2))
    with raises(ViewError, "unflatten: sizes must be non-empty"):
        M.unflatten_shape((1,), 0, ())
    with raises(DimError, "unflatten: dimension specified as 0 but tensor has no dimensions"):
        M.unflatten_shape((), 0, (1,))


def test_split_and_chunk_sizes():
    # torch.arange(5).split(2) gives sizes 2, 2, 1; chunk(3) of 5 gives 2, 2, 1 too
    assert M.split_sizes(5, 2, 0) == (2, 2, 1)
    assert M.split_sizes(5, 7, 0) == (5,)
    assert M.split_sizes(0, 2, 0) == (0,) and M.split_sizes(0, 0, 0) == (0,)
    assert M.split_sizes(5, (1, 4), 0) == (1, 4) and M.split_sizes(0, (), 0) == ()
    with raises(ViewError, "split expects split_size be non-negative, but got split_size=-1"):
        M.split_sizes(5, -1, 0)
    with raises(ViewError, "split_size can only be 0 if dimension size is 0, but got dimension "
                "size of 5"):
        M.split_sizes(5, 0, 0)
    with raises(ViewError, "split_with_sizes expects split_sizes to sum exactly to 5 (input "
                "tensor's size at dimension 1), but got split_sizes=[2, 2]"):
        M.split_sizes(5, [2, 2], 1)
    with raises(ViewError, "split_with_sizes expects split_sizes have only non-negative entries, "
                "but got split_sizes=[-1, 6]"):
        M.split_sizes(5, (-1, 6), 0)
    assert M.chunk_sizes(5, 3) == (2, 2, 1)
    assert M.chunk_sizes(3, 4) == (1, 1, 1)  # chunk may give fewer pieces than asked
    assert M.chunk_sizes(6, 4) == (2, 2, 2)
    assert M.chunk_sizes(0, 3) == (0, 0, 0)  # an empty dim gives `chunks` empty pieces
    with raises(ViewError, "chunk expects `chunks` to be greater than 0, got: 0"):
        M.chunk_sizes(5, 0)
    assert M.split_dim(2, -1, "split") == 1
    with raises(ViewError, "chunk expects at least a 1-dimensional tensor"):
        M.split_dim(0, 0, "chunk")


def test_index_shape():
    E = Ellipsis
    assert M.index_shape((5, 7), 1) == ((7,), {1: 0})
    assert M.index_shape((5, 7), (None, E, 0)) == ((1, 5), {0: 1})
    assert M.index_shape((8, 12), (slice(None, None, 2), 3)) == ((4,), {})
    assert M.index_shape((8, 12), (slice(0, 100), -12)) == ((8,), {0: 0})
    assert M.index_shape((8, 12), slice(2, 5)) == ((3, 12), {1: 1})
    assert M.index_shape((0, 3), slice(None)) == ((0, 3), {0: 0, 1: 1})
    assert M.index_shape((), ()) == ((), {}) and M.index_shape((), None) == ((1,), {})
    assert M.index_shape((4,), np.int64(-1)) == ((), {})
    with raises(DimError, "__getitem__: index 10 is out of bounds for dimension 0 with size 4"):
        M.index_shape((4, 6), 10)
    with raises(DimError, "__getitem__: index -7 is out of bounds for dimension 1 with size 6"):
        M.index_shape((4, 6), (0, -7))
    with raises(DimError, "__getitem__: too many indices for tensor of dimension 2"):
        M.index_shape((4, 6), (0, 0, 0))
    with raises(DimError, "too many indices for tensor of dimension 0"):
        M.index_shape((), 0)
    with raises(DimError, "an index can only have a single ellipsis ('...')"):
        M.index_shape((4, 6), (E, E))
    with raises(ArgumentError, "__setitem__: step must be greater than zero (got -1)"):
        M.index_shape((4,), slice(None, None, -1), "__setitem__")
    with raises(DimError, "only integers, slices, None, ..., and integer or boolean tensors are "
                "valid indices (got float)"):
        M.index_shape((4,), 1.5)
