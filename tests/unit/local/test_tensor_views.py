"""View semantics of the local Tensor, pinned to what PyTorch gives.

Every expected (shape, stride, storage_offset) below is the value torch reports for the
same call; values are checked against numpy, and memory sharing through the storage.
"""

from __future__ import annotations

import numpy as np
import pytest

import dtensor as dt
from dtensor.errors import ViewError
from dtensor.local import strides as _strides
from dtensor.local.tensor import _norm_dim

VIEW_MSG = "view size is not compatible with input tensor's size and stride"


def meta(t):
    return tuple(t.shape), t.stride(), t.storage_offset()


def same_storage(a, b):
    sa, sb = a.untyped_storage(), b.untyped_storage()
    return sa.data_ptr() == sb.data_ptr() and sa.nbytes() == sb.nbytes()


@pytest.fixture
def x():
    """torch.arange(24).view(2, 3, 4)."""
    return dt.arange(24).view(2, 3, 4)


# ----------------------------------------------------------------------- metadata


def test_metadata_of_a_contiguous_tensor(x):
    assert meta(x) == ((2, 3, 4), (12, 4, 1), 0)
    assert x.size() == (2, 3, 4) and isinstance(x.size(), dt.Size)
    assert x.size(1) == 3 and x.size(-1) == 4 and x.stride(0) == 12 and x.stride(-2) == 4
    assert x.ndim == x.dim() == 3 and x.numel() == 24 and len(x) == 2
    assert x.dtype == dt.int64 and x.element_size() == 8 and x.nbytes == 24 * 8
    assert x.is_contiguous()
    assert x.untyped_storage().nbytes() == 24 * 8
    assert x.data_ptr() == x.untyped_storage().data_ptr()
    assert x.shape.numel() == 24 and repr(x.shape) == "dt.Size([2, 3, 4])"


def test_norm_dim_wraps_and_reports_the_range():
    assert _norm_dim(-1, 3) == 2 and _norm_dim(0, 3) == 0 and _norm_dim(-3, 3) == 0
    assert _norm_dim(0, 0) == 0 and _norm_dim(-1, 0) == 0  # scalars wrap like 1-D
    with pytest.raises(
        IndexError,
        match=r"^Dimension out of range \(expected to be in range of \[-2, 1\], "
        r"but got 2\)$",
    ):
        _norm_dim(2, 2)
    with pytest.raises(IndexError, match=r"\[-2, 1\], but got -3"):
        _norm_dim(-3, 2)
    with pytest.raises(TypeError):
        _norm_dim(1.0, 2)


def test_dim_arguments_of_methods_go_through_norm_dim(x):
    with pytest.raises(IndexError, match=r"range of \[-3, 2\], but got 3"):
        x.transpose(0, 3)
    with pytest.raises(IndexError, match=r"range of \[-3, 2\], but got -4"):
        x.size(-4)
    with pytest.raises(IndexError, match="no dimensions"):
        dt.tensor(1.0).size(0)


# --------------------------------------------------------- transpose / permute family


def test_transpose_strides_like_pytorch(x):
    y = x.transpose(0, 2)
    assert meta(y) == ((4, 3, 2), (1, 4, 12), 0)
    assert not y.is_contiguous()
    assert same_storage(x, y)
    np.testing.assert_array_equal(y.numpy(), np.arange(24).reshape(2, 3, 4).transpose(2, 1, 0))
    assert meta(x.swapaxes(-1, 0)) == meta(y) == meta(x.swapdims(2, 0))


def test_permute_movedim_and_mT(x):
    assert meta(x.permute(2, 0, 1)) == ((4, 2, 3), (1, 12, 4), 0)
    assert meta(x.permute((1, 2, 0))) == ((3, 4, 2), (4, 1, 12), 0)
    assert meta(x.movedim(0, -1)) == ((3, 4, 2), (4, 1, 12), 0)
    assert meta(x.movedim((0, 1), (2, 0))) == ((3, 4, 2), (4, 1, 12), 0)
    assert meta(x.mT) == ((2, 4, 3), (12, 1, 4), 0)
    assert meta(x.T) == ((4, 3, 2), (1, 4, 12), 0)
    with pytest.raises(ViewError, match="duplicate dims"):
        x.permute(0, 0, 1)
    with pytest.raises(ViewError, match=r"input.dim\(\) = 3 is not equal to len\(dims\) = 2"):
        x.permute(0, 1)
    with pytest.raises(ViewError, match="repeated dim"):
        x.movedim((0, 0), (1, 2))
    with pytest.raises(ViewError, match="only supported on matrices"):
        _ = dt.arange(3).mT


def test_t_on_up_to_two_dims():
    m = dt.arange(12).view(3, 4)
    assert meta(m.t()) == ((4, 3), (1, 4), 0)
    v = dt.arange(3)
    assert meta(v.t()) == ((3,), (1,), 0) and same_storage(v, v.t()) and v.t() is not v
    s = dt.tensor(5)
    assert meta(s.t()) == ((), (), 0)
    with pytest.raises(
        ViewError, match=r"^t\(\) expects a tensor with <= 2 dimensions, but self is 3D$"
    ):
        dt.zeros(2, 2, 2).t()


def test_transpose_of_a_scalar_is_an_alias():
    s = dt.tensor(2.0)
    assert meta(s.transpose(0, -1)) == ((), (), 0)


# ----------------------------------------------------------------- view / reshape


def test_view_strides_and_infer():
    a = dt.arange(24)
    assert meta(a.view(2, 3, 4)) == ((2, 3, 4), (12, 4, 1), 0)
    assert meta(a.view(-1, 4)) == ((6, 4), (4, 1), 0)
    assert meta(a.view((4, -1))) == ((4, 6), (6, 1), 0)
    assert meta(a.view([2, 1, 12])) == ((2, 1, 12), (12, 12, 1), 0)
    assert meta(a.view(np.int64(24))) == ((24,), (1,), 0)
    assert meta(dt.tensor(3).view(1, 1)) == ((1, 1), (1, 1), 0)
    assert meta(dt.tensor([3]).view(())) == ((), (), 0)
    with pytest.raises(ViewError, match=r"^shape '\[3, 5\]' is invalid for input of size 8$"):
        dt.arange(8).view(3, 5)
    with pytest.raises(ViewError, match="only one dimension can be inferred"):
        a.view(-1, -1)
    with pytest.raises(ViewError, match="invalid shape dimension -2"):
        a.view(-2, 12)


def test_view_of_a_transposed_tensor_raises_pytorch_message(x):
    y = x.transpose(0, 2)
    with pytest.raises(
        ViewError,
        match=r"^view size is not compatible with input tensor's size "
        r"and stride \(at least one dimension spans across two contiguous "
        r"subspaces\)\. Use \.reshape\(\.\.\.\) instead\.$",
    ):
        y.view(-1)
    with pytest.raises(RuntimeError, match=VIEW_MSG):  # ViewError is a RuntimeError
        dt.arange(12).view(3, 4).t().view(12)


def test_view_of_a_transposed_tensor_where_chunks_allow_it():
    t = dt.arange(12).view(3, 4).t()  # (4, 3) strides (1, 4)
    v = t.view(2, 2, 3)
    assert meta(v) == ((2, 2, 3), (2, 1, 4), 0)
    np.testing.assert_array_equal(v.numpy(), t.numpy().reshape(2, 2, 3))


def test_view_made_legal_by_a_size_one_dim():
    c = dt.arange(12).view(3, 4)[:, 1:2]  # (3, 1) strides (4, 1) offset 1, not contiguous
    assert meta(c) == ((3, 1), (4, 1), 1) and not c.is_contiguous()
    assert meta(c.view(3)) == ((3,), (4,), 1)
    assert meta(c.view(1, 3)) == ((1, 3), (12, 4), 1)
    np.testing.assert_array_equal(c.view(3).numpy(), [1, 5, 9])
    # the transposed (1, 4) of a (4, 1) column is contiguous: size-1 dims are ignored
    r = dt.arange(4).view(4, 1).t()
    assert r.is_contiguous() and meta(r.view(-1)) == ((4,), (1,), 0)


def test_view_normalises_odd_strides_of_size_one_dims():
    # a contiguous tensor whose size-1 dims carry arbitrary strides (as_strided)
    base = dt.arange(12)
    odd = base.as_strided((3, 1, 4), (4, 7, 1))
    assert odd.is_contiguous()
    assert meta(odd.view(3, 4)) == ((3, 4), (4, 1), 0)
    assert meta(odd.view(3, 1, 4)) == ((3, 1, 4), (4, 4, 1), 0)
    last = base.as_strided((12, 1), (1, 5))  # last dim of size 1 with stride 5
    assert meta(last.view(12, 1)) == ((12, 1), (1, 5), 0)  # PyTorch keeps its chunk stride


def test_view_of_empty_tensors():
    e = dt.empty(0, 3)
    assert meta(e) == ((0, 3), (3, 1), 0) and e.is_contiguous()
    assert meta(e.view(3, 0)) == ((3, 0), (1, 1), 0)
    assert meta(e.view(-1)) == ((0,), (1,), 0)
    assert meta(e.view(0, 3)) == ((0, 3), (3, 1), 0)
    with pytest.raises(ViewError, match="because the unspecified dimension size -1 can be any"):
        e.view(0, -1)


def test_view_as_another_dtype():
    a = dt.zeros(2, 4, dtype=dt.float32)
    b = a.view(dt.int32)
    assert b.dtype == dt.int32 and meta(b) == meta(a) and same_storage(a, b)
    c = a.view(dt.float64)
    assert c.dtype == dt.float64 and meta(c) == ((2, 2), (2, 1), 0)
    d = a.view(dt.int16)
    assert meta(d) == ((2, 8), (8, 1), 0)
    a[0, 0] = 1.0
    assert b[0, 0].item() == np.float32(1.0).view(np.int32)
    with pytest.raises(ViewError, match="stride 1"):
        a.t().view(dt.float64)
    with pytest.raises(ViewError, match="divisible by 2"):
        dt.zeros(3, dtype=dt.float32).view(dt.float64)


def test_reshape_copies_only_when_needed(x):
    r = x.reshape(6, 4)
    assert same_storage(r, x) and meta(r) == ((6, 4), (4, 1), 0)
    y = x.transpose(0, 2)
    r2 = y.reshape(-1)
    assert not same_storage(r2, y) and r2.is_contiguous()
    np.testing.assert_array_equal(r2.numpy(), y.numpy().reshape(-1))
    r3 = y.reshape(4, 3, 2)  # same shape: always a view
    assert same_storage(r3, y) and meta(r3) == meta(y)
    t = dt.arange(12).view(3, 4).t()
    r4 = t.reshape(2, 2, 3)
    assert same_storage(r4, t) and meta(r4) == ((2, 2, 3), (2, 1, 4), 0)
    assert meta(x.reshape_as(dt.empty(4, 6))) == ((4, 6), (6, 1), 0)
    assert meta(x.view_as(dt.empty(24))) == ((24,), (1,), 0)


def test_contiguous_returns_self_or_a_dense_copy(x):
    assert x.contiguous() is x
    y = x.transpose(0, 1)
    c = y.contiguous()
    assert c is not y and not same_storage(c, y)
    assert meta(c) == ((3, 2, 4), (8, 4, 1), 0)
    np.testing.assert_array_equal(c.numpy(), y.numpy())


def test_flatten_and_unflatten(x):
    f = x.flatten(1)
    assert meta(f) == ((2, 12), (12, 1), 0) and same_storage(f, x)
    assert meta(x.flatten()) == ((24,), (1,), 0)
    assert x.flatten(1, 1) is x
    assert meta(dt.tensor(7).flatten()) == ((1,), (1,), 0)
    g = x.transpose(0, 1).flatten(0, 1)  # not viewable: copies
    assert not same_storage(g, x)
    np.testing.assert_array_equal(
        g.numpy(), np.arange(24).reshape(2, 3, 4).swapaxes(0, 1).reshape(6, 4)
    )
    with pytest.raises(ViewError, match="start_dim cannot come after end_dim"):
        x.flatten(2, 1)
    u = dt.arange(12).unflatten(0, (3, -1))
    assert meta(u) == ((3, 4), (4, 1), 0)
    assert meta(x.unflatten(-1, (2, 1, 2))) == ((2, 3, 2, 1, 2), (12, 4, 2, 2, 1), 0)
    with pytest.raises(
        ViewError,
        match=r"Provided sizes \[5\] don't multiply up to the size "
        r"of dim 0 \(12\)",
    ):
        dt.arange(12).unflatten(0, (5,))


# -------------------------------------------------------- narrow / select / squeeze


def test_narrow_offsets(x):
    assert meta(x.narrow(2, 1, 2)) == ((2, 3, 2), (12, 4, 1), 1)
    assert meta(x.narrow(1, 1, 2)) == ((2, 2, 4), (12, 4, 1), 4)
    assert meta(x.narrow(0, -1, 1)) == ((1, 3, 4), (12, 4, 1), 12)
    assert meta(x.narrow(1, 3, 0)) == ((2, 0, 4), (12, 4, 1), 12)
    with pytest.raises(
        ViewError, match=r"start \(2\) \+ length \(2\) exceeds dimension size \(3\)"
    ):
        x.narrow(1, 2, 2)
    with pytest.raises(
        IndexError,
        match=r"start out of range \(expected to be in range of "
        r"\[-3, 3\], but got 4\)",
    ):
        x.narrow(1, 4, 0)


def test_select_offsets(x):
    assert meta(x.select(0, 1)) == ((3, 4), (4, 1), 12)
    assert meta(x.select(1, 2)) == ((2, 4), (12, 1), 8)
    assert meta(x.select(-1, -1)) == ((2, 3), (12, 4), 3)
    s = x.select(0, 1).select(0, 2).select(0, 3)
    assert meta(s) == ((), (), 23) and s.item() == 23
    with pytest.raises(
        IndexError,
        match=r"select\(\): index 3 out of range for tensor of size "
        r"\[2, 3, 4\] at dimension 1",
    ):
        x.select(1, 3)


def test_squeeze_and_unsqueeze():
    z = dt.arange(6).view(1, 2, 1, 3)
    assert meta(z) == ((1, 2, 1, 3), (6, 3, 3, 1), 0)
    assert meta(z.squeeze()) == ((2, 3), (3, 1), 0)
    assert meta(z.squeeze(0)) == ((2, 1, 3), (3, 3, 1), 0)
    assert meta(z.squeeze(1)) == ((1, 2, 1, 3), (6, 3, 3, 1), 0)  # size != 1: unchanged
    assert meta(z.squeeze((0, -2))) == ((2, 3), (3, 1), 0)
    assert meta(dt.tensor(1.0).squeeze(0)) == ((), (), 0)
    x = dt.arange(24).view(2, 3, 4)
    assert meta(x.unsqueeze(0)) == ((1, 2, 3, 4), (24, 12, 4, 1), 0)
    assert meta(x.unsqueeze(2)) == ((2, 3, 1, 4), (12, 4, 4, 1), 0)
    assert meta(x.unsqueeze(-1)) == ((2, 3, 4, 1), (12, 4, 1, 1), 0)
    y = x.transpose(0, 2)  # (4, 3, 2) strides (1, 4, 12)
    assert meta(y.unsqueeze(1)) == ((4, 1, 3, 2), (1, 12, 4, 12), 0)
    assert meta(y.unsqueeze(3)) == ((4, 3, 2, 1), (1, 4, 12, 1), 0)
    n = x.narrow(2, 1, 2).unsqueeze(1)
    assert meta(n) == ((2, 1, 3, 2), (12, 12, 4, 1), 1) and same_storage(n, x)
    assert meta(dt.tensor(4).unsqueeze(0)) == ((1,), (1,), 0)
    with pytest.raises(IndexError, match=r"\[-4, 3\], but got 4"):
        x.unsqueeze(4)


# ------------------------------------------------------------------------ expand


def test_expand_strides():
    a = dt.arange(3)
    e = a.expand(2, 3)
    assert meta(e) == ((2, 3), (0, 1), 0) and same_storage(e, a)
    assert meta(a.expand(1, 3)) == ((1, 3), (3, 1), 0)
    assert meta(a.expand(2, 1, 3)) == ((2, 1, 3), (0, 3, 1), 0)
    c = a.view(3, 1)
    assert meta(c.expand(3, 4)) == ((3, 4), (1, 0), 0)
    assert meta(c.expand(-1, 4)) == ((3, 4), (1, 0), 0)
    assert meta(c.expand((2, 3, 4))) == ((2, 3, 4), (0, 1, 0), 0)
    assert meta(dt.tensor(1.5).expand(2, 1)) == ((2, 1), (0, 0), 0)
    np.testing.assert_array_equal(c.expand(3, 4).numpy(), np.repeat(np.arange(3)[:, None], 4, 1))
    assert meta(c.expand_as(dt.empty(5, 3, 2))) == ((5, 3, 2), (0, 1, 0), 0)
    with pytest.raises(
        ViewError,
        match=r"The expanded size of the tensor \(4\) must match the "
        r"existing size \(3\) at non-singleton dimension 1",
    ):
        a.expand(2, 4)
    with pytest.raises(ViewError, match="leading, non-existing dimension 0"):
        a.expand(-1, 3)
    with pytest.raises(ViewError, match="number of sizes provided"):
        c.expand(4)


def test_writes_to_an_expanded_tensor_are_rejected():
    e = dt.zeros(3).expand(2, 3)
    with pytest.raises(ViewError, match="more than one element of the written-to tensor"):
        e.fill_(1)
    with pytest.raises(ViewError, match="more than one element"):
        e[0] = 1
    with pytest.raises(ViewError, match="more than one element"):
        e.copy_(dt.ones(2, 3))
    empty = dt.zeros(0, 1).expand(0, 3)  # no elements: nothing overlaps
    assert empty.fill_(1) is empty and empty.copy_(dt.ones(3)) is empty


# ------------------------------------------------------ split / chunk / unbind


def test_split_chunk_unbind():
    a = dt.arange(5)
    assert [p.shape[0] for p in a.split(2)] == [2, 2, 1]
    assert [meta(p) for p in a.split([1, 4])] == [((1,), (1,), 0), ((4,), (1,), 1)]
    assert [p.shape[0] for p in a.chunk(3)] == [2, 2, 1]
    assert [p.shape[0] for p in dt.arange(6).chunk(4)] == [2, 2, 2]  # fewer than asked
    assert [p.shape[0] for p in dt.arange(0).chunk(3)] == [0, 0, 0]
    assert [p.shape[0] for p in dt.arange(0).split(2)] == [0]
    m = dt.arange(12).view(3, 4)
    cols = m.split(3, dim=1)
    assert [meta(p) for p in cols] == [((3, 3), (4, 1), 0), ((3, 1), (4, 1), 3)]
    rows = m.unbind(0)
    assert isinstance(rows, tuple) and [meta(r) for r in rows] == [
        ((4,), (1,), 0),
        ((4,), (1,), 4),
        ((4,), (1,), 8),
    ]
    assert [meta(c) for c in m.unbind(-1)][1] == ((3,), (4,), 1)
    assert all(same_storage(p, m) for p in (*cols, *rows))
    assert [r.tolist() for r in m] == m.tolist()
    with pytest.raises(ViewError, match="sum exactly to 5"):
        a.split([2, 2])
    with pytest.raises(ViewError, match="split_size can only be 0"):
        a.split(0)
    with pytest.raises(ViewError, match="greater than 0"):
        a.chunk(0)


# ---------------------------------------------------------------------- indexing


def test_basic_indexing_views(x):
    assert meta(x[1]) == ((3, 4), (4, 1), 12)
    assert meta(x[-1, 1]) == ((4,), (1,), 16)
    assert meta(x[:, 1]) == ((2, 4), (12, 1), 4)
    assert meta(x[..., 1:3]) == ((2, 3, 2), (12, 4, 1), 1)
    assert meta(x[:, ::2]) == ((2, 2, 4), (12, 8, 1), 0)
    assert meta(x[:, 1:, ::3]) == ((2, 2, 2), (12, 4, 3), 4)
    assert meta(x[1, 2, 3]) == ((), (), 23) and x[1, 2, 3].item() == 23
    assert meta(x[2:2]) == ((0, 3, 4), (12, 4, 1), 24)
    assert meta(x[5:]) == ((0, 3, 4), (12, 4, 1), 24)
    assert meta(x[...]) == meta(x) and same_storage(x[...], x)
    for idx in [
        (1,),
        (slice(None), 1),
        (Ellipsis, slice(1, 3)),
        (slice(None), slice(None, None, 2)),
        (-1, slice(1, None), slice(None, None, 3)),
        (1, 2, 3),
    ]:
        np.testing.assert_array_equal(x[idx].numpy(), np.arange(24).reshape(2, 3, 4)[idx])
        assert same_storage(x[idx], x)


def test_none_indexing_uses_unsqueeze_strides(x):
    assert meta(x[None]) == ((1, 2, 3, 4), (24, 12, 4, 1), 0)
    assert meta(x[:, None]) == ((2, 1, 3, 4), (12, 12, 4, 1), 0)
    assert meta(x[..., None]) == ((2, 3, 4, 1), (12, 4, 1, 1), 0)
    assert meta(x[None, None]) == ((1, 1, 2, 3, 4), (24, 24, 12, 4, 1), 0)
    assert meta(x[1, None, :, 2:]) == ((1, 3, 2), (12, 4, 1), 14)
    assert meta(x[None, 1:2]) == ((1, 1, 3, 4), (24, 12, 4, 1), 12)
    assert meta(x[:, ::2, None]) == ((2, 2, 1, 4), (12, 8, 4, 1), 0)
    assert meta(dt.tensor(3)[None]) == ((1,), (1,), 0)
    np.testing.assert_array_equal(
        x[1, None, :, 2:].numpy(), np.arange(24).reshape(2, 3, 4)[1, None, :, 2:]
    )


def test_negative_steps_are_rejected(x):
    with pytest.raises(ValueError, match="step must be greater than zero"):
        x[::-1]
    with pytest.raises(ValueError, match="step must be greater than zero"):
        x[0, ::-2] = 0


def test_advanced_indexing_copies(x):
    base = np.arange(24).reshape(2, 3, 4)
    m = dt.from_numpy(base % 3 == 0)
    sel = x[m]
    np.testing.assert_array_equal(sel.numpy(), base[base % 3 == 0])
    assert not same_storage(sel, x)
    idx = dt.tensor([2, 0])
    np.testing.assert_array_equal(x[:, idx].numpy(), base[:, [2, 0]])
    np.testing.assert_array_equal(x[[1, 0], 1:].numpy(), base[[1, 0], 1:])
    np.testing.assert_array_equal(x[np.array([0, 1]), 0, 0].numpy(), base[[0, 1], 0, 0])


def test_setitem_writes_through_views(x):
    v = x.transpose(0, 2)[1:3]
    v[0] = -1  # x[:, :, 1]
    v[1, 2, 1] = 100  # x[1, 2, 2]
    assert (x.numpy()[:, :, 1] == -1).all() and x[1, 2, 2].item() == 100
    x[0, :, 0] = dt.tensor([7, 8, 9])
    assert x[0, :, 0].tolist() == [7, 8, 9]
    x[1] = np.full((3, 4), 5)
    assert (x.numpy()[1] == 5).all()
    x[dt.from_numpy(x.numpy() == 5)] = dt.tensor(6)
    assert (x.numpy()[1] == 6).all()
    f = dt.zeros(3)
    f[1] = 2.7  # converted to the tensor's dtype
    f2 = dt.zeros(3, dtype=dt.int32)
    f2[:] = dt.tensor([1.9, -1.9, 3.0])
    assert f.tolist()[1] == pytest.approx(2.7) and f2.tolist() == [1, -1, 3]


# ------------------------------------------------------------ storage and copies


def test_views_share_one_storage_and_writes_are_seen(x):
    views = [
        x.view(-1),
        x.transpose(0, 1),
        x[1],
        x.unsqueeze(0),
        x.narrow(2, 1, 2),
        x.expand(2, 2, 3, 4),
        x.detach(),
        x.flatten(),
        x.permute(2, 1, 0),
    ]
    st = x.untyped_storage()
    for v in views:
        assert v.untyped_storage().data_ptr() == st.data_ptr()
        assert v.untyped_storage().nbytes() == st.nbytes()
    x.view(-1)[13] = 1000
    assert x[1, 0, 1].item() == 1000 and x.transpose(0, 2)[1, 0, 1].item() == 1000
    assert x.detach()[1, 0, 1].item() == 1000


def test_views_reuse_an_existing_storage_object(x):
    st = x.untyped_storage()
    for v in (
        x.view(-1),
        x.transpose(0, 1),
        x[0],
        x.unsqueeze(1),
        x.view(6, 4).t(),
        x.transpose(0, 1).unsqueeze(0),
    ):
        assert v.untyped_storage() is st


def test_clone_preserves_dense_strides_else_contiguous():
    m = dt.arange(12).view(3, 4)
    t = m.t()
    c = t.clone()
    assert meta(c) == ((4, 3), (1, 4), 0) and not same_storage(c, m)
    np.testing.assert_array_equal(c.numpy(), t.numpy())
    s = m[:, ::2].clone()
    assert meta(s) == ((3, 2), (2, 1), 0)
    e = dt.arange(3).expand(2, 3).clone()
    assert meta(e) == ((2, 3), (3, 1), 0)
    p = dt.arange(24).view(2, 3, 4).permute(1, 2, 0).clone()
    assert meta(p) == ((3, 4, 2), (4, 1, 12), 0)
    c[0, 0] = 99
    assert m[0, 0].item() == 0


def test_copy_broadcasts_converts_and_writes_through_views():
    base = dt.zeros(3, 4)
    col = base[:, 1]
    col.copy_(dt.tensor([1, 2, 3]))  # int64 -> float32
    assert base.numpy()[:, 1].tolist() == [1.0, 2.0, 3.0] and base.dtype == dt.float32
    base.t().copy_(dt.arange(3))  # broadcast over rows of the transpose
    np.testing.assert_array_equal(base.numpy(), np.tile(np.arange(3.0)[:, None], (1, 4)))
    base.copy_(np.ones(4))
    assert (base.numpy() == 1).all()
    base.copy_(2.5)
    assert (base.numpy() == 2.5).all()
    with pytest.raises(ValueError, match=r"copy_: source of shape \(5,\) cannot be broadcast"):
        base.copy_(dt.zeros(5))
    ramp = dt.arange(5, dtype=dt.float32)
    ramp[1:].copy_(ramp[:-1])  # overlapping source and destination
    assert ramp.tolist() == [0.0, 0.0, 1.0, 2.0, 3.0]


def test_fill_zero_and_new_factories():
    a = dt.ones(2, 3, dtype=dt.int32)
    assert a.fill_(7) is a and a.tolist() == [[7] * 3] * 2
    a[:, 1].zero_()
    assert a.tolist() == [[7, 0, 7]] * 2
    a.fill_(dt.tensor(3))
    assert a.tolist() == [[3] * 3] * 2
    n = a.new_zeros(2, 2)
    assert n.dtype == dt.int32 and n.tolist() == [[0, 0], [0, 0]]
    assert a.new_ones((3,)).tolist() == [1, 1, 1] and a.new_ones(3).dtype == dt.int32
    assert a.new_empty(4, dtype=dt.float64).dtype == dt.float64
    full = a.new_full((2,), 2.9)
    assert full.dtype == dt.int32 and full.tolist() == [2, 2]
    nt = a.new_tensor([1.5, 2.5])
    assert nt.dtype == dt.int32 and nt.tolist() == [1, 2]


def test_as_strided_checks_bounds():
    a = dt.arange(10)
    s = a.as_strided((3, 3), (2, 1), 1)
    assert meta(s) == ((3, 3), (2, 1), 1)
    np.testing.assert_array_equal(s.numpy(), [[1, 2, 3], [3, 4, 5], [5, 6, 7]])
    with pytest.raises(ViewError, match="out of bounds for storage of size 80"):
        a.as_strided((4, 4), (4, 1))


# ------------------------------------------------------------ conversions / misc


def test_to_returns_self_when_nothing_changes():
    a = dt.arange(6).view(2, 3)
    assert a.to(dt.int64) is a and a.to("cpu") is a and a.to(a) is a and a.cpu() is a
    assert a.to(device="cpu", dtype=dt.int64) is a
    c = a.to(dt.int64, copy=True)
    assert c is not a and not same_storage(c, a)
    f = a.t().to(dt.float64)  # preserve_format keeps the transposed strides
    assert f.dtype == dt.float64 and meta(f) == ((3, 2), (1, 3), 0)
    assert a.to("cpu", dt.float32).dtype == dt.float32
    assert a.float().dtype == dt.float32 and a.double().dtype == dt.float64
    assert a.half().dtype == dt.float16 and a.int().dtype == dt.int32
    assert a.long() is a and a.bool().dtype == dt.bool and a.byte().dtype == dt.uint8
    assert a.short().dtype == dt.int16 and a.char().dtype == dt.int8
    assert a.type_as(dt.zeros(1)).dtype == dt.float32
    assert dt.tensor([1.9, -1.9]).int().tolist() == [1, -1]  # truncation like PyTorch


def test_numpy_is_zero_copy_and_array_protocol():
    a = dt.arange(6, dtype=dt.float32).view(2, 3)
    n = a.numpy()
    n[0, 0] = 42
    assert a[0, 0].item() == 42 and np.shares_memory(n, a.t().numpy())
    assert np.asarray(a) is not None and np.shares_memory(np.asarray(a), n)
    assert np.asarray(a, dtype=np.float64).dtype == np.float64
    assert not np.shares_memory(np.array(a, copy=True), n)


def test_scalar_conversions_and_errors():
    s = dt.tensor([[2.5]])
    assert s.item() == 2.5 and float(s) == 2.5 and int(s) == 2 and bool(s)
    assert dt.tensor(3).__index__() == 3 and [0, 1, 2, 3][dt.tensor(3)] == 3
    assert dt.tensor(7).tolist() == 7 and dt.tensor([[1, 2]]).tolist() == [[1, 2]]
    with pytest.raises(RuntimeError, match="a Tensor with 2 elements cannot be converted"):
        dt.tensor([1, 2]).item()
    with pytest.raises(RuntimeError, match="ambiguous"):
        bool(dt.tensor([1, 2]))
    with pytest.raises(TypeError, match="len\\(\\) of a 0-d tensor"):
        len(dt.tensor(1))
    with pytest.raises(TypeError, match="iteration over a 0-d tensor"):
        iter(dt.tensor(1))
    with pytest.raises(TypeError, match="only integer tensors"):
        dt.tensor(1.0).__index__()


def test_repr_is_pytorch_like():
    assert repr(dt.tensor([1.5, 2.0])) == "tensor([1.5000, 2.0000])"
    assert repr(dt.tensor([1.0, 2.0])) == "tensor([1., 2.])"
    assert repr(dt.tensor([1, 2])) == "tensor([1, 2])"
    assert repr(dt.tensor([True, False])) == "tensor([ True, False])"
    assert repr(dt.tensor([1, 2], dtype=dt.int32)) == "tensor([1, 2], dtype=dt.int32)"
    assert repr(dt.tensor([1.0], dtype=dt.float64)) == "tensor([1.], dtype=dt.float64)"
    assert repr(dt.tensor(2.5)) == "tensor(2.5000)"
    assert repr(dt.empty(0)) == "tensor([])"
    assert repr(dt.empty(0, 3)) == "tensor([], size=(0, 3))"
    assert repr(dt.arange(4).view(2, 2)) == "tensor([[0, 1],\n        [2, 3]])"


def test_pickle_round_trip():
    import pickle

    a = dt.arange(6, dtype=dt.float64).view(2, 3).t()
    b = pickle.loads(pickle.dumps(a))
    assert isinstance(b, dt.Tensor) and b.dtype == dt.float64
    np.testing.assert_array_equal(b.numpy(), a.numpy())


def test_is_contiguous_matches_the_reference_rule():
    cases = [
        dt.arange(24).view(2, 3, 4),
        dt.arange(24).view(2, 3, 4).transpose(0, 1),
        dt.arange(12).view(3, 4)[:, 1:2],
        dt.arange(12).view(3, 4)[:, ::2],
        dt.empty(0, 5).t(),
        dt.arange(4).view(4, 1).t(),
        dt.tensor(1),
        dt.arange(3).expand(1, 3),
        dt.arange(3).expand(2, 3),
    ]
    for t in cases:
        assert t.is_contiguous() == _strides.is_contiguous(tuple(t.shape), t.stride())
