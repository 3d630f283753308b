"""Settings shared by every test folder: hypothesis profiles and the suite's markers.

Profiles: ``ci`` (the default: a bounded number of examples, no deadline, since the
machines running the suite are shared and slow) and ``long`` (many more examples), chosen
with ``HYPOTHESIS_PROFILE=long``.

Marker ``mode_independent``: the test's outcome does not depend on ``DTENSOR_FASTPATH``
(rules, plans, the redistribute executor and collectives below dtensor, the runner and
launcher). The test runner (``python -m launch test``) runs such tests in its first mode's
stages only: the second mode's stages pass ``-m "not mode_independent"``.

Marker ``torch``: the test takes torch (CPU) as its oracle. torch is in the ``[test]``
extras, so these tests run wherever the test dependencies are installed; where torch is not
installed a marked test skips with the reason ``torch is not installed`` (an expected skip
in ``tests/skips.py`` only while that holds), and ``-m "not torch"`` leaves them out.
Every test that imports torch carries it (``tests/unit/tools/test_torch_marker.py`` reads
the test sources and checks).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "long", max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "mode_independent: the outcome does not depend on DTENSOR_FASTPATH; the test runner "
        "runs it in its first mode's stages only",
    )
    config.addinivalue_line(
        "markers",
        "torch: the test compares with torch (CPU); skipped where torch is not installed, "
        'left out by -m "not torch"',
    )


#: Whether torch, the oracle of the tests marked ``torch``, is importable here.
HAS_TORCH = importlib.util.find_spec("torch") is not None


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("torch") is not None and not HAS_TORCH:
        pytest.skip("torch is not installed")
