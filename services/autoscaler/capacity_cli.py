"""`splitserve capacity plan`: how many prefill and decode workers serve R requests/s of a
length mix within TTFT/ITL targets on the profiled hardware, surviving N failures."""

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


def run(args: argparse.Namespace) -> int:
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
