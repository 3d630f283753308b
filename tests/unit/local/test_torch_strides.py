"""Strides of new tensors and of empty step slices, as PyTorch gives them.

The expected values were recorded from PyTorch 2.13 (``torch.arange(n).float().reshape``
followed by the same view chain): ``clone``, ``empty_like`` and a cast (``to``) use
PyTorch's ``preserve_format`` (a dense input keeps its strides exactly, size-1 dims and
tensors without elements included), and a step slice keeps ``step * stride`` even when it
selects nothing. (An input with holes or overlaps gets row-major strides: PyTorch's differ
when its dims are permuted, a documented difference.)
"""

from __future__ import annotations

import numpy as np
import pytest

import dtensor as dt


def _base(*shape):
    return dt.tensor(np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape))


# name: (view chain, (shape, view strides, clone strides, cast strides, empty_like strides))
CASES = {
    "permuted": (lambda: _base(2, 3, 4).permute(2, 0, 1),
                 ((4, 2, 3), (1, 12, 4), (1, 12, 4), (1, 12, 4), (1, 12, 4))),
    "transposed": (lambda: _base(3, 4).t(), ((4, 3), (1, 4), (1, 4), (1, 4), (1, 4))),
    "size1_dim": (lambda: _base(6, 4)[::6], ((1, 4), (24, 1), (24, 1), (24, 1), (24, 1))),
    "size1_dim_transposed": (lambda: _base(6, 4)[::6].t(),
                             ((4, 1), (1, 24), (1, 24), (1, 24), (1, 24))),
    "unsqueezed": (lambda: _base(3, 4).t().unsqueeze(1),
                   ((4, 1, 3), (1, 12, 4), (1, 12, 4), (1, 12, 4), (1, 12, 4))),
    "holes": (lambda: _base(2, 3, 4)[:, ::2],
              ((2, 2, 4), (12, 8, 1), (8, 4, 1), (8, 4, 1), (8, 4, 1))),
    "expanded": (lambda: _base(3, 1).expand(3, 4), ((3, 4), (1, 0), (4, 1), (4, 1), (4, 1))),
    "empty_step_slice": (lambda: _base(2, 3, 4)[:, 1:1:2],
                         ((2, 0, 4), (12, 8, 1), (12, 8, 1), (12, 8, 1), (12, 8, 1))),
    "empty_step_slice_past_end": (lambda: _base(2, 3, 4)[:, 5:9:2],
                                  ((2, 0, 4), (12, 8, 1), (12, 8, 1), (12, 8, 1), (12, 8, 1))),
    "empty_transposed": (lambda: _base(2, 3, 4).transpose(0, 2)[1:1],
                         ((0, 3, 2), (1, 4, 12), (1, 4, 12), (1, 4, 12), (1, 4, 12))),
    "empty_two_steps": (lambda: _base(2, 3, 4)[0:0:2, 1:1:3],
                        ((0, 0, 4), (24, 12, 1), (24, 12, 1), (24, 12, 1), (24, 12, 1))),
    "empty_step_last": (lambda: _base(3, 4)[:, 4::3], ((3, 0), (4, 3), (4, 3), (4, 3), (4, 3))),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_strides_match_pytorch(name):
    make, (shape, view, cloned, cast, like) = CASES[name]
    x = make()
    assert tuple(x.shape) == shape
    assert x.stride() == view
    c = x.clone()
    assert c.stride() == cloned
    assert c.untyped_storage().data_ptr() != x.untyped_storage().data_ptr() or x.numel() == 0
    np.testing.assert_array_equal(c.numpy(), x.numpy())
    assert x.to(dt.float64).stride() == cast
    assert dt.empty_like(x).stride() == like
