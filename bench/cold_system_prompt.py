"""Chats sent at once behind a system prompt no worker has seen, against a deployment that is
up (`make run`): how many are served, and their times to first token. The `make run` user check
of admission with a shared prefix; each run draws a new system prompt (a cold prefix cache).
`--warm-up` first sends what the user check sends before it, two bursts of 32 short
completions, so the gateway's TTFT estimate has been fitted (an untrained one admits anything).

    python -m bench.cold_system_prompt --warm-up       # 12 chats, ~480-token system prompt
    python -m bench.cold_system_prompt --chats 16 --url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import httpx

WORDS = "river stone cloud forest light music paper window garden ocean castle dream".split()


async def _chat(client: httpx.AsyncClient, url: str, model: str, system: str,
                i: int) -> tuple[int, float | None]:
    start = time.perf_counter()
    body = {"model": model, "max_tokens": 16, "stream": True, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": f"Question {i}: what is {i} plus {i}?"}]}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            return response.status_code, None
        async for line in response.aiter_lines():
            if '"content":"' in line and '"content":""' not in line:
                return 200, time.perf_counter() - start
    return 200, None


async def warm_up(client: httpx.AsyncClient, url: str, model: str) -> None:
    for _ in range(2):
        await asyncio.gather(*(client.post(f"{url}/v1/completions", json={
            "model": model, "prompt": f"Tell me about number {i}", "max_tokens": 32})
            for i in range(32)))
        await asyncio.sleep(3)


async def run(url: str, chats: int, words: int, seed: int | None, warm: bool) -> None:
    rng = random.Random(seed)
    system = "You are a helpful assistant. " + " ".join(
        f"{rng.choice(WORDS)}{rng.randrange(10**6)}" for _ in range(words))
    async with httpx.AsyncClient(timeout=120) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        if warm:
            await warm_up(client, url, model)
        results = await asyncio.gather(*(_chat(client, url, model, system, i)
                                         for i in range(chats)))
    ttft = sorted(round(t * 1e3) for status, t in results if t is not None)
    codes = [status for status, _ in results]
    print(f"{chats} chats behind a new system prompt: served {codes.count(200)}, refused "
          f"{codes.count(503)} (503), other {len(codes) - codes.count(200) - codes.count(503)}; "
          f"TTFT ms {ttft}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--chats", type=int, default=12)
    parser.add_argument("--words", type=int, default=160, help="system prompt words (~3 tokens each)")
    parser.add_argument("--seed", type=int, default=None, help="default: a new prompt each run")
    parser.add_argument("--warm-up", action="store_true",
                        help="two bursts of 32 short completions first")
    args = parser.parse_args()
    asyncio.run(run(args.url, args.chats, args.words, args.seed, args.warm_up))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
