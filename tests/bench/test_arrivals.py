"""Arrival processes: seeded reproducibility, mean rates, gamma burstiness and the spike's shape."""

from __future__ import annotations

import numpy as np
import pytest

from bench.loadgen.arrivals import Burst, ClosedLoop, Gamma, Poisson, Spike


def rng(seed=0):
    return np.random.default_rng(seed)


def cv(times: np.ndarray) -> float:
    gaps = np.diff(times)
    return float(gaps.std() / gaps.mean())


@pytest.mark.parametrize("process", [Poisson(3.0), Gamma(3.0, 0.3), Spike(1.0, 10, 5, 5)])
def test_same_seed_gives_same_times_and_other_seeds_differ(process):
    a = process.times(60.0, rng(7))
    b = process.times(60.0, rng(7))
    c = process.times(60.0, rng(8))
    np.testing.assert_array_equal(a, b)
    assert len(a) != len(c) or not np.allclose(a, c)


@pytest.mark.parametrize("process", [Poisson(3.0), Gamma(3.0, 0.3), Spike(1.0, 10, 5, 5)])
def test_times_are_sorted_and_inside_the_window(process):
    t = process.times(40.0, rng(1))
    assert len(t) > 0 and np.all(np.diff(t) >= 0) and t[0] >= 0 and t[-1] < 40.0


def test_poisson_has_the_asked_mean_rate_and_exponential_gaps():
    t = Poisson(5.0).times(4000.0, rng(2))
    assert len(t) / 4000.0 == pytest.approx(5.0, rel=0.03)  # 20000 expected, sd ~0.7%
    assert cv(t) == pytest.approx(1.0, abs=0.03)


@pytest.mark.parametrize("burstiness, expected_cv", [(0.25, 2.0), (1.0, 1.0), (4.0, 0.5)])
def test_gamma_keeps_the_rate_and_burstiness_sets_the_gap_spread(burstiness, expected_cv):
    t = Gamma(4.0, burstiness).times(5000.0, rng(3))
    assert len(t) / 5000.0 == pytest.approx(4.0, rel=0.05)
    assert cv(t) == pytest.approx(expected_cv, rel=0.08)


def test_lower_burstiness_packs_more_arrivals_into_the_busiest_second():
    def busiest(b: float) -> int:
        return int(np.bincount(Gamma(2.0, b).times(2000.0, rng(4)).astype(int)).max())

    assert busiest(0.1) > 2 * busiest(1.0)


def test_spike_multiplies_the_rate_only_inside_its_window():
    spike = Spike(rate=2.0, factor=10.0, start_s=30.0, length_s=30.0)
    counts = np.zeros(3)
    for seed in range(20):
        t = spike.times(90.0, rng(seed))
        counts += [np.sum(t < 30), np.sum((t >= 30) & (t < 60)), np.sum(t >= 60)]
    per_second = counts / (20 * 30.0)
    assert per_second[0] == pytest.approx(2.0, rel=0.1)
    assert per_second[1] == pytest.approx(20.0, rel=0.05)
    assert per_second[2] == pytest.approx(2.0, rel=0.1)


def test_spike_window_is_clipped_to_the_run():
    assert Spike(1.0, 10, 50, 30).segments(60.0) == [(0.0, 50.0, 1.0), (50.0, 60.0, 10.0)]
    assert Spike(1.0, 10, 70, 30).segments(60.0) == [(0.0, 60.0, 1.0)]


def test_burst_sends_everything_at_once():
    np.testing.assert_array_equal(Burst(32).times(10.0, rng()), np.zeros(32))


@pytest.mark.parametrize("make", [lambda: Poisson(0), lambda: Gamma(1, 0), lambda: Spike(1, 0),
                                  lambda: Burst(0), lambda: ClosedLoop(0)])
def test_invalid_parameters_are_rejected(make):
    with pytest.raises(ValueError):
        make()
