"""`python -m bench.loadgen`: drive an OpenAI-compatible server and print/write the summary.

    python -m bench.loadgen --url http://127.0.0.1:8000 --model NAME --workload chat \
        --rate 2 --duration 60 --out run.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

import httpx

from bench.loadgen.arrivals import Burst, ClosedLoop, Gamma, Poisson, Spike
from bench.loadgen.client import ENDPOINTS, FLAVORS, Target
from bench.loadgen.metrics import SLO, Summary
from bench.loadgen.prompts import PromptBuilder, load_tokenizer
from bench.loadgen.runner import LoadResult, RunConfig, run_load
from bench.loadgen.workload import PRESETS, Tenant, preset, with_prefixes, with_tenants

DEFAULT_TOKENIZER = "models/smollm2-135m-instruct"


def _pair(text: str) -> tuple[int, int]:
    low, high = (int(x) for x in text.split(","))
    if not 0 < low <= high:
        raise argparse.ArgumentTypeError(f"expected LOW,HIGH with 0 < LOW <= HIGH, got {text!r}")
    return low, high


def _tenants(text: str) -> tuple[Tenant, ...]:
    """name:key[:weight],..."""
    tenants = []
    for item in filter(None, text.split(",")):
        parts = item.split(":")
        if len(parts) not in (2, 3):
            raise argparse.ArgumentTypeError(f"tenant {item!r} is not name:key[:weight]")
        tenants.append(Tenant(parts[0], parts[1], float(parts[2]) if len(parts) == 3 else 1.0))
    return tuple(tenants)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.loadgen", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    t = p.add_argument_group("target")
    t.add_argument("--url", default="http://127.0.0.1:8000")
    t.add_argument("--model", help="model name to send (default: the server's first /v1/models)")
    t.add_argument("--tokenizer", help="tokenizer folder (default: --model if it is a folder, "
                   f"else {DEFAULT_TOKENIZER})")
    t.add_argument("--endpoint", choices=list(ENDPOINTS), default="completions")
    t.add_argument("--flavor", choices=FLAVORS, default="openai",
                   help="how exact output lengths are asked for (see bench/loadgen/client.py)")
    t.add_argument("--prompt-format", choices=("text", "token_ids"), default="text")
    t.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", ""))
    t.add_argument("--temperature", type=float, default=0.0)
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=PRESETS, default="chat")
    w.add_argument("--input-len", type=int, default=128, help="fixed workload")
    w.add_argument("--output-len", type=int, default=128, help="fixed workload")
    w.add_argument("--input-range", type=_pair, default=(64, 512), help="uniform/chat: LOW,HIGH")
    w.add_argument("--output-range", type=_pair, default=(32, 256), help="uniform/chat: LOW,HIGH")
    w.add_argument("--long-prompt-len", type=int, default=1536, help="interference workload")
    w.add_argument("--prefix-groups", type=int, default=0, help="shared-prefix groups")
    w.add_argument("--prefix-len", type=int, default=0, help="tokens of each shared prefix")
    w.add_argument("--tenants", type=_tenants, default=(), help="name:key[:weight],...")
    a = p.add_argument_group("arrivals")
    a.add_argument("--arrival", choices=("poisson", "gamma", "spike", "burst", "closed"),
                   default="poisson")
    a.add_argument("--rate", type=float, default=1.0, help="requests/s (poisson, gamma, spike)")
    a.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: <1 burstier")
    a.add_argument("--spike-factor", type=float, default=10.0)
    a.add_argument("--spike-start", type=float, default=30.0)
    a.add_argument("--spike-length", type=float, default=30.0)
    a.add_argument("--concurrency", type=int, default=8, help="closed loop")
    a.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    a.add_argument("--num-requests", type=int, help="at most this many (burst: exactly)")
    a.add_argument("--seed", type=int, default=0)
    r = p.add_argument_group("results")
    r.add_argument("--ttft-slo", type=float, default=1.0, help="goodput TTFT target, s")
    r.add_argument("--tpot-slo", type=float, default=0.1, help="goodput TPOT target, s")
    r.add_argument("--drain-timeout", type=float, default=300.0,
                   help="seconds after the arrival window before unfinished requests time out")
    r.add_argument("--out", type=Path, help="write the JSON result here")
    r.add_argument("--no-progress", action="store_true")
    return p


def arrivals_from_args(args: argparse.Namespace):
    if args.arrival == "poisson":
        return Poisson(args.rate)
    if args.arrival == "gamma":
        return Gamma(args.rate, args.burstiness)
    if args.arrival == "spike":
        return Spike(args.rate, args.spike_factor, args.spike_start, args.spike_length)
    if args.arrival == "burst":
        if not args.num_requests:
            raise SystemExit("--arrival burst needs --num-requests")
        return Burst(args.num_requests)
    return ClosedLoop(args.concurrency)


def discover_model(url: str, api_key: str) -> str:
    root = url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(f"{root}/v1/models", headers=headers, timeout=10)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def format_summary(s: Summary) -> str:
    def ms(d) -> str:
        return " ".join(f"{k}={'-' if getattr(d, k) is None else f'{getattr(d, k) * 1e3:.0f}'}"
                        for k in ("p50", "p90", "p99"))
    other = sum(s.http_errors.values())
    return "\n".join([
        f"requests {s.requests}  completed {s.completed}  wall {s.wall_s:.1f}s",
        f"throughput {s.request_throughput:.2f} req/s  {s.output_throughput:.1f} out tok/s  "
        f"{s.total_token_throughput:.1f} total tok/s  "
        f"({s.streamed_output_throughput:.1f} out tok/s streamed, unfinished requests included)",
        f"goodput {s.goodput:.2f} req/s ({s.goodput_fraction:.0%} of requests; "
        f"TTFT<={s.slo.ttft_s:g}s, TPOT<={s.slo.tpot_s * 1e3:g}ms)",
        f"TTFT ms  {ms(s.ttft_s)}", f"TPOT ms  {ms(s.tpot_s)}", f"ITL ms   {ms(s.itl_s)}",
        f"E2E ms   {ms(s.e2e_s)}",
        f"rejected 429={s.rejected_429} 503={s.rejected_503}  other http={other}  "
        f"errors={s.errors}  timeouts={s.timeouts}  inexact outputs={s.inexact_outputs}",
    ])


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    model = args.model or discover_model(args.url, args.api_key)
    tokenizer_dir = args.tokenizer or (model if os.path.isdir(model) else DEFAULT_TOKENIZER)
    workload = preset(args.workload, input_len=args.input_len, output_len=args.output_len,
                      input_range=args.input_range, output_range=args.output_range,
                      long_prompt_len=args.long_prompt_len)
    if args.prefix_groups or args.prefix_len:
        workload = with_prefixes(workload, args.prefix_groups, args.prefix_len)
    if args.tenants:
        workload = with_tenants(workload, args.tenants)
    target = Target(args.url, model, args.endpoint, args.flavor, args.temperature, args.api_key)
    config = RunConfig(target, workload, arrivals_from_args(args), args.duration,
                       args.num_requests, args.seed, SLO(args.ttft_slo, args.tpot_slo),
                       args.drain_timeout, progress=not args.no_progress)
    builder = PromptBuilder(load_tokenizer(tokenizer_dir), endpoint=args.endpoint,
                            prompt_format=args.prompt_format, seed=args.seed)
    result: LoadResult = asyncio.run(run_load(config, builder))
    print(format_summary(result.summary))
    if any(r.status == "http_422" and "ignore_eos" in r.error for r in result.records):
        print("hint: the server rejects ignore_eos; for `transformers serve` use "
              "--flavor transformers, elsewhere --flavor plain (output lengths then vary)")
    for name, summary in result.by_class.items() if len(result.by_class) > 1 else ():
        print(f"-- class {name}\n{format_summary(summary)}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result.to_json(), indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
