"""Bursts of many sequences against a deployment that is up (`make run`): how many the gateway's
TTFT admission serves, and whether one burst locks out the next. Each sequence prefilling costs
a first step of its own, whether it is another request or another of a request's `n` choices.

After the user check's warm-up (two bursts of 32 short completions, then one chat alone), two
passes, each sending at once, 3 s apart:
  13 chats of n=8 under a regex; 13 chats of n=8; 104 chats under the regex; 104 chats
(16 output tokens at most, no seed: vLLM's CPU engine dies on seeded ones). The second pass
comes 3 s after the first on an idle cluster: nothing the first taught should refuse it.
Each burst prints what was served and refused (503), and the slowest request's seconds; the
gateway's DEBUG log (`SPLITSERVE_GATEWAY_LOG_LEVEL=DEBUG`) shows every estimate and first
token.

`--long N` sends instead, after the same warm-up, N prompts of ~1,930 tokens (random words,
none seen before) at once, twice, 5 s apart, streamed: served, refused, and the served ones'
times to first token. Prompts longer than any prefilled alone must not be admitted on a line
fitted on short ones.

    python -m bench.sequence_bursts                              # http://127.0.0.1:8000
    python -m bench.sequence_bursts --url http://127.0.0.1:8000 --passes 3
    python -m bench.sequence_bursts --long 8
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import httpx

from bench.cold_system_prompt import choices_body, random_words, warm_up

BURSTS = ((8, True, 13), (8, False, 13), (1, True, 104), (1, False, 104))  # n, regex, requests


async def _burst(client: httpx.AsyncClient, url: str, model: str, n: int, regex: bool,
                 requests: int) -> list[int]:
    async def one(i: int) -> tuple[int, float]:
        start = time.perf_counter()
        response = await client.post(f"{url}/v1/chat/completions",
                                     json=choices_body(model, i, n, regex))
        return response.status_code, time.perf_counter() - start

    results = await asyncio.gather(*(one(i) for i in range(requests)))
    codes = [code for code, _ in results]
    other = len(codes) - codes.count(200) - codes.count(503)
    print(f"  {requests} x n={n}{' under a regex' if regex else ''}: served {codes.count(200)}, "
          f"refused {codes.count(503)}{f', other {other}' if other else ''}; slowest "
          f"{max(seconds for _, seconds in results):.2f} s", flush=True)
    return codes


async def _first_token_s(client: httpx.AsyncClient, url: str,
                         body: dict) -> tuple[int, float | None]:
    start = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code, None
        async for line in response.aiter_lines():
            if '"text":"' in line and '"text":""' not in line:
                return 200, round(time.perf_counter() - start, 3)
    return 200, None


async def _long(client: httpx.AsyncClient, url: str, model: str, prompts: int) -> None:
    rng = random.Random()
    for burst in range(2):
        if burst:
            await asyncio.sleep(5)
        texts = [random_words(rng, 280) for _ in range(prompts)]
        results = await asyncio.gather(*(_first_token_s(client, url, {
            "model": model, "prompt": text, "max_tokens": 8, "stream": True}) for text in texts))
        codes = [code for code, _ in results]
        ttft = sorted(t for _, t in results if t is not None)
        print(f"{prompts} prompts of ~1,930 tokens at once: served {codes.count(200)}, refused "
              f"{codes.count(503)}; TTFT s {ttft}", flush=True)


async def run(url: str, passes: int, long: int) -> None:
    async with httpx.AsyncClient(timeout=120) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        print("warming up (two bursts of 32 short completions, one chat)...", flush=True)
        await warm_up(client, url, model)
        await client.post(f"{url}/v1/chat/completions", json={
            "model": model, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        if long:
            await asyncio.sleep(3)
            await _long(client, url, model, long)
            return
        refused = []
        for p in range(passes):
            print(f"pass {p + 1}:", flush=True)
            codes = []
            for n, regex, requests in BURSTS:
                await asyncio.sleep(3)
                codes += await _burst(client, url, model, n, regex, requests)
            refused.append(codes.count(503))
            print(f"  refused {refused[-1]} of {len(codes)}", flush=True)
    print(f"refused per pass: {refused}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--long", type=int, default=0, metavar="N",
                        help="instead: N prompts of ~1,930 tokens at once, twice")
    args = parser.parse_args()
    asyncio.run(run(args.url, args.passes, args.long))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
