"""The short-term forecast: a level that follows the rate, a trend that sees a ramp coming,
and a cap that keeps one outlier from extrapolating into a stampede."""

from __future__ import annotations

import pytest

from services.autoscaler.forecast import TrendForecaster


def test_a_constant_rate_forecasts_itself():
    f = TrendForecaster()
    for t in range(50):
        f.observe(2.0 * t, 100.0)
    assert f.forecast(30) == pytest.approx(100.0)
    assert f.smoothed() == pytest.approx(100.0)


def test_a_ramp_is_forecast_ahead_of_the_latest_sample():
    f = TrendForecaster()
    for t in range(100):
        f.observe(2.0 * t, 10.0 * t)  # +5 per second
    latest = 10.0 * 99
    assert f.forecast(10) > latest
    assert f.forecast(10) == pytest.approx(latest + 50, rel=0.1)


def test_one_outlier_cannot_more_than_double_the_forecast():
    f = TrendForecaster(alpha=0.9, beta=0.9)
    for t in range(10):
        f.observe(float(t), 10.0)
    f.observe(10.0, 1000.0)
    assert f.forecast(1000) <= 2 * max(f.smoothed(), 1000.0)


def test_no_samples_forecast_zero_and_negative_rates_are_clipped():
    f = TrendForecaster()
    assert f.forecast(10) == 0.0
    f.observe(0.0, -5.0)
    f.observe(1.0, 0.0)
    assert f.forecast(10) >= 0.0


def test_a_sustained_step_moves_the_level_at_once_but_one_outlier_does_not():
    f = TrendForecaster()
    for t in range(30):
        f.observe(2.0 * t, 100.0)
    f.observe(60.0, 1000.0)
    assert f.smoothed() < 300  # one sample: could be noise
    f.observe(62.0, 1000.0)
    assert f.smoothed() == pytest.approx(1000.0)  # two in a row: a step
