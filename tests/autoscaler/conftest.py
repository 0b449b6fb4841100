"""Fixtures shared by the autoscaler tests."""

from __future__ import annotations

import pytest

from services.autoscaler.profile import HardwareProfile
from tests.autoscaler.sample_profiles import make_profile


@pytest.fixture
def profile() -> HardwareProfile:
    return make_profile()
