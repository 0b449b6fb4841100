"""Decode smoothness under long-prompt injections: disaggregated vs aggregated.

16 requests decode steadily; then 2048-token prompts are injected. We report the inter-token
latency (ITL) of the steady streams with and without injections, for (a) one prefill + one
decode worker and (b) one aggregated worker with chunked prefill, on the same cores.

    .venv/bin/python bench/interference.py            # SmolLM2, ~4 minutes on 2 cores
    .venv/bin/python bench/interference.py --quick    # tiny model smoke run, seconds
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import grpc
from splitserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

from bench.run_settings import Override, RunSettings
from splitserve_cli.processes import start_worker

REPO = Path(__file__).resolve().parent.parent


def sampling(max_tokens: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                     has_temperature=True, ignore_eos=True, seed=1)


async def steady_stream(addr: str, rid: str, prompt: list[int], max_tokens: int,
                        stamps: list[float]) -> None:
    async with grpc.aio.insecure_channel(addr) as ch:
        stream = decode_pb2_grpc.DecodeStub(ch).Generate(decode_pb2.GenerateRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=sampling(max_tokens)))
        while (msg := await stream.read()) is not grpc.aio.EOF:
            stamps.extend([time.perf_counter()] * max(len(msg.delta.token_ids), 1))


async def inject(decode_addr: str, prefill_addr: str | None, rid: str, prompt: list[int]) -> float:
    """One long prompt (4 output tokens); returns its time to first token."""
    start = time.perf_counter()
    async with grpc.aio.insecure_channel(decode_addr) as dch:
        stub = decode_pb2_grpc.DecodeStub(dch)
        if prefill_addr is None:
            stream = stub.Generate(decode_pb2.GenerateRequest(
                request_id=rid, prompt_token_ids=prompt, sampling=sampling(4)))
            await stream.read()
            ttft = time.perf_counter() - start
        else:
            stream = stub.Generate(decode_pb2.GenerateRequest(
                request_id=rid, prompt_token_ids=prompt, sampling=sampling(4), remote_prefill=True))
            reserved = await stream.read()
            async with grpc.aio.insecure_channel(prefill_addr) as pch:
                await prefill_pb2_grpc.PrefillStub(pch).Prefill(prefill_pb2.PrefillRequest(
                    request_id=rid, prompt_token_ids=prompt, sampling=sampling(4),
                    decode_kv_endpoint=reserved.reserved.kv_endpoint))
            ttft = time.perf_counter() - start
        while await stream.read() is not grpc.aio.EOF:
            pass
    return ttft


async def run_phase(decode_addr, prefill_addr, args, injections: int, tag: str) -> dict:
    rng = random.Random(0)
    stamps = [[] for _ in range(args.steady)]
    steady = [asyncio.ensure_future(steady_stream(
        decode_addr, f"{tag}-s{i}", [rng.randrange(100, args.vocab) for _ in range(64)],
        args.steady_tokens, stamps[i])) for i in range(args.steady)]
    await asyncio.sleep(args.warmup_s)
    window_start = time.perf_counter()
    ttfts = []
    for j in range(injections):
        prompt = [rng.randrange(100, args.vocab) for _ in range(args.inject_len)]
        ttfts.append(await inject(decode_addr, prefill_addr, f"{tag}-inj{j}", prompt))
        print(f"  {tag}: injection {j + 1}/{injections} ttft {ttfts[-1]:.2f}s", flush=True)
    if not injections:
        await asyncio.sleep(args.quiet_window_s)
    window_end = time.perf_counter()
    await asyncio.gather(*steady)
    gaps = [b - a for s in stamps for a, b in zip(s, s[1:], strict=False) if window_start <= b <= window_end]
    return {"itl_ms": gaps_summary(gaps), "inject_ttft_s": ttfts, "samples": len(gaps)}


def gaps_summary(gaps: list[float]) -> dict:
    if not gaps:
        return {"p50": None, "p99": None, "max": None}
    ordered = sorted(g * 1000 for g in gaps)
    return {"p50": round(statistics.median(ordered), 1),
            "p99": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 1),
            "max": round(ordered[-1], 1)}


async def measure(mode: str, args) -> dict:
    model = args.model
    common = ("--kv-cache-memory", args.kv_cache_memory)
    workers = []
    try:
        if mode == "disaggregated":
            decode = start_worker("decode", model, *common)
            workers.append(decode)
            prefill = start_worker("prefill", model, *common)
            workers.append(prefill)
            decode_addr, prefill_addr = decode.address, prefill.address
        else:
            both = start_worker("both", model, *common, "--num-threads", "2")
            workers.append(both)
            decode_addr, prefill_addr = both.address, None
        print(f"{mode}: steady decoding only", flush=True)
        quiet = await run_phase(decode_addr, prefill_addr, args, 0, f"{mode}-quiet")
        print(f"{mode}: steady decoding + {args.injections} injections of {args.inject_len} tokens",
              flush=True)
        loud = await run_phase(decode_addr, prefill_addr, args, args.injections, f"{mode}-loud")
        return {"without_injections": quiet, "with_injections": loud}
    finally:
        for w in workers:
            w.kill()


def run_settings(args) -> RunSettings:
    """No gateway (the streams talk to the workers' gRPC, so no admission control and no
    refusals), and the changes from the workers' shipped defaults, with the reasons."""
    return RunSettings("bench/interference.py", (
        Override("workers", "--kv-cache-memory", args.kv_cache_memory, "1GiB",
                 f"{args.steady} streams of {args.steady_tokens} tokens and "
                 f"{args.inject_len}-token injections fit without preemption"),
        Override("workers", "--num-threads", "1 (prefill) + 1 (decode); 2 (aggregated)",
                 "0 (torch's own)", "both modes get the same 2 cores, as `splitserve up` "
                 "splits them")), gateway=False)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO / "models/smollm2-135m-instruct"))
    parser.add_argument("--quick", action="store_true", help="tiny model, short run")
    parser.add_argument("--steady", type=int, default=16)
    parser.add_argument("--steady-tokens", type=int, default=0, help="0: long enough to cover")
    parser.add_argument("--inject-len", type=int, default=2048)
    parser.add_argument("--injections", type=int, default=3)
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--quiet-window-s", type=float, default=15.0)
    parser.add_argument("--kv-cache-memory", default="2GiB")
    parser.add_argument("--out", default=str(REPO / "bench/results/interference.json"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        from splitserve_cli.tiny_model import build_tiny_model

        args.model = str(build_tiny_model(Path("/tmp/splitserve-bench-tiny"), arch="llama"))
        args.inject_len, args.quiet_window_s, args.warmup_s = 400, 2.0, 0.5
    args.vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    if not args.steady_tokens:
        args.steady_tokens = 2000 if not args.quick else 300
    settings = run_settings(args)
    print(settings.text(), flush=True)
    results = {mode: asyncio.run(measure(mode, args)) for mode in ("disaggregated", "aggregated")}
    print("\n" + settings.text())
    print("\nITL of the steady streams (ms)            p50      p99      max")
    for mode, r in results.items():
        for phase in ("without_injections", "with_injections"):
            s = r[phase]["itl_ms"]
            print(f"  {mode:14s} {phase:20s} {s['p50']!s:>8} {s['p99']!s:>8} {s['max']!s:>8}")
        ttfts = r["with_injections"]["inject_ttft_s"]
        print(f"  {mode:14s} injected prompt TTFT (s): {', '.join(f'{t:.2f}' for t in ttfts)}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "settings": settings.to_json(),
                                          "results": results}, indent=2))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
