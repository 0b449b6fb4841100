"""Benchmark: bursts of long prompts after a spell of short ones, on the shipped defaults
(`splitserve up`, nothing changed).

The gateway's TTFT estimate is a line in the prompt tokens to prefill, flat until it has seen
prompts of different lengths (services/gateway/admission/ttft_estimator.py): the first burst of
long prompts is judged by the short ones and teaches the slope. This measures what that first
burst costs and what the next ones get: warm-up waves of short completions, 20 short requests
one after another, then --bursts bursts of --prompts prompts of about --words words each (their
own random words: no prefix is cached), 5 s apart, printing each request's status and TTFT.

With --quiet S, each burst after the first comes after S s of quiet and then one short request
alone (what a quiet spell leaves the line: one first token at one load), to measure whether
the slope the first burst taught survives the pause.

    python -m bench.long_prompt_burst [--bursts 3] [--prompts 8] [--words 2300] [--quiet 0]
                                      [--port 8830]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import httpx

from bench.flood_fairness import LIGHT_PROMPT, MODEL, admitted, request, shipped_up
from bench.loadgen.client import Target, send

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi "
         "rho sigma tau upsilon").split()


def long_prompt(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def run(url: str, args) -> None:
    target = Target(url, MODEL)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=None),
                                 timeout=300) as client:
        for wave in (4, 12, 24, 12, 4):
            await asyncio.gather(*(send(client, target, request("", 32), LIGHT_PROMPT, 0.0)
                                   for _ in range(wave)))
        for _ in range(20):
            await send(client, target, request("", 24), LIGHT_PROMPT, 0.0)
            await asyncio.sleep(0.2)
        for burst in range(args.bursts):
            start = time.monotonic()
            records = await asyncio.gather(*(
                send(client, target, request("", 8), long_prompt(100 * burst + i, args.words),
                     0.0)
                for i in range(args.prompts)))
            served = [r for r in records if admitted(r)]
            print(f"burst {burst}: {len(served)} of {len(records)} admitted, TTFTs "
                  f"{sorted(round(r.ttft_s, 1) for r in served if r.ttft_s is not None)} s, "
                  f"others {[r.status for r in records if not admitted(r)]}, "
                  f"{time.monotonic() - start:.1f} s in all", flush=True)
            if burst + 1 < args.bursts and args.quiet:
                print(f"quiet for {args.quiet:g} s, then one short request", flush=True)
                await asyncio.sleep(args.quiet)
                await send(client, target, request("", 24), LIGHT_PROMPT, 0.0)
            await asyncio.sleep(5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bursts", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--words", type=int, default=2300)
    parser.add_argument("--quiet", type=float, default=0.0,
                        help="seconds of quiet before each burst after the first (0: none)")
    parser.add_argument("--port", type=int, default=8830)
    args = parser.parse_args()
    print("splitserve up as shipped; changed: nothing", flush=True)
    with shipped_up(args.port) as url:
        asyncio.run(run(url, args))


if __name__ == "__main__":
    main()
