"""Fixtures of the unit tests: process-wide dtensor state is restored after each test.

The default dtype and the global random generator are module state; a test that
changes them must not leak into the next one. A skip whose reason ``tests/skips.py``
does not expect fails the session. The ``mode_independent`` marker is ``tests/conftest.py``'s.
"""

from __future__ import annotations

import pytest
import skips

import dtensor as dt


def pytest_configure(config: pytest.Config) -> None:
    skips.register(config)


@pytest.fixture(autouse=True)
def _restore_dtensor_globals():
    dtype = dt.get_default_dtype()
    rng = dt.get_rng_state()
    yield
    dt.set_default_dtype(dtype)
    dt.set_rng_state(rng)
