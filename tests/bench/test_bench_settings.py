"""Every benchmark that starts a gateway starts it with the shipped admission settings unless a
flag of its own says otherwise, and prints (and records) what it runs with and why."""

from __future__ import annotations

import pytest

from bench import fairness, interference, routing, tracing_overhead
from bench.run_settings import ADMISSION_FIELDS, RunSettings, gateway_default, gateway_override

ADMISSION_FLAGS = {"--" + name.replace("_", "-") for name in ADMISSION_FIELDS}


@pytest.fixture(autouse=True)
def _no_inherited_admission(monkeypatch):
    for name in ADMISSION_FIELDS:
        monkeypatch.delenv(f"SPLITSERVE_GATEWAY_{name.upper()}", raising=False)


def _admission_flags(settings: RunSettings) -> set[str]:
    return set(settings.gateway_args()) & ADMISSION_FLAGS


@pytest.mark.parametrize("bench", [routing, tracing_overhead], ids=lambda m: m.__name__)
def test_default_command_line_passes_no_admission_flag_to_the_gateway(bench):
    settings = bench.run_settings(bench.build_parser().parse_args([]))
    assert _admission_flags(settings) == set()
    assert settings.admission()["ttft_target_s"] == f"{gateway_default('ttft_target_s'):g}"
    text = settings.text()
    assert "ttft_target_s=1 [default]" in text
    assert "max_inflight_per_decode=0 (the decode workers' max_running) [default]" in text
    # what it does change is printed with a reason
    assert "override: gateway --health-interval-s 0.2 (shipped: 1):" in text


@pytest.mark.parametrize("bench", [routing, tracing_overhead], ids=lambda m: m.__name__)
def test_a_flag_turns_the_ttft_target_off_and_says_so(bench):
    settings = bench.run_settings(bench.build_parser().parse_args(
        ["--gateway-ttft-target-s", "0"]))
    i = settings.gateway_args().index("--ttft-target-s")
    assert settings.gateway_args()[i + 1] == "0"
    assert "override: gateway --ttft-target-s 0 (off) (shipped: 1): --gateway-ttft-target-s given" \
        in settings.text()


def test_fairness_keeps_only_its_in_flight_limit_and_prints_why():
    args = fairness.build_parser().parse_args([])
    settings = fairness.run_settings(args.inflight, args.ttft_target_s)
    assert _admission_flags(settings) == {"--max-inflight-per-decode"}
    assert settings.admission()["ttft_target_s"] == "1"
    text = settings.text()
    assert "max_inflight_per_decode=4," in text
    assert "--max-inflight-per-decode 4 (shipped: 0 (the decode workers' max_running)): " \
           "requests must queue" in text
    assert fairness.goodput_target_s(settings) == 1.0
    shipped = fairness.run_settings(0, None)
    assert _admission_flags(shipped) == set()
    off = fairness.run_settings(0, 0.0)
    assert fairness.goodput_target_s(off) == 1.0  # goodput still judged by the shipped target


def test_interference_says_no_gateway_is_in_its_path():
    args = interference.build_parser().parse_args([])
    args.steady_tokens = 2000
    settings = interference.run_settings(args)
    assert settings.admission() == {} and settings.gateway_args() == []
    text = settings.text()
    assert "no gateway in the path" in text and "--kv-cache-memory 2GiB (shipped: 1GiB)" in text


def test_recorded_settings_carry_each_override_with_its_reason():
    settings = RunSettings("b", (gateway_override("max_inflight", 3, "why not"),))
    recorded = settings.to_json()
    assert recorded["admission"]["max_inflight"] == "3"
    assert recorded["overrides"] == [{"process": "gateway", "setting": "max_inflight",
                                      "value": "3", "default": "0", "reason": "why not"}]
