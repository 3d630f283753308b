"""Settings shared by every test folder: hypothesis profiles.

Profiles: ``ci`` (the default: a bounded number of examples, no deadline, since the
machines running the suite are shared and slow) and ``long`` (many more examples), chosen
with ``HYPOTHESIS_PROFILE=long``.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "long", max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
