"""Fixtures of the unit tests: process-wide dtensor state is restored after each test.

The default dtype and the global random generator are module state; a test that
changes them must not leak into the next one. A skip whose reason ``tests/skips.py``
does not expect fails the session. Tests marked ``mode_independent`` are deselected in the
test runner's second-mode stage.
"""

from __future__ import annotations

import os

import pytest
import skips

import dtensor as dt

#: Set by the test runner (``launch.runtests.MODE_INDEPENDENT_ENV``) when the other mode's
#: stage already ran the tests marked ``mode_independent``.
MODE_INDEPENDENT_ENV = "DTENSOR_TEST_MODE_INDEPENDENT_DONE"


def pytest_configure(config: pytest.Config) -> None:
    skips.register(config)
    config.addinivalue_line(
        "markers",
        "mode_independent: the outcome does not depend on DTENSOR_FASTPATH (rules, plans, "
        "the runner and launcher); the test runner runs it in one mode's stage only",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get(MODE_INDEPENDENT_ENV) != "1":
        return
    done = [item for item in items if item.get_closest_marker("mode_independent")]
    if done:
        config.hook.pytest_deselected(items=done)
        items[:] = [item for item in items if not item.get_closest_marker("mode_independent")]


@pytest.fixture(autouse=True)
def _restore_dtensor_globals():
    dtype = dt.get_default_dtype()
    rng = dt.get_rng_state()
    yield
    dt.set_default_dtype(dtype)
    dt.set_rng_state(rng)
