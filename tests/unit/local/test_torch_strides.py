"""Strides of new tensors and of empty step slices, as PyTorch gives them.

The expected values were recorded from PyTorch 2.13 (``torch.arange(n).float().reshape``
followed by the same view chain): ``clone``, ``empty_like`` and a cast (``to``) use
PyTorch's ``preserve_format`` (a dense input keeps its strides exactly, size-1 dims and
tensors without elements included; an input with holes or overlaps gets dense strides in
the order of its own, PyTorch's ``infer_dense_strides``), and a step slice keeps
``step * stride`` even when it selects nothing. With torch installed, random view chains
are compared with it too.
"""

from __future__ import annotations

import random

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
    # holes or overlaps in permuted dims: dense strides in the input's stride order
    "permuted_holes": (lambda: _base(2, 3, 4).permute(2, 0, 1)[:, :, ::2],
                       ((4, 2, 2), (1, 12, 8), (1, 8, 4), (1, 8, 4), (1, 8, 4))),
    "transposed_holes": (lambda: _base(3, 4)[:, ::2].t(),
                         ((2, 3), (2, 4), (1, 2), (1, 2), (1, 2))),
    "expanded_permuted": (lambda: _base(3, 1).expand(3, 4).t(),
                          ((4, 3), (0, 1), (3, 1), (3, 1), (3, 1))),
    "select_transposed": (lambda: _base(5, 3, 2)[:, 1].t().unsqueeze(0),
                          ((1, 2, 5), (2, 1, 6), (2, 1, 2), (2, 1, 2), (2, 1, 2))),
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


def _chain(rng: random.Random):
    """A random view chain applied to a dtensor and a torch tensor alike."""
    import torch

    shape = [rng.choice([1, 2, 3, 4, 5]) for _ in range(rng.randint(1, 4))]
    n = int(np.prod(shape))
    a = _base(*shape)
    b = torch.arange(n, dtype=torch.float32).reshape(shape)
    for _ in range(rng.randint(1, 4)):
        nd, k = a.ndim, rng.randint(0, 5)
        if k == 0 and nd >= 2:
            p = list(range(nd))
            rng.shuffle(p)
            a, b = a.permute(*p), b.permute(*p)
        elif k == 1:
            d = rng.randrange(nd)
            start = rng.randint(0, a.shape[d])
            idx = (slice(None),) * d + (slice(start, rng.randint(start, a.shape[d]),
                                              rng.randint(1, 3)),)
            a, b = a[idx], b[idx]
        elif k == 2:
            d = rng.randint(0, nd)
            a, b = a.unsqueeze(d), b.unsqueeze(d)
        elif k == 3:
            d = rng.randrange(nd)
            if a.shape[d] == 1:
                size = list(a.shape)
                size[d] = rng.randint(2, 3)
                a, b = a.expand(*size), b.expand(*size)
        elif k == 4 and nd >= 2:
            d0, d1 = rng.sample(range(nd), 2)
            a, b = a.transpose(d0, d1), b.transpose(d0, d1)
        elif k == 5 and nd >= 2 and a.shape[0]:
            i = rng.randrange(a.shape[0])
            a, b = a.select(0, i), b.select(0, i)
    return a, b


@pytest.mark.torch
def test_new_tensor_strides_match_torch_on_random_view_chains():
    import torch

    rng = random.Random(36)
    for _ in range(600):
        a, b = _chain(rng)
        assert a.stride() == b.stride()
        assert a.clone().stride() == b.clone().stride(), (a.shape, a.stride())
        assert dt.empty_like(a).stride() == torch.empty_like(b).stride(), (a.shape, a.stride())
        assert a.to(dt.float64).stride() == b.to(torch.float64).stride()
        np.testing.assert_array_equal(a.clone().numpy(), b.clone().numpy())
