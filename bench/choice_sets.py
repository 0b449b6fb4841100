"""Benchmark: sets of 13 chats of n=8 sent at once (104 sequences: each choice is a request of
its own on the workers), streamed, under a regex and plain, against splitserve and vLLM side by
side. What a set costs end to end: the workers' prefill of 104 sequences sharing 13 prompts,
the sampler on 104 rows a step, the grammar's masks.

    python -m bench.choice_sets --against vllm --rounds 3
    python -m bench.choice_sets --url http://127.0.0.1:8000     # a deployment that is up
    python -m bench.choice_sets --warm-up --sets regex,plain,regex     # in this order
    python -m bench.choice_sets --first-requests    # on a fresh deployment: the cold first one

`--against vllm` starts `splitserve up` (every shipped default, admission on) and vLLM's CPU
server in its best configuration here (bench/compare/vllm_peer.py), warms both up with the
user check's two bursts of 32 completions, then takes turns, alternating which goes first each
round; each turn starts once the host's cores are idle and sends a set under the regex, then
a plain set, 3 s apart. Per set: requests served (admission may refuse some: a 503), the first
and last first token, and the time until the last choice ended. The first round's regex set is
the first structured request the workers see. No seed: vLLM 0.32's CPU engine dies on seeded
n=8 requests (bench.cold_system_prompt says how).

`--first-requests`, against a deployment just started: three plain chats and then four under
the regex, one at a time (`max_tokens` 8), and their times to first token: what the first
request under a structured output pays that the next ones do not.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import httpx

from bench.cold_system_prompt import beside, choices_body, has_text, quiet_host, warm_up

SETS = (("regex", True), ("plain", False))


async def choice_set(client: httpx.AsyncClient, url: str, model: str, regex: bool,
                     requests: int = 13, n: int = 8) -> dict:
    """One set at once, streamed: served, first tokens (s) of those served, end (s)."""
    start = time.perf_counter()

    async def one(i: int) -> tuple[int, float | None]:
        body = {**choices_body(model, i, n, regex), "stream": True}
        first = None
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                return response.status_code, None
            async for line in response.aiter_lines():
                if first is None and has_text(line):
                    first = time.perf_counter() - start
        return 200, first

    results = await asyncio.gather(*(one(i) for i in range(requests)))
    firsts = sorted(t for code, t in results if code == 200 and t is not None)
    return {"served": sum(code == 200 for code, _ in results), "requests": requests,
            "firsts": firsts, "end": time.perf_counter() - start}


def _line(label: str, r: dict) -> str:
    firsts = r["firsts"]
    span = f"{firsts[0] * 1e3:.0f}..{firsts[-1] * 1e3:.0f} ms" if firsts else "-"
    return (f"{label}: served {r['served']} of {r['requests']}, first tokens {span}, "
            f"set done in {r['end']:.2f} s")


async def _turns(systems: dict[str, tuple[str, str]], rounds: int) -> dict:
    out: dict[str, dict[str, list[dict]]] = {s: {k: [] for k, _ in SETS} for s in systems}
    async with httpx.AsyncClient(timeout=120) as client:
        for name, (url, model) in systems.items():
            print(f"warming up {name}...", flush=True)
            await warm_up(client, url, model)
        for r in range(rounds):
            order = list(systems) if r % 2 == 0 else list(reversed(systems))
            for name in order:
                url, model = systems[name]
                await quiet_host(f"round {r + 1}, {name}")
                for kind, regex in SETS:
                    result = await choice_set(client, url, model, regex)
                    out[name][kind].append(result)
                    print(_line(f"round {r + 1}, {name}, {kind}", result), flush=True)
                    await asyncio.sleep(3)
    return out


def against(peer: str, rounds: int) -> None:
    with beside(peer, "choice-sets-") as systems:
        results = asyncio.run(_turns(systems, rounds))
    print(f"\nsets of 13 chats of n=8 at once, {rounds} rounds; medians over the rounds after the "
          "first (cold) one of the time until the set was done, and requests refused in all:")
    for name, kinds in results.items():
        cells = []
        for kind, runs in kinds.items():
            warm = [r["end"] for r in runs[1:]] or [runs[0]["end"]]
            refused = sum(r["requests"] - r["served"] for r in runs)
            cells.append(f"{kind} {statistics.median(warm):.2f} s (first round "
                         f"{runs[0]['end']:.2f} s), refused {refused}")
        print(f"  {name:<20} " + "; ".join(cells))


async def _first_requests(url: str) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        for regex, count in ((False, 3), (True, 4)):
            firsts = []
            for i in range(count):
                body = {**choices_body(model, i, 1, regex), "max_tokens": 8, "stream": True}
                start = time.perf_counter()
                async with client.stream("POST", f"{url}/v1/chat/completions",
                                         json=body) as response:
                    async for line in response.aiter_lines():
                        if has_text(line):
                            firsts.append(round((time.perf_counter() - start) * 1e3))
                            break
            print(f"{'under the regex' if regex else 'plain'}, one at a time: first tokens "
                  f"{firsts} ms", flush=True)


async def _once(url: str, kinds: list[str], warm: bool) -> None:
    async with httpx.AsyncClient(timeout=120) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        if warm:
            await warm_up(client, url, model)
        for kind in kinds:
            print(_line(kind, await choice_set(client, url, model, kind == "regex")), flush=True)
            await asyncio.sleep(3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--against", choices=("vllm",),
                        help="start splitserve up and this peer, and take turns (not --url)")
    parser.add_argument("--rounds", type=int, default=3, help="with --against")
    parser.add_argument("--sets", default="regex,plain",
                        help="with --url: the sets to send, in order, 3 s apart (regex, plain)")
    parser.add_argument("--warm-up", action="store_true",
                        help="with --url: the user check's two bursts of 32 completions first")
    parser.add_argument("--first-requests", action="store_true",
                        help="one chat at a time, plain then under the regex (--url)")
    args = parser.parse_args()
    if args.against:
        against(args.against, args.rounds)
    elif args.first_requests:
        asyncio.run(_first_requests(args.url))
    else:
        kinds = args.sets.split(",")
        if not set(kinds) <= {"regex", "plain"}:
            parser.error(f"--sets takes regex and plain, got {args.sets!r}")
        asyncio.run(_once(args.url, kinds, args.warm_up))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
