"""`splitserve capacity day`: the day_plan arithmetic printed as tables, and, with --simulate-s,
the simulator's three policies on the window around the spike for one cell of the fleet, with
one replica lost and one zone lost."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

from services.autoscaler.capacity import SLO, WorkloadShape, plan_for_rate
from services.autoscaler.day_plan import (
    LINKS,
    DayShape,
    cost_per_1k_queries,
    kv_bytes_per_decode_replica,
    link_load,
    plan_day,
    zone_survivors,
)
from services.autoscaler.planner import PlannerConfig
from services.autoscaler.profile import HardwareProfile
from services.autoscaler.simulator import SimSettings
from services.autoscaler.traces import day_window


@dataclass(frozen=True)
class SimRow:
    trace: str  # spike | replica lost | zone lost
    policy: str
    requests: int
    slo_attainment: float
    ttft_p90: float
    itl_mean: float
    failed: int
    fleet_gpu_hours: float  # the window's worker-hours over the cell's share
    cost_per_1k: float


def failure_cases(profile: HardwareProfile, day: DayShape, shape: WorkloadShape, slo: SLO,
                  share: float, zones: int, at_s: float) -> dict[str, tuple[tuple[float, str], ...]]:
    """The failure injections of the simulated window: none, one replica of each role, and the
    share of each role's pool one zone holds (of the pool the cell's diurnal peak needs)."""
    start = plan_for_rate(profile, share * day.peak_rate, shape, slo, spare=0)
    zone = {"prefill": start.prefill_replicas - zone_survivors(start.prefill_replicas, zones),
            "decode": start.decode_replicas - zone_survivors(start.decode_replicas, zones)}
    return {
        "spike": (),
        "replica lost": ((at_s, "decode"), (at_s, "prefill")),
        "zone lost": tuple((at_s, role) for role in ("decode", "prefill") for _ in range(zone[role])),
    }


def simulate_window(profile: HardwareProfile, day: DayShape, shape: WorkloadShape, slo: SLO,
                    seconds: float, share: float, zones: int, price: float,
                    startup_s: float | None = None, seed: int = 0) -> list[SimRow]:
    """Each policy of sim_policies on `seconds` of the day centred on the spike, at `share` of
    the traffic, without failures, with one replica of each role lost and with one zone lost
    (both a quarter into the window, before the spike)."""
    from services.autoscaler.sim_policies import simulate, standard_policies

    start = day.spike_start_s - seconds / 2
    config = PlannerConfig(slo=slo, shape=shape, max_prefill=4096, max_decode=4096,
                           startup_s=startup_s)
    settings = SimSettings(startup_s=startup_s)
    rows = []
    for name, failures in failure_cases(profile, day, shape, slo, share, zones, seconds / 4).items():
        trace = day_window(day, shape, start, seconds, share, seed, failures)
        for policy in standard_policies(profile, trace, slo, shape, config):
            result = simulate(profile, trace, policy, slo, settings)
            rows.append(SimRow(
                name, result.policy, result.requests, result.slo_attainment, result.ttft_p90,
                result.itl_mean, result.failed, result.worker_hours / share,
                cost_per_1k_queries(result.worker_hours, price, max(result.requests, 1))))
    return rows


def run_day(args: argparse.Namespace) -> int:
    try:
        profile = HardwareProfile.load(args.profile)
        shape = WorkloadShape.parse(args.length_mix)
        slo = SLO(args.ttft_s, args.itl_s)
        day = DayShape(args.queries_per_day, args.peak_factor, args.spike_factor, args.spike_s,
                       peak_at_s=args.peak_hour * 3600)
    except ValueError as exc:
        raise SystemExit(f"splitserve capacity day: {exc}") from None
    if args.failures < 0 or args.zones < 1 or args.price_per_gpu_hour < 0:
        raise SystemExit("splitserve capacity day: --failures >= 0, --zones >= 1 and "
                         "--price-per-gpu-hour >= 0")
    if args.simulate_s < 0 or not 0 < args.sim_share <= 1:
        raise SystemExit("splitserve capacity day: --simulate-s >= 0 and --sim-share in (0, 1]")
    policies = plan_day(profile, day, shape, slo, args.price_per_gpu_hour, args.failures,
                        args.zones, args.startup_s)
    peak = plan_for_rate(profile, day.peak_rate, shape, slo, spare=args.failures)
    links = link_load(profile, peak)
    kv_used, kv_pool = kv_bytes_per_decode_replica(profile, peak)
    sims = (simulate_window(profile, day, shape, slo, args.simulate_s, args.sim_share, args.zones,
                            args.price_per_gpu_hour, args.startup_s) if args.simulate_s else [])
    if args.json:
        print(json.dumps({
            "profile": {"model": profile.model, "device": profile.device, "host": profile.host},
            "day": {**asdict(day), "mean_rate": day.mean_rate, "trough_rate": day.trough_rate,
                    "peak_rate": day.peak_rate, "spike_rate": day.spike_rate},
            "policies": [asdict(p) for p in policies], "peak_plan": asdict(peak),
            "kv_bytes_per_decode_replica": kv_used, "kv_pool_bytes": kv_pool,
            "links": asdict(links), "simulated": [asdict(s) for s in sims]}, indent=2))
        return 0
    print("\n".join(describe(profile, day, shape, slo, args, policies, peak, links, kv_used,
                             kv_pool, sims)))
    return 0


def describe(profile, day, shape, slo, args, policies, peak, links, kv_used, kv_pool, sims) -> list[str]:
    gb = 1e9
    out = [
        f"profile: {profile.model} on {profile.device} ({profile.dtype}; {profile.host or 'unknown host'})",
        f"day: {day.queries_per_day:,.0f} queries ({day.mean_rate:.0f}/s mean); trough "
        f"{day.trough_rate:.0f}/s, peak {day.peak_rate:.0f}/s at {args.peak_hour:g}:00, spike "
        f"{day.spike_rate:.0f}/s for {day.spike_s:g}s at the peak",
        f"length mix {shape.describe()} (mean {shape.mean_prompt_tokens:.0f}:{shape.mean_output_tokens:.0f}); "
        f"TTFT <= {slo.ttft_s:g}s, ITL <= {slo.itl_s * 1e3:g}ms; {args.failures} spare per role; "
        f"{args.zones} zones; ${args.price_per_gpu_hour:.2f}/GPU-hour; replica start-up "
        f"{profile.startup_s if args.startup_s is None else args.startup_s:g}s",
        "",
        "replicas over the day, prefill+decode (spare included)",
        "hour  rate/s  " + "  ".join(f"{p.name:>12}" for p in policies),
    ]
    hourly = day.hourly_max()
    for hour in range(24):
        out.append(f"{hour:02d}    {hourly[hour]:6.0f}  " + "  ".join(
            f"{f'{p.prefill[hour]}+{p.decode[hour]}':>12}" for p in policies))
    out += ["", f"{'policy':<12} {'prefill':>9} {'decode':>9} {'GPU-h/day':>9} {'$/1k q':>7} "
                f"{'attained':>8} {'-1 replica':>10} {f'-1 of {args.zones} zones':>13}"]
    for p in policies:
        out.append(f"{p.name:<12} {f'{min(p.prefill)}-{max(p.prefill)}':>9} "
                   f"{f'{min(p.decode)}-{max(p.decode)}':>9} {p.gpu_hours:9.0f} {p.cost_per_1k:7.3f} "
                   f"{p.attainment:8.2%} {p.one_replica_lost:10.1%} {p.zone_lost:13.1%}")
    out += [
        "(attained: share of the day's queries arriving while the pool sustains the rate within "
        "the SLOs; -1 replica / -1 zone: share of the peak's demand the rest sustains)",
        "",
        f"at the peak ({peak.prefill_replicas} prefill + {peak.decode_replicas} decode):",
        f"  KV per decode replica: {kv_used / gb:.1f} GB in use of a {kv_pool / gb:.1f} GB pool "
        f"({kv_used / kv_pool:.0%}); batch {peak.decode.batch_size} ({peak.decode.limited_by}-limited)",
        f"  KV transfer: {links.kv_bytes_per_token / 1024:.0f} KiB per token, {links.prompt_kv_bytes / 1e6:.0f} MB "
        f"per mean prompt; {links.prefill_egress_bytes_per_s / gb:.2f} GB/s out of each prefill GPU, "
        f"{links.pair_bytes_per_s / 1e6:.0f} MB/s per prefill->decode pair",
        f"  {'link':<8} {'capacity':>10} {'egress use':>10} {'one prompt':>10}",
    ]
    for name, (capacity, label) in LINKS.items():
        out.append(f"  {name:<8} {capacity / gb:7.1f}GB/s {links.utilization[name]:10.1%} "
                   f"{links.prompt_transfer_s[name] * 1e3:8.1f}ms  {label}")
    if sims:
        out += ["", f"simulated: {args.simulate_s:g}s around the spike, one cell at "
                    f"{args.sim_share:g} of the traffic (GPU-hours scaled to the fleet)",
                f"{'case':<13} {'policy':<9} {'requests':>8} {'SLO met':>8} {'TTFT p90':>9} "
                f"{'ITL mean':>9} {'failed':>6} {'GPU-h':>7} {'$/1k q':>7}"]
        for s in sims:
            out.append(f"{s.trace:<13} {s.policy:<9} {s.requests:8d} {s.slo_attainment:8.1%} "
                       f"{s.ttft_p90:8.2f}s {s.itl_mean * 1e3:7.1f}ms {s.failed:6d} "
                       f"{s.fleet_gpu_hours:7.1f} {s.cost_per_1k:7.3f}")
    if not (peak.prefill.feasible and peak.decode.feasible):
        out.append("WARNING: a role cannot meet its target on this hardware at any scale")
    return out

