"""How ``dt.replicate`` groups parameters into gradient buckets (no MPI): reverse
registration order, at most the cap per bucket unless one parameter alone exceeds it, one
dtype per bucket, frozen parameters left out, ``bucket_cap_mb=0`` one per parameter."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import dtensor as dt
from dtensor.parallel._replicate import _bucket_plan, _reduce_dtype

F32, F64 = np.dtype(np.float32), np.dtype(np.float64)


def _params(*specs):
    """Stand-ins with what the plan reads: ``(numel, dtype[, requires_grad])`` each."""
    out = []
    for n, dtype, *grad in specs:
        out.append(SimpleNamespace(numel=lambda n=n: n, dtype=dtype,
                                   requires_grad=grad[0] if grad else True))
    return out


# float32 parameters of 40, 1200, 20, 20 and 4000 bytes, in registration order
SIZES = _params((10, F32), (300, F32), (5, F32), (5, F32), (1000, F32))


@pytest.mark.parametrize(("cap", "want"), [
    (0, [[4], [3], [2], [1], [0]]),                # one bucket per parameter
    (1300, [[4], [3, 2, 1, 0]]),                   # 4000 B alone; the rest fits in 1280 B
    (1000, [[4], [3, 2], [1], [0]]),               # closed before 1240 B; 1200 B alone
    (1280, [[4], [3, 2, 1, 0]]),                   # exactly the cap: closed at it
    (1 << 30, [[4, 3, 2, 1, 0]]),
])
def test_reverse_order_packed_up_to_the_cap(cap, want):
    assert _bucket_plan(SIZES, cap) == want


def test_one_dtype_per_bucket_and_frozen_parameters_left_out():
    params = _params((10, F32), (300, F32, False), (5, F64), (5, F32), (1000, F32))
    assert _bucket_plan(params, 1 << 30) == [[4, 3, 0], [2]]
    assert _bucket_plan(params, 0) == [[4], [3], [2], [0]]
    assert _bucket_plan(_params((3, F32, False)), 1 << 20) == []


def test_the_first_bucket_has_a_cap_of_its_own():
    # PyTorch's DDP: the first bucket (the last parameters, whose gradients come first)
    # holds at most 1 MiB, the others up to bucket_cap_mb
    assert _bucket_plan(SIZES, 1 << 30, 4000) == [[4], [3, 2, 1, 0]]
    assert _bucket_plan(SIZES, 1 << 30, 0) == [[4], [3, 2, 1, 0]]
    assert _bucket_plan(SIZES, 1 << 30, 1 << 30) == [[4, 3, 2, 1, 0]]


def test_buckets_of_bfloat16_sum_in_float32():
    """MPI has no bfloat16: its buckets are float32 (ml_dtypes' type is a registered one,
    ``isbuiltin == 2``); numpy's own floating types keep their dtype."""
    assert _reduce_dtype(np.dtype(dt.bfloat16)) == F32
    for dtype in (F32, F64, np.dtype(np.float16)):
        assert _reduce_dtype(dtype) == dtype

