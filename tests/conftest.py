"""Hypothesis settings profiles: ``ci`` (default, more examples) and ``dev`` (quick),
chosen with the ``HYPOTHESIS_PROFILE`` environment variable. No deadline: a derived
schedule's size grows with p*m, so example times vary."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=100, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=15, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
