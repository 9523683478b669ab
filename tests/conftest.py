"""Hypothesis settings profiles: ``ci`` (default, more examples) and ``dev`` (quick),
chosen with the ``HYPOTHESIS_PROFILE`` environment variable. No deadline: a derived
schedule's size grows with p*m, so example times vary.

The session's own cache directory: ``check`` keeps proofs of the families' laws in
``$XDG_CACHE_HOME/mpipe-verify``; the tests (and the commands they start, which inherit the
environment) use a fresh one, never the user's."""

from __future__ import annotations

import os
import shutil
import tempfile

from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=100, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=15, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_configure(config):
    config._mpipe_cache = tempfile.mkdtemp(prefix="mpipe-test-cache-")
    os.environ["XDG_CACHE_HOME"] = config._mpipe_cache


def pytest_unconfigure(config):
    shutil.rmtree(getattr(config, "_mpipe_cache", ""), ignore_errors=True)
