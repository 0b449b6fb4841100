"""HardwareProfile: the cost models fitted to the measured points, and the JSON file
`splitserve profile` writes."""

from __future__ import annotations

import json

import pytest

from services.autoscaler.profile import DecodePoint, HardwareProfile, PrefillPoint
from tests.autoscaler.sample_profiles import make_profile


def test_prefill_fit_recovers_a_linear_cost(profile):
    # The shared profile's points lie on 0 + 0.001 * tokens exactly.
    assert profile.prefill_seconds(512) == pytest.approx(0.512)
    assert profile.prefill_seconds(4096) == pytest.approx(4.096)  # beyond the last point
    assert profile.prefill_tokens_per_s(1024) == pytest.approx(1000)


def test_decode_fit_recovers_overhead_batch_and_context_costs():
    points = tuple(DecodePoint(b, n, 0.02 + 0.003 * b + 1e-5 * b * n)
                   for b in (1, 8, 32) for n in (128, 1024))
    profile = make_profile(decode=points)
    a, b, c = profile.decode_fit
    assert (a, b, c) == pytest.approx((0.02, 0.003, 1e-5), rel=1e-6)
    assert profile.decode_step_seconds(64, 2048) == pytest.approx(0.02 + 0.192 + 1e-5 * 64 * 2048)


def test_a_noisy_point_cannot_make_a_bigger_batch_faster():
    # On a shared machine one measurement can come out slow; the fit stays monotonic.
    noisy = make_profile(decode=(DecodePoint(1, 128, 0.05), DecodePoint(4, 128, 0.30),
                                 DecodePoint(16, 128, 0.20), DecodePoint(64, 128, 0.60)))
    steps = [noisy.decode_step_seconds(b, 128) for b in (1, 2, 4, 8, 16, 32, 64, 128)]
    assert steps == sorted(steps)
    assert all(c >= 0 for c in noisy.decode_fit)


def test_coefficients_stay_nonnegative_when_the_data_suggest_otherwise():
    # Decreasing times would fit a negative slope; the per-token cost is dropped instead.
    profile = make_profile(prefill=(PrefillPoint(64, 0.3), PrefillPoint(512, 0.2)))
    a, b = profile.prefill_fit
    assert b == 0.0 and a > 0


def test_startup_prefers_the_measured_worker_start(profile):
    assert profile.startup_s == 5.0
    assert make_profile(worker_start_s=0.0).startup_s == 2.0


def test_round_trips_through_json(tmp_path, profile):
    path = tmp_path / "profile.json"
    profile.save(path)
    assert HardwareProfile.load(path) == profile
    assert json.loads(path.read_text())["version"] == 1


def test_rejects_other_versions_and_broken_files(tmp_path, profile):
    raw = json.loads(profile.to_json())
    raw["version"] = 99
    (tmp_path / "old.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="version 99"):
        HardwareProfile.load(tmp_path / "old.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="cannot read profile"):
        HardwareProfile.load(tmp_path / "broken.json")


def test_without_contention_divides_each_point_by_its_slowdown():
    profile = make_profile()
    n = len(profile.prefill) + len(profile.decode)
    slowed = make_profile(notes={"point_slowdown": [2.0] * n})
    fixed = slowed.without_contention()
    assert [p.seconds for p in fixed.prefill] == [p.seconds / 2 for p in profile.prefill]
    assert [p.seconds for p in fixed.decode] == pytest.approx([p.seconds / 2 for p in profile.decode])
    assert fixed.notes["as_measured"]["prefill"][0]["seconds"] == profile.prefill[0].seconds
    assert fixed.without_contention() is fixed  # not applied twice
    assert profile.without_contention() is profile  # nothing recorded: unchanged
