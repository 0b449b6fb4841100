"""Benchmark: the gateway's TTFT admission when prompts share a cached prefix, on the deployment
`make run` starts (`splitserve up`, every shipped default: the 1 s TTFT target on).

A chat service resends a system prompt or the turns before with every request; the worker's
prefix cache holds them, so such a prompt's prefill computes only its new tokens. The
scenario, with random text prompts and 8 output tokens each:
  1. warm-up: uncached prompts of ~1,000 tokens, 4 at a time, 4 times (the gateway's TTFT
     estimate learns what a prefill costs per token);
  2. one prompt of ~1,000 tokens (the shared prefix), alone: now cached;
  3. twice, 2 s apart: a burst of 16 prompts, each the prefix plus ~10 new words;
  4. a burst of 16 prompts behind a new prefix of ~500 tokens that no worker holds yet (a
     system prompt seen for the first time, by 16 users at once).
Each burst prints how many were refused (503) and the admitted ones' times to first token.
A burst of 16 cached-prefix prompts is a few hundred new tokens of prefill in all.

    python -m bench.admission_prefix                    # starts splitserve up --mode agg
    python -m bench.admission_prefix --url http://127.0.0.1:8000   # a deployment already up
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

import httpx

WORDS = ("apple river stone cloud forest light music paper window garden silver ocean yellow "
         "thunder castle dream").split()


def _text(words: int, rng: random.Random) -> str:
    return " ".join(f"{rng.choice(WORDS)}{rng.randrange(1000)}" for _ in range(words))


async def _one(client: httpx.AsyncClient, url: str, model: str, prompt: str) -> tuple[int, float | None]:
    start = time.perf_counter()
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "stream": True, "ignore_eos": True}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code, None
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                return 200, time.perf_counter() - start
    return 200, None


async def _burst(client, url: str, model: str, label: str, prompts: list[str]) -> dict:
    results = await asyncio.gather(*(_one(client, url, model, p) for p in prompts))
    ttft = sorted(round(t * 1e3) for status, t in results if status == 200 and t is not None)
    refused = sum(1 for status, _ in results if status == 503)
    print(f"  {label}: sent {len(prompts)}, refused {refused}, admitted {len(ttft)}, TTFT ms "
          f"{ttft}", flush=True)
    return {"label": label, "sent": len(prompts), "refused": refused, "ttft_ms": ttft}


async def scenario(url: str, seed: int) -> list[dict]:
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=32)) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        results = []
        for i in range(4):
            results.append(await _burst(client, url, model, f"warm-up {i + 1}: uncached",
                                        [_text(330, rng) for _ in range(4)]))
        prefix = _text(330, rng)
        results.append(await _burst(client, url, model, "the prefix alone", [prefix]))
        for i in range(2):
            results.append(await _burst(client, url, model, f"burst {i + 1}: cached prefix",
                                        [f"{prefix} {_text(10, rng)}" for _ in range(16)]))
            await asyncio.sleep(2)
        fresh = _text(165, rng)
        results.append(await _burst(client, url, model, "burst 3: a new shared prefix",
                                    [f"{fresh} {_text(10, rng)}" for _ in range(16)]))
        return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a deployment already up (default: start splitserve up)")
    parser.add_argument("--mode", choices=("agg", "disagg"), default="agg")
    parser.add_argument("--model", default="models/smollm2-135m-instruct")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the bursts' results here")
    args = parser.parse_args(argv)
    print("settings: " + (f"the deployment at {args.url}, as it was started" if args.url else
                          "splitserve up's shipped defaults (gateway TTFT target 1 s), nothing "
                          "changed"), flush=True)
    deployment = None
    url = args.url
    if url is None:
        from splitserve_cli.processes import free_port
        from splitserve_cli.up import Deployment, UpConfig

        print(f"starting splitserve up --mode {args.mode} ...", flush=True)
        deployment = Deployment(UpConfig(port=free_port(), model=args.model, mode=args.mode))
        url = deployment.start()
    try:
        results = asyncio.run(scenario(url, args.seed))
    finally:
        if deployment is not None:
            deployment.stop()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
