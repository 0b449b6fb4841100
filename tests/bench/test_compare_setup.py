"""How bench.compare sets up the systems (dtype, threads, the gateway's admission settings and
what it prints of them) and measures other work on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from bench.compare.machine import ForeignCpu, cores, process_tree
from bench.compare.sweep import peer_plan, point_seed
from bench.compare.systems import SYSTEMS, ServeOptions, serve_settings
from bench.compare.targets import max_sustainable_rate


def test_peer_runs_the_same_dtype_unless_told_otherwise():
    peer = SYSTEMS["transformers-serve"]
    command = peer.command("m", 1234, ServeOptions(dtype="bfloat16"))
    assert command[command.index("--dtype") + 1] == "bfloat16"
    command = peer.command("m", 1234, ServeOptions(dtype="bfloat16", peer_dtype="float32"))
    assert command[command.index("--dtype") + 1] == "float32"


def test_peer_gets_as_many_threads_as_splitserve_workers_together():
    assert ServeOptions().peer_omp_threads() == cores()
    assert ServeOptions(peer_threads=1).peer_omp_threads() == 1


def test_process_tree_follows_children_across_sessions():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                             start_new_session=True)
    try:
        assert child.pid in process_tree(os.getpid())
    finally:
        child.kill()
        child.wait()


def test_cpu_this_process_burns_counts_as_its_own_not_foreign():
    meter = ForeignCpu(os.getpid())
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    share = meter.stop()
    assert share["own_cpu_share"] > 0.0
    assert 0.0 <= share["foreign_cpu_share"] <= 1.0


def test_splitserve_starts_with_the_shipped_admission_and_no_override_by_default():
    from bench.compare.__main__ import build_parser

    args = build_parser().parse_args(["--quick"])
    assert args.gateway_ttft_target_s is None
    opts = ServeOptions(gateway_ttft_target_s=args.gateway_ttft_target_s)
    settings = serve_settings(opts)
    assert settings.gateway_env() == {}
    command = SYSTEMS["splitserve-disagg"].command("m", 1234, opts)
    assert not any("ttft" in part or "inflight" in part for part in command)
    assert settings.admission()["ttft_target_s"] == "1"
    assert settings.admission()["max_inflight_per_decode"] == "0 (the decode workers' max_running)"


def test_printed_settings_list_admission_and_every_override_with_its_reason():
    opts = ServeOptions(dtype="bfloat16", dtype_reason="native bf16 here",
                        gateway_ttft_target_s=0.0)
    settings = serve_settings(opts)
    assert settings.gateway_env() == {"SPLITSERVE_GATEWAY_TTFT_TARGET_S": "0"}
    text = settings.text()
    assert "ttft_target_s=0 (off)" in text and "max_inflight=0 (no limit) [default]" in text
    assert "--ttft-target-s 0 (off) (shipped: 1): --gateway-ttft-target-s given" in text
    assert "SPLITSERVE_DTYPE bfloat16" in text and "native bf16 here" in text
    default_text = serve_settings(ServeOptions()).text()
    assert "ttft_target_s=1 [default]" in default_text
    assert "overrides: none" in default_text and "override:" not in default_text


def test_an_admission_setting_inherited_from_the_environment_is_an_override(monkeypatch):
    monkeypatch.setenv("SPLITSERVE_GATEWAY_MAX_INFLIGHT", "3")
    text = serve_settings(ServeOptions()).text()
    assert "max_inflight=3," in text
    assert "SPLITSERVE_GATEWAY_MAX_INFLIGHT is set in the environment" in text


def test_a_rate_with_refusals_is_not_sustained_though_its_served_ttft_is_low():
    def point(rate: float, ttft: float, refused: int) -> dict:
        return {"rate": rate, "summary": {"requests": 100, "completed": 100 - refused,
                                          "timeouts": 0, "rejected_429": 0,
                                          "rejected_503": refused, "ttft_s": {"p99": ttft}}}

    bound = max_sustainable_rate([point(1, 0.2, 0), point(2, 0.3, 40)], ttft_target_s=1.0)
    assert (bound.low, bound.high) == (1, 2)


def test_fixed_halves_is_the_disaggregated_deployment_without_the_core_share_and_says_so():
    opts = ServeOptions()
    shipped = SYSTEMS["splitserve-disagg"].command("m", 1234, opts)
    fixed = SYSTEMS["splitserve-disagg-fixed"].command("m", 1234, opts)
    assert shipped[shipped.index("--mode") + 1] == fixed[fixed.index("--mode") + 1] == "disagg"
    assert "--no-core-share" not in shipped and fixed[-1] == "--no-core-share"
    from bench.compare.systems import peer_settings_note

    assert "not the shipped default" in peer_settings_note(opts, ("splitserve-disagg-fixed",))


@pytest.mark.parametrize("system,variable,value,says", [
    # The core share without prompts first: decode never pauses for the prefill worker.
    ("splitserve-disagg-noyield", "SPLITSERVE_CORE_SHARE_YIELD", "0", "not the shipped default"),
    # A candidate cap on a decoder's pause, measured beside the shipped 0.5 s.
    ("splitserve-disagg-burst1", "SPLITSERVE_CORE_SHARE_YIELD_BURST_S", "1", "shipped 0.5 s"),
    # Aggregated without the idle-time prefault of the KV pool's pages.
    ("splitserve-agg-noprefault", "SPLITSERVE_CPU_KV_PREFAULT_TOKENS", "0", "not the shipped default"),
])
def test_a_variant_of_a_shipped_deployment_differs_by_one_variable_and_says_so(
        system, variable, value, says):
    from bench.compare.systems import peer_settings_note

    opts = ServeOptions()
    shipped = SYSTEMS["-".join(system.split("-")[:2])]  # splitserve-disagg or splitserve-agg
    variant = SYSTEMS[system]
    assert variant.command("m", 1234, opts) == shipped.command("m", 1234, opts)
    assert variant.env(opts)[variable] == value
    assert variable not in shipped.env(opts)
    assert says in peer_settings_note(opts, (system,))


def test_every_point_of_every_round_draws_its_own_prompts():
    """The systems of one round share a point's prompts; no two points do. With one seed per
    round, batch 1's prompts were the burst's first eight (a prefix-cache hit wherever the
    burst was served) and chat at 3 req/s began with the prompts of chat at 1 req/s."""
    plan = peer_plan("models/x")
    points = [(wp, rate) for wp in plan.workloads for rate in (wp.rates or (None,))]
    seeds = [point_seed(plan, wp, rate, round_) for round_ in (1, 2, 3) for wp, rate in points]
    assert len(set(seeds)) == len(seeds) == 3 * len(points)
    # Without rounds (one system after another) the points are round 1's.
    assert [point_seed(plan, wp, rate, None) for wp, rate in points] == seeds[:len(points)]
    burst, batch1 = plan.workloads[0], plan.workloads[1]
    assert point_seed(plan, burst, None, 1) == plan.seed  # the first point as before
    assert point_seed(plan, batch1, None, 1) != point_seed(plan, burst, None, 1)
