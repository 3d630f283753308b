"""A local Tensor and a DTensor answer a view call the same way: one metadata semantics.

:mod:`placements.meta` holds PyTorch's shape checks once: the local tensor applies them to
its own shape, the sharding rules to a DTensor's global shape. For every bad call below, a
local Tensor and a DTensor over a 1-rank mesh (whose error comes from the rule) raise the
same exception type with the same message. The dispatcher appends its context to some
DTensor errors (`` [op view; inputs: DTensor([R], shape (2, 3), float32); mesh (1,)]``);
that suffix is stripped before comparing. Good calls give equal shapes and values.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

import dtensor as dt
from dtensor import errors

# the dispatcher's context after a DTensor's error message
_CONTEXT = re.compile(r" \[op \w+; inputs: .*; mesh \([\d, ]*\)\]$")


@pytest.fixture(scope="module")
def mesh():
    return dt.init_device_mesh((1,))


def _pair(shape: tuple, mesh, placement) -> tuple:
    """A local Tensor and a DTensor (placed by ``placement`` on ``mesh``) of equal values."""
    a = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    x = dt.distribute_tensor(a, mesh, [placement], src_data_rank=None)
    assert isinstance(x, dt.DTensor) and not isinstance(dt.from_numpy(a), dt.DTensor)
    return dt.from_numpy(a.copy()), x


def _placements(shape: tuple) -> list:
    return [dt.Replicate()] + ([dt.Shard(0)] if shape else [])


def _raised(fn, x) -> tuple[type, str]:
    """The type and message (without the dispatcher's context) of what ``fn(x)`` raised."""
    try:
        fn(x)
    except Exception as exc:  # noqa: BLE001 - the error itself is what is compared
        return type(exc), _CONTEXT.sub("", str(exc))
    raise AssertionError("the call did not raise")


# (shape of the tensor, the bad call); the id is the call as written
BAD = {
    # view / reshape
    "view(4, 2)": ((2, 3), lambda t: t.view(4, 2)),
    "view(-1, -1)": ((2, 3), lambda t: t.view(-1, -1)),
    "view(-2, 3)": ((2, 3), lambda t: t.view(-2, 3)),
    "view(2, 1.5)": ((2, 3), lambda t: t.view(2, 1.5)),
    "view((3, 'a'))": ((2, 3), lambda t: t.view((3, "a"))),
    "empty view(-1, 0)": ((0, 3), lambda t: t.view(-1, 0)),
    "reshape(5)": ((2, 3), lambda t: t.reshape(5)),
    "transposed reshape(7)": ((2, 3), lambda t: t.t().reshape(7)),
    "0-d view(2)": ((), lambda t: t.view(2)),
    # narrow
    "narrow(2, 0, 1)": ((2, 3), lambda t: t.narrow(2, 0, 1)),
    "narrow(0, 1, 2)": ((2, 3), lambda t: t.narrow(0, 1, 2)),
    "narrow(0, -3, 1)": ((2, 3), lambda t: t.narrow(0, -3, 1)),
    "narrow(1, 4, 0)": ((2, 3), lambda t: t.narrow(1, 4, 0)),
    "narrow(0, 0, -1)": ((2, 3), lambda t: t.narrow(0, 0, -1)),
    "narrow('a', 0, 1)": ((2, 3), lambda t: t.narrow("a", 0, 1)),
    "0-d narrow": ((), lambda t: t.narrow(0, 0, 1)),
    # expand
    "expand(2, 4)": ((2, 3), lambda t: t.expand(2, 4)),
    "expand(3)": ((2, 3), lambda t: t.expand(3)),
    "expand(-1, 2, 3)": ((2, 3), lambda t: t.expand(-1, 2, 3)),
    "expand(2, -2)": ((2, 3), lambda t: t.expand(2, -2)),
    "expand(2, 3.0)": ((2, 3), lambda t: t.expand(2, 3.0)),
    "expand((5, 3)) of (1, 2)": ((1, 2), lambda t: t.expand((5, 3))),
    # select
    "select(0, 5)": ((2, 3), lambda t: t.select(0, 5)),
    "select(1, -4)": ((2, 3), lambda t: t.select(1, -4)),
    "select(3, 0)": ((2, 3), lambda t: t.select(3, 0)),
    "0-d select": ((), lambda t: t.select(0, 0)),
    # squeeze
    "squeeze(5)": ((2, 3), lambda t: t.squeeze(5)),
    "squeeze((0, 7))": ((2, 3), lambda t: t.squeeze((0, 7))),
    "squeeze(1.5)": ((2, 3), lambda t: t.squeeze(1.5)),
    "0-d squeeze(1)": ((), lambda t: t.squeeze(1)),
    # permute / transpose / t / movedim
    "permute(0)": ((2, 3), lambda t: t.permute(0)),
    "permute(0, 0)": ((2, 3), lambda t: t.permute(0, 0)),
    "permute(0, -2)": ((2, 3), lambda t: t.permute(0, -2)),
    "permute(0, 2)": ((2, 3), lambda t: t.permute(0, 2)),
    "permute((1, 0.0))": ((2, 3), lambda t: t.permute((1, 0.0))),
    "transpose(0, 2)": ((2, 3), lambda t: t.transpose(0, 2)),
    "transpose(-3, 0)": ((2, 3), lambda t: t.transpose(-3, 0)),
    "transpose(0, 'a')": ((2, 3), lambda t: t.transpose(0, "a")),
    "swapaxes(0, 2)": ((2, 3), lambda t: t.swapaxes(0, 2)),
    "swapdims(5, 0)": ((2, 3), lambda t: t.swapdims(5, 0)),
    "0-d transpose(0, 1)": ((), lambda t: t.transpose(0, 1)),
    "t() of 3-D": ((2, 3, 4), lambda t: t.t()),
    "movedim(0, 2)": ((2, 3), lambda t: t.movedim(0, 2)),
    "movedim((0, 1), 0)": ((2, 3), lambda t: t.movedim((0, 1), 0)),
    "movedim((0, 0), (0, 1))": ((2, 3), lambda t: t.movedim((0, 0), (0, 1))),
    "moveaxis(1, (0, 1))": ((2, 3), lambda t: t.moveaxis(1, (0, 1))),
    # flatten / unflatten
    "flatten(1, 0)": ((2, 3), lambda t: t.flatten(1, 0)),
    "flatten(3)": ((2, 3), lambda t: t.flatten(3)),
    "flatten(0, -3)": ((2, 3), lambda t: t.flatten(0, -3)),
    "0-d flatten(1)": ((), lambda t: t.flatten(1)),
    "unflatten(0, (3, 2))": ((4, 3), lambda t: t.unflatten(0, (3, 2))),
    "unflatten(0, ())": ((4, 3), lambda t: t.unflatten(0, ())),
    "unflatten(2, (2, 2))": ((4, 3), lambda t: t.unflatten(2, (2, 2))),
    "unflatten(1, (-1, -1))": ((4, 3), lambda t: t.unflatten(1, (-1, -1))),
    "unflatten(0, (2, 2.0))": ((4, 3), lambda t: t.unflatten(0, (2, 2.0))),
    "0-d unflatten": ((), lambda t: t.unflatten(0, (1,))),
    # split / chunk / unbind
    "split(0)": ((4, 3), lambda t: t.split(0)),
    "split(-1)": ((4, 3), lambda t: t.split(-1)),
    "split([1, 2])": ((4, 3), lambda t: t.split([1, 2])),
    "split([5, -1])": ((4, 3), lambda t: t.split([5, -1])),
    "split(2, 3)": ((4, 3), lambda t: t.split(2, 3)),
    "0-d split": ((), lambda t: t.split(1)),
    "chunk(0)": ((4, 3), lambda t: t.chunk(0)),
    "chunk(2, 5)": ((4, 3), lambda t: t.chunk(2, 5)),
    "0-d chunk": ((), lambda t: t.chunk(2)),
    "unbind(2)": ((4, 3), lambda t: t.unbind(2)),
    "0-d unbind": ((), lambda t: t.unbind()),
    # basic indexing
    "[10]": ((4, 3), lambda t: t[10]),
    "[-5]": ((4, 3), lambda t: t[-5]),
    "[:, 5]": ((4, 3), lambda t: t[:, 5]),
    "[1, 2, 3]": ((4, 3), lambda t: t[1, 2, 3]),
    "[None, 1, 2, 0]": ((4, 3), lambda t: t[None, 1, 2, 0]),
    "[::-1]": ((4, 3), lambda t: t[::-1]),
    "[None, 0:2, ::0]": ((4, 3), lambda t: t[None, 0:2, ::0]),
    "[..., ...]": ((4, 3), lambda t: t[..., ...]),
    "[1.5]": ((4, 3), lambda t: t[1.5]),
    "[0, 'a']": ((4, 3), lambda t: t[0, "a"]),
    "0-d [0]": ((), lambda t: t[0]),
    "0-d [..., 0]": ((), lambda t: t[..., 0]),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_call_raises_the_same_error(case, mesh):
    shape, fn = BAD[case]
    for placement in _placements(shape):
        local, dist = _pair(shape, mesh, placement)
        expected = _raised(fn, local)
        assert issubclass(expected[0], errors.DTensorError), expected  # checked, not numpy's
        assert _raised(fn, dist) == expected, placement


I1 = np.int64(1)

# (shape of the tensor, the good call)
GOOD = {
    "view(3, 2)": ((2, 3), lambda t: t.view(3, 2)),
    "view(-1)": ((2, 3), lambda t: t.view(-1)),
    "view((1, -1, 1))": ((2, 3), lambda t: t.view((1, -1, 1))),
    "reshape(3, np.int64(2))": ((2, 3), lambda t: t.reshape(3, np.int64(2))),
    "0-d view(1, 1)": ((), lambda t: t.view(1, 1)),
    "narrow(1, 1, 2)": ((2, 3), lambda t: t.narrow(1, 1, 2)),
    "narrow(-1, -1, 1)": ((2, 3), lambda t: t.narrow(-1, -1, 1)),
    "narrow(0, 2, 0)": ((2, 3), lambda t: t.narrow(0, 2, 0)),
    "expand(4, 3) of (1, 3)": ((1, 3), lambda t: t.expand(4, 3)),
    "expand(2, -1, -1)": ((2, 3), lambda t: t.expand(2, -1, -1)),
    "0-d expand(2, 2)": ((), lambda t: t.expand(2, 2)),
    "select(1, -1)": ((2, 3), lambda t: t.select(1, -1)),
    "squeeze()": ((1, 3, 1), lambda t: t.squeeze()),
    "squeeze((0, 1, -1))": ((1, 3, 1), lambda t: t.squeeze((0, 1, -1))),
    "0-d squeeze(0)": ((), lambda t: t.squeeze(0)),
    "permute(-1, 0, 1)": ((2, 3, 4), lambda t: t.permute(-1, 0, 1)),
    "transpose(-1, 0)": ((2, 3), lambda t: t.transpose(-1, 0)),
    "0-d transpose(0, -1)": ((), lambda t: t.transpose(0, -1)),
    "t()": ((2, 3), lambda t: t.t()),
    "movedim((0, 1), (2, 0))": ((2, 3, 4), lambda t: t.movedim((0, 1), (2, 0))),
    "flatten()": ((2, 3, 4), lambda t: t.flatten()),
    "flatten(1, 1)": ((2, 3, 4), lambda t: t.flatten(1, 1)),
    "0-d flatten(0, -1)": ((), lambda t: t.flatten(0, -1)),
    "unflatten(1, (3, -1))": ((2, 6), lambda t: t.unflatten(1, (3, -1))),
    "split(3)": ((4, 3), lambda t: t.split(3)),
    "split([1, 0, 3])": ((4, 3), lambda t: t.split([1, 0, 3])),
    "chunk(3, -1)": ((4, 3), lambda t: t.chunk(3, -1)),
    "unbind(1)": ((4, 3), lambda t: t.unbind(1)),
    "[1:3]": ((4, 3), lambda t: t[1:3]),
    "[None, ..., -1]": ((4, 3), lambda t: t[None, ..., -1]),
    "[::2, 1]": ((4, 3), lambda t: t[::2, 1]),
    "[5:]": ((4, 3), lambda t: t[5:]),
    # numpy ints: the local fast paths decline them, the meta functions take them
    "narrow(i64 1, i64 1, 2)": ((2, 3), lambda t: t.narrow(I1, I1, 2)),
    "select(i64 1, -1)": ((2, 3), lambda t: t.select(I1, -1)),
    "squeeze(i64 0)": ((1, 3), lambda t: t.squeeze(np.int64(0))),
    "transpose(i64 1, 0)": ((2, 3), lambda t: t.transpose(I1, 0)),
    "permute([i64 1, 0])": ((2, 3), lambda t: t.permute([I1, 0])),
    "expand(i64 4, 3)": ((1, 3), lambda t: t.expand(np.int64(4), 3)),
    "flatten(i64 0)": ((2, 3), lambda t: t.flatten(np.int64(0))),
    "unflatten(1, [i64 3, -1])": ((2, 6), lambda t: t.unflatten(1, [np.int64(3), -1])),
    "[i64 1, ::i64 2]": ((4, 3), lambda t: t[I1, :: np.int64(2)]),
}


def _values(out) -> list:
    """The results of a call as a list of numpy arrays (one per output)."""
    outs = out if isinstance(out, tuple) else (out,)
    return [o.full_tensor().numpy() if isinstance(o, dt.DTensor) else o.numpy() for o in outs]


@pytest.mark.parametrize("case", list(GOOD), ids=list(GOOD))
def test_good_call_gives_the_same_result(case, mesh):
    shape, fn = GOOD[case]
    for placement in _placements(shape):
        local, dist = _pair(shape, mesh, placement)
        got, expected = _values(fn(dist)), _values(fn(local))
        assert len(got) == len(expected)
        for g, e in zip(got, expected):
            assert g.shape == e.shape and g.dtype == e.dtype
            np.testing.assert_array_equal(g, e)
