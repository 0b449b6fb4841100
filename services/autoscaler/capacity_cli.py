"""`splitserve capacity plan`: how many prefill and decode workers serve R requests/s of a
length mix within TTFT/ITL targets on the profiled hardware, surviving N failures;
`splitserve capacity day`: the same over a day of diurnal + spike traffic, per policy."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict


def add_arguments(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    plan = commands.add_parser("plan", help="workers per role for a request rate and SLOs")
    plan.add_argument("--profile", required=True, help="JSON from `splitserve profile`")
    plan.add_argument("--rate", type=float, required=True, help="requests per second")
    plan.add_argument("--length-mix", default="256:128",
                      help="prompt:output[:weight],... e.g. 256:64:0.8,2048:256:0.2")
    plan.add_argument("--ttft-s", type=float, default=2.0, help="time-to-first-token target")
    plan.add_argument("--itl-s", type=float, default=0.2, help="inter-token latency target")
    plan.add_argument("--failures", type=int, default=1,
                      help="replica failures per role to survive (spare workers)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    day = commands.add_parser("day", help="a day of diurnal + spike traffic: replicas per policy, "
                              "KV memory and transfer, cost, failures (and the simulator)")
    day.add_argument("--profile", required=True, help="JSON from `splitserve profile`, or "
                     "services/autoscaler/profiles/llama8b-h200.json (published figures)")
    day.add_argument("--queries-per-day", type=float, default=50e6)
    day.add_argument("--peak-factor", type=float, default=3.0, help="diurnal peak / daily mean")
    day.add_argument("--peak-hour", type=float, default=14.0, help="hour of the diurnal peak")
    day.add_argument("--spike-factor", type=float, default=10.0, help="spike rate / daily mean")
    day.add_argument("--spike-s", type=float, default=60.0, help="spike length (at the peak)")
    day.add_argument("--length-mix", default="300:200:0.6,1500:300:0.3,4000:500:0.1",
                     help="prompt:output[:weight],... (default: chat-like, mean 1030:260)")
    day.add_argument("--ttft-s", type=float, default=1.0, help="time-to-first-token target")
    day.add_argument("--itl-s", type=float, default=0.05, help="inter-token latency target")
    day.add_argument("--failures", type=int, default=1, help="spare replicas per role")
    day.add_argument("--zones", type=int, default=3, help="zones the replicas are spread over")
    day.add_argument("--price-per-gpu-hour", type=float, default=3.5,
                     help="USD per GPU-hour (one replica = one GPU); default 3.50")
    day.add_argument("--startup-s", type=float, default=None,
                     help="ask-to-serving seconds of a replica (default: the profile's)")
    day.add_argument("--simulate-s", type=float, default=0.0,
                     help="also simulate this many seconds around the spike (0: arithmetic only)")
    day.add_argument("--sim-share", type=float, default=0.05,
                     help="share of the fleet's traffic the simulated cell serves")
    day.add_argument("--json", action="store_true", help="print the study as JSON")


def run(args: argparse.Namespace) -> int:
    if args.action == "day":
        from services.autoscaler.day_report import run_day
        return run_day(args)
    from services.autoscaler.capacity import SLO, WorkloadShape, plan_for_rate
    from services.autoscaler.profile import HardwareProfile

    try:
        profile = HardwareProfile.load(args.profile)
        shape = WorkloadShape.parse(args.length_mix)
        slo = SLO(args.ttft_s, args.itl_s)
    except ValueError as exc:
        raise SystemExit(f"splitserve capacity plan: {exc}") from None
    if args.rate < 0 or args.failures < 0:
        raise SystemExit("splitserve capacity plan: --rate and --failures must be >= 0")
    plan = plan_for_rate(profile, args.rate, shape, slo, spare=args.failures)
    if args.json:
        print(json.dumps(asdict(plan), indent=2))
    else:
        print(f"profile: {profile.model} on {profile.device} ({profile.dtype}, "
              f"{profile.num_threads} threads, {profile.host or 'unknown host'})")
        print(plan.describe())
    return 0
