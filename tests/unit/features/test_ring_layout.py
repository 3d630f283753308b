"""The load-balanced sequence layout of ``dt.context_parallel`` (no MPI): every rank's runs
together cover the sequence once, each rank holds its ``torch.chunk`` share of the
sequence, and when ``2n`` divides the length rank ``r`` holds exactly chunks ``r`` and
``2n-1-r`` of ``2n`` equal chunks (PyTorch's load balancing)."""

from __future__ import annotations

import numpy as np
import pytest

from dtensor.ring_attention import runs_len, sequence_positions

pytestmark = pytest.mark.mode_independent


def _positions(runs):
    return [p for start, length in runs for p in range(start, start + length)]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("balanced", [True, False])
def test_runs_cover_the_sequence_once_with_torch_chunk_shares(n, balanced):
    for seq in range(41):
        every = []
        share = -(-seq // n)
        for r in range(n):
            runs = sequence_positions(seq, n, r, balanced)
            assert runs_len(runs) == max(0, min(share, seq - r * share)), (seq, n, r)
            every += _positions(runs)
        assert sorted(every) == list(range(seq)), (seq, n, balanced)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_balanced_ranks_hold_mirrored_chunks(n):
    for c in (1, 3, 4):
        seq = 2 * n * c
        for r in range(n):
            got = _positions(sequence_positions(seq, n, r, True))
            want = np.r_[r * c:(r + 1) * c, (2 * n - 1 - r) * c:(2 * n - r) * c]
            np.testing.assert_array_equal(got, want)


def test_plain_layout_is_one_contiguous_block():
    assert sequence_positions(10, 4, 1, False) == [(3, 3)]
    assert sequence_positions(5, 4, 3, False) == [(5, 0)]
