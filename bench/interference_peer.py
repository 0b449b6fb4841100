"""Steady streams while long prompts arrive, through HTTP, splitserve against vLLM in one run.

Issue 23's interference row: 16 clients stream steadily (64 prompt tokens, 384 output, each
sending its next request when the last ends) while 2048-token prompts (4 output tokens) arrive
as a Poisson process at 0.5 req/s. What it reports, per system: the steady streams' inter-token
latency (p50, p99) and the long prompts' time to first token (p50, p99), with the refusals of
each class. This is what disaggregation is for: a prefill worker of its own keeps long prefills
out of the decode steps. Each system runs alone, with its shipped defaults (splitserve's
gateway admission included: a refused long prompt is counted, not hidden), on the same prompts.

    .venv/bin/python -m bench.interference_peer --out bench/results/$(date +%F)-interference-peer
    .venv/bin/python -m bench.interference_peer --systems splitserve-disagg --duration 10  # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

from bench.compare.machine import ForeignCpu
from bench.compare.sweep import _warm_up
from bench.compare.systems import SYSTEMS, ServeOptions, peer_settings_note, start_system
from bench.compare.vllm_peer import vllm_version
from bench.loadgen.arrivals import ClosedLoop, Poisson
from bench.loadgen.client import Target
from bench.loadgen.metrics import Distribution
from bench.loadgen.prompts import PromptBuilder, load_tokenizer
from bench.loadgen.runner import RunConfig, run_load
from bench.loadgen.workload import preset

REPO = Path(__file__).resolve().parent.parent
DEFAULT_SYSTEMS = ("splitserve-disagg", "splitserve-agg", "vllm")


def _run_both(running, tokenizer, args) -> dict:
    """The steady clients and the long-prompt arrivals at once, against one running system."""
    target = Target(running.url, running.model_name, "completions", running.spec.flavor)
    steady = RunConfig(target, preset("fixed", input_len=args.steady_in, output_len=args.steady_out),
                       ClosedLoop(args.steady), args.duration, seed=args.seed,
                       drain_timeout_s=120.0, progress=False)
    long = RunConfig(target, preset("fixed", input_len=args.long_len, output_len=4),
                     Poisson(args.long_rate), args.duration, seed=args.seed + 1,
                     drain_timeout_s=120.0, progress=False)
    # Two builders with different seeds: the classes' random prompts share no prefix.
    builders = (PromptBuilder(tokenizer, seed=args.seed), PromptBuilder(tokenizer, seed=args.seed + 7))

    async def both():
        return await asyncio.gather(run_load(steady, builders[0]), run_load(long, builders[1]))

    foreign = ForeignCpu(running.process.pid)
    steady_result, long_result = asyncio.run(both())
    cpu = foreign.stop()
    s, lg = steady_result.summary, long_result.summary
    return {
        "raw": {"steady": steady_result.to_json(), "long": long_result.to_json()},
        "gaps": _long_gaps([r for r in steady_result.records if r.ok]),
        "steady": {"served": s.completed, "sent": s.requests,
                   "refused": s.rejected_429 + s.rejected_503,
                   "itl_ms": {"p50": _ms(s.itl_s.p50), "p99": _ms(s.itl_s.p99)},
                   "tpot_ms_p50": _ms(s.tpot_s.p50)},
        "long": {"served": lg.completed, "sent": lg.requests,
                 "refused": lg.rejected_429 + lg.rejected_503,
                 "ttft_ms": {"p50": _ms(lg.ttft_s.p50), "p99": _ms(lg.ttft_s.p99)}},
        "cpu": cpu,
    }


def _long_gaps(records, threshold_s: float = 0.25) -> dict:
    """Where the steady streams' long gaps sit: the first gap (first token to second, across
    the hand-off from prefill to decode when disaggregated) or a later one, and the ITL p99
    without first gaps."""
    first = sum(1 for r in records if r.itl_s and r.itl_s[0] > threshold_s)
    later = sum(1 for r in records for gap in r.itl_s[1:] if gap > threshold_s)
    rest = Distribution.of(gap for r in records for gap in r.itl_s[1:])
    return {"threshold_ms": threshold_s * 1e3, "first_gaps_over": first,
            "later_gaps_over": later, "itl_p99_ms_without_first": _ms(rest.p99)}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 1)


def _fmt(value) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _ratio(ours, theirs) -> str:
    return "-" if not ours or not theirs else f"{ours / theirs:.2f}x"


def report(results: dict) -> str:
    rows = results["systems"]
    lines = ["| system | steady ITL p50 / p99 ms | long-prompt TTFT p50 / p99 ms | steady served / "
             "refused | long served / refused | CPU to others |", "|---|---|---|---|---|---|"]
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"| {name} | {r['error']} | | | | |")
            continue
        st, lg = r["steady"], r["long"]
        lines.append(f"| {name} | {_fmt(st['itl_ms']['p50'])} / {_fmt(st['itl_ms']['p99'])} | "
                     f"{_fmt(lg['ttft_ms']['p50'])} / {_fmt(lg['ttft_ms']['p99'])} | "
                     f"{st['served']} / {st['refused']} | {lg['served']} / {lg['refused']} | "
                     f"{r['cpu'].get('foreign_cpu_share', 0) * 100:.0f}% |")
    peer = rows.get("vllm")
    if peer and "error" not in peer:
        lines += ["", "| system | steady ITL p99 / vLLM (target <= 0.5x) | long TTFT p50 / vLLM "
                  "(target <= 1x) |", "|---|---|---|"]
        for name, r in rows.items():
            if name == "vllm" or "error" in r:
                continue
            lines.append(f"| {name} | {_ratio(r['steady']['itl_ms']['p99'], peer['steady']['itl_ms']['p99'])} | "
                         f"{_ratio(r['long']['ttft_ms']['p50'], peer['long']['ttft_ms']['p50'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(REPO / "models/smollm2-135m-instruct"))
    parser.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS))
    parser.add_argument("--steady", type=int, default=16, help="steady clients (closed loop)")
    parser.add_argument("--steady-in", type=int, default=64)
    parser.add_argument("--steady-out", type=int, default=384)
    parser.add_argument("--long-len", type=int, default=2048)
    parser.add_argument("--long-rate", type=float, default=0.5, help="long prompts per second")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gateway-ttft-target-s", type=float, default=None,
                        help="splitserve gateway's TTFT target (0: admission's early refusal "
                             "off; default: the shipped one)")
    parser.add_argument("--out", default=str(REPO / "bench/results/interference-peer"))
    args = parser.parse_args(argv)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    systems = [s for s in args.systems.split(",") if s]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        parser.error(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(args.model)
    opts = ServeOptions(gateway_ttft_target_s=args.gateway_ttft_target_s)
    admission = ("gateway admission at its shipped default" if args.gateway_ttft_target_s is None
                 else f"changed: gateway --ttft-target-s {args.gateway_ttft_target_s:g}, to show "
                      "the deployment without admission's refusals")
    results = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args),
               "settings": f"splitserve: `splitserve up`, {admission}; "
                           + peer_settings_note(opts, tuple(systems)),
               "systems": {}}
    print(results["settings"], flush=True)
    for name in systems:
        print(f"[{time.strftime('%H:%M:%S')}] {name}: starting", flush=True)
        try:
            running = start_system(SYSTEMS[name], args.model, out / "logs", opts)
        except RuntimeError as exc:
            results["systems"][name] = {"error": f"did not start: {exc}"}
            continue
        try:
            _warm_up(running, PromptBuilder(tokenizer, seed=args.seed + 99))
            print(f"[{time.strftime('%H:%M:%S')}] {name}: {args.steady} steady streams + "
                  f"{args.long_len}-token prompts at {args.long_rate}/s for {args.duration:g} s",
                  flush=True)
            row = _run_both(running, tokenizer, args)
            row["command"] = " ".join(running.command)
            if name == "vllm":
                row["version"] = vllm_version()
            results["systems"][name] = row
            print(f"  steady ITL p99 {row['steady']['itl_ms']['p99']} ms, long TTFT p50 "
                  f"{row['long']['ttft_ms']['p50']} ms; gaps over 250 ms: "
                  f"{row['gaps']['first_gaps_over']} first, {row['gaps']['later_gaps_over']} "
                  f"later; ITL p99 without first gaps {row['gaps']['itl_p99_ms_without_first']} ms",
                  flush=True)
            (out / "raw").mkdir(exist_ok=True)
            (out / "raw" / f"{name}.json").write_text(json.dumps(row.pop("raw")))
        except RuntimeError as exc:
            results["systems"][name] = {"error": str(exc)}
        finally:
            running.stop()
        (out / "results.json").write_text(json.dumps(results, indent=1))
    results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    (out / "results.json").write_text(json.dumps(results, indent=1))
    text = report(results)
    (out / "report.md").write_text(f"# Interference, splitserve vs vLLM\n\n{results['settings']}\n\n"
                                   f"Command: `python -m bench.interference_peer "
                                   f"--systems {args.systems} --duration {args.duration:g}`\n\n"
                                   f"{text}\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
