"""What mutual TLS on the internal plane costs: output-token throughput and inter-token latency
of the same disaggregated SmolLM2 deployment with TLS on every gRPC hop and off, in one run.

    python -m bench.tls_overhead                  # SmolLM2 (models/smollm2-135m-instruct), ~2.5 min
    python -m bench.tls_overhead --json bench/results/tls_overhead.json

Two stacks (gateway + prefill + decode each) run side by side, one with SPLITSERVE_TLS_* in
every process (certificates made for the run, splitserve_cli/dev_certs.py), one without. They
take the same closed-loop streaming load in alternating rounds (off, on, on, off, ...), so drift
on a shared machine hits both arms alike. Figures: median over rounds of output tokens/s, and
the p50/p90 of inter-token gaps seen by the HTTP client (pooled per arm). The client's HTTP hop
is plaintext in both arms: only the internal plane differs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.run_settings import Override, RunSettings, gateway_override, with_inherited
from bench.tracing_overhead import Stack

ARMS = ("off", "on")
DEFAULT_MODEL = "models/smollm2-135m-instruct"


async def closed_loop(url: str, model: str, clients: int, seconds: float, prompt_len: int,
                      max_tokens: int, vocab_size: int, seed: int) -> dict:
    """`clients` streaming callers back to back for `seconds`: completed requests, output
    tokens per second and every inter-token gap (seconds) after each stream's first token."""
    done = tokens = refused = 0
    gaps: list[float] = []
    stop_at = time.monotonic() + seconds

    async def caller(index: int, http: httpx.AsyncClient) -> None:
        nonlocal done, tokens, refused
        n = 0
        while time.monotonic() < stop_at:
            start = seed * 1_000_003 + index * 7919 + n * 104729  # distinct: no prefix hits
            n += 1
            prompt = [10 + (start + j * 31) % (vocab_size - 10) for j in range(prompt_len)]
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
                if response.status_code in (429, 503):
                    refused += 1
                    await response.aread()
                    await asyncio.sleep(0.05)
                    continue
                response.raise_for_status()
                last = None
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    now = time.monotonic()
                    if last is not None:
                        gaps.append(now - last)
                    last = now
                    tokens += 1
            done += 1

    began = time.monotonic()
    async with httpx.AsyncClient(timeout=120) as http:
        await asyncio.gather(*(caller(i, http) for i in range(clients)))
    elapsed = time.monotonic() - began
    return {"requests": done, "refused": refused, "seconds": elapsed,
            "output_tokens_per_s": tokens / elapsed, "gaps": gaps}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def run_settings(args) -> RunSettings:
    overrides: tuple[Override, ...] = (
        gateway_override("health_interval_s", 0.2, "fresh workers: routable sooner"),
        gateway_override("ttft_target_s", 0.0, "both arms serve every request: the cost of TLS, "
                                                "not of refusals, is measured"),
        Override("workers", "--num-kv-blocks", "512", "from --kv-cache-memory 1GiB",
                 "two stacks share the machine"),
        Override("workers", "--metrics-port", "-1 (off)", "0", "not measured; two stacks"),
        Override("workers", "--num-threads", "1", "0 (torch's own)",
                 "four workers on one machine: no oversubscription"))
    return RunSettings("bench.tls_overhead", with_inherited(overrides),
                       note="the 'on' arm sets SPLITSERVE_TLS_CERT/KEY/CA in all three processes "
                            "(mutual TLS, as the Helm chart ships): the variable under test")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--rounds", type=int, default=4, help="rounds per arm")
    parser.add_argument("--seconds", type=float, default=12.0, help="length of one round")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json", default="", help="write the result here")
    return parser


def main(argv: list[str] | None = None) -> int:
    from splitserve_cli.dev_certs import make_pki

    args = build_parser().parse_args(argv)
    settings = run_settings(args)
    print(settings.text(), flush=True)
    model = Path(args.model)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rounds: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory(prefix="splitserve-tls-") as tmp:
        envs = {"off": {}, "on": make_pki(Path(tmp), "bench").env()}
        stacks = {}
        try:
            for arm in ARMS:
                stacks[arm] = Stack(model, envs[arm], settings.gateway_args())
            for i, arm in enumerate(ARMS):  # warm-up: first-call costs stay out of the figure
                asyncio.run(closed_loop(stacks[arm].url, model.name, args.clients, 3.0,
                                        args.prompt_len, args.max_tokens, vocab, seed=90 + i))
            for i in range(args.rounds):
                for arm in (ARMS if i % 2 == 0 else ARMS[::-1]):
                    result = asyncio.run(closed_loop(
                        stacks[arm].url, model.name, args.clients, args.seconds,
                        args.prompt_len, args.max_tokens, vocab, seed=i))
                    rounds[arm].append(result)
                    print(f"round {i} {arm:>3}: {result['output_tokens_per_s']:.1f} tok/s, "
                          f"ITL p50 {_percentile(result['gaps'], 0.5) * 1e3:.2f} ms, "
                          f"{result['requests']} requests, {result['refused']} refused",
                          flush=True)
        finally:
            for stack in stacks.values():
                stack.stop()

    throughput = {arm: statistics.median(r["output_tokens_per_s"] for r in rounds[arm])
                  for arm in ARMS}
    gaps = {arm: [g for r in rounds[arm] for g in r["gaps"]] for arm in ARMS}
    itl = {arm: {"p50_ms": _percentile(gaps[arm], 0.5) * 1e3,
                 "p90_ms": _percentile(gaps[arm], 0.9) * 1e3} for arm in ARMS}
    ratio = throughput["on"] / throughput["off"]
    itl_ratio = itl["on"]["p50_ms"] / itl["off"]["p50_ms"]
    summary = {
        "benchmark": "tls_overhead", "model": str(model), "clients": args.clients,
        "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "rounds": args.rounds,
        "round_seconds": args.seconds, "output_tokens_per_s_median": throughput, "itl": itl,
        "throughput_ratio_on_over_off": ratio, "throughput_cost_percent": (1 - ratio) * 100,
        "itl_p50_ratio_on_over_off": itl_ratio,
        "pair_ratios": [on["output_tokens_per_s"] / off["output_tokens_per_s"]
                        for on, off in zip(rounds["on"], rounds["off"], strict=True)],
        "refused": {arm: sum(r["refused"] for r in rounds[arm]) for arm in ARMS},
        "settings": settings.to_json(), "cpu_count": os.cpu_count(),
        "raw": {arm: [{k: v for k, v in r.items() if k != "gaps"} for r in rounds[arm]]
                for arm in ARMS},
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    print(f"{'':>4} {'tok/s':>8} {'ITL p50':>9} {'ITL p90':>9}")
    for arm in ARMS:
        print(f"{arm:>4} {throughput[arm]:8.1f} {itl[arm]['p50_ms']:7.2f}ms "
              f"{itl[arm]['p90_ms']:7.2f}ms")
    print(f"TLS on/off: throughput ratio {ratio:.3f} (cost {summary['throughput_cost_percent']:.1f}%"
          f", target <= 3%), ITL p50 ratio {itl_ratio:.3f}; pairs "
          f"{', '.join(f'{p:.3f}' for p in summary['pair_ratios'])}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
