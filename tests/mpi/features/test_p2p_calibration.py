"""The calibration's point-to-point constants (``Calibration.p2p``): a ring step of float32
blocks measured on every rank alike, fitted beside the collectives by ``calibrate``."""

from __future__ import annotations

import pytest
from mpi4py import MPI

import dtensor as dt
from dtensor.autoshard._measure import measure_p2p

WORLD = MPI.COMM_WORLD
pytestmark = pytest.mark.mpi(min_size=2)


def test_p2p_ring_steps_and_their_fit():
    mesh = dt.init_device_mesh((WORLD.size,))
    points = measure_p2p(mesh, [16, 128], repeat=2)
    assert [b for b, _ in points] == [16 * 16 * 4, 128 * 128 * 4]
    assert all(s > 0 for _, s in points)
    assert WORLD.allgather(points) == [points] * WORLD.size  # the slowest rank's, everywhere
    cal = dt.autoshard.calibrate(mesh, save=False, sizes=(16, 32), repeat=2)
    assert set(cal.p2p) == {"alpha_s", "beta_bytes_per_s"}
    assert cal.p2p["beta_bytes_per_s"] > 0 and cal.p2p["alpha_s"] >= 0
    assert len(cal.points["p2p"]) == 2
    assert dt.autoshard.Calibration.from_dict(cal.to_dict()).p2p == cal.p2p
