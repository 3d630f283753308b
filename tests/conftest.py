"""Settings shared by every test folder: hypothesis profiles and the suite's markers.

Profiles: ``ci`` (the default: a bounded number of examples, no deadline, since the
machines running the suite are shared and slow) and ``long`` (many more examples), chosen
with ``HYPOTHESIS_PROFILE=long``.

Marker ``mode_independent``: the test's outcome does not depend on ``DTENSOR_FASTPATH``
(rules, plans, the redistribute executor and collectives below dtensor, the runner and
launcher). The test runner (``python -m launch test``) runs such tests in its first mode's
stages only: the second mode's stages pass ``-m "not mode_independent"``.
"""

from __future__ import annotations

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
