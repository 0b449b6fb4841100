"""Chats sent at once behind a system prompt no worker has seen, against a deployment that is
up (`make run`): how many are served, and their times to first token. The `make run` user check
of admission with a shared prefix; each run draws a new system prompt (a cold prefix cache).
`--warm-up` first sends what the user check sends before it, two bursts of 32 short
completions, so the gateway's TTFT estimate has been fitted (an untrained one admits anything).
`--choices 8` then sends 13 requests of n=8 under a regex at once (each choice a sequence of
its own on the workers: what they teach the estimate must not refuse the chats after them).

    python -m bench.cold_system_prompt --warm-up       # 12 chats, ~1,100-token system prompt
    python -m bench.cold_system_prompt --warm-up --choices 8 --bursts 2
    python -m bench.cold_system_prompt --chats 16 --url http://127.0.0.1:8000
    python -m bench.cold_system_prompt --against vllm --rounds 3
    python -m bench.cold_system_prompt --against vllm --rounds 3 --choices 8

`--against vllm` starts `splitserve up` (every shipped default) and vLLM's CPU server (`make
peers`; its best configuration here, as bench.compare runs it), warms both up, then takes
turns: each round sends the same burst (a new system prompt, the same for both) to one system
and then the other, alternating which goes first; with `--choices N`, each system gets the 13
requests of n=N right before its burst. Each turn starts once the host's cores are idle (at
most 30 s; the wait is printed when it was over a second).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import re
import time
from collections.abc import Iterator

import httpx

CHOICE_REGEX = "[A-Z][a-z]{2,8} [0-9]{1,3}"
WORDS = "river stone cloud forest light music paper window garden ocean castle dream".split()


def has_text(line: str) -> bool:
    """Whether a streamed chat line carries generated text (not the role's empty first delta)."""
    return '"content":"' in line and '"content":""' not in line


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
            if has_text(line):
                return 200, time.perf_counter() - start
    return 200, None


def _cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of the whole host since boot, from /proc/stat."""
    with open("/proc/stat") as stat:
        fields = [int(x) for x in stat.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


async def quiet_host(label: str, busy_below: float = 0.1, longest_s: float = 30.0) -> None:
    """Wait until the host's CPUs are idle (under `busy_below` busy over half a second), at
    most `longest_s`: a system's turn then starts on cores its peer has left, whatever work
    (a compilation, a spinning thread pool) the peer still runs. The turn right after the
    warm-ups, always splitserve's first, had run 1.3-1.9x slower than its later ones; in the
    first runs with this wait it never waited over a second, so that was not the cause."""
    start = time.monotonic()
    while True:
        busy0, total0 = _cpu_times()
        await asyncio.sleep(0.5)
        busy1, total1 = _cpu_times()
        share = (busy1 - busy0) / max(1, total1 - total0)
        waited = time.monotonic() - start
        if share < busy_below or waited >= longest_s:
            if waited > 1.0:
                print(f"  ({label}: waited {waited:.1f} s for idle cores; last {share:.0%} busy)",
                      flush=True)
            return


async def warm_up(client: httpx.AsyncClient, url: str, model: str) -> None:
    for _ in range(2):
        await asyncio.gather(*(client.post(f"{url}/v1/completions", json={
            "model": model, "prompt": f"Tell me about number {i}", "max_tokens": 32})
            for i in range(32)))
        await asyncio.sleep(3)


async def many_choices(client: httpx.AsyncClient, url: str, model: str, n: int,
                       requests: int = 13, label: str = "") -> list[int]:
    """`requests` chats of `n` choices each under a regex, sent at once; prints what came back
    and returns the status codes."""
    async def one(i: int) -> tuple[int, list[str]]:
        response = await client.post(f"{url}/v1/chat/completions",
                                     json=choices_body(model, i, n, regex=True))
        if response.status_code != 200:
            return response.status_code, []
        return 200, [c["message"]["content"] for c in response.json()["choices"]]

    start = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(requests)))
    codes = [code for code, _ in results]
    texts = [text for _, answer in results for text in answer]
    outside = sum(not re.fullmatch(CHOICE_REGEX, text) for text in texts)
    print(f"{label}{requests} requests of n={n} under a regex at once: served {codes.count(200)}, "
          f"refused {codes.count(503)} (503), other {len(codes) - codes.count(200) - codes.count(503)}"
          f"; {len(texts)} choices, {outside} outside the regex; "
          f"{time.perf_counter() - start:.2f} s", flush=True)
    return codes


def choices_body(model: str, i: int, n: int, regex: bool) -> dict:
    """A chat request for `n` sampled choices (no seed: vLLM's CPU engine dies on seeded
    ones), under CHOICE_REGEX if `regex`."""
    body = {"model": model, "max_tokens": 16, "temperature": 1.0, "n": n, "messages": [
        {"role": "user", "content": f"Review number {i}: the film was long."}]}
    if regex:
        body["structured_outputs"] = {"regex": CHOICE_REGEX}
    return body


def random_words(rng: random.Random, words: int) -> str:
    """Words no prompt before it had (~7 tokens each: a word and a number)."""
    return " ".join(f"{rng.choice(WORDS)}{rng.randrange(10**6)}" for _ in range(words))


def _system_prompt(rng: random.Random, words: int) -> str:
    return "You are a helpful assistant. " + random_words(rng, words)


async def burst(client: httpx.AsyncClient, url: str, model: str, system: str,
                chats: int) -> tuple[list[int], list[int]]:
    """(status codes, first-token milliseconds of those served, sorted)."""
    results = await asyncio.gather(*(_chat(client, url, model, system, i)
                                     for i in range(chats)))
    return ([status for status, _ in results],
            sorted(round(t * 1e3) for _, t in results if t is not None))


def _summary(codes: list[int], ttft: list[int]) -> str:
    return (f"served {codes.count(200)}, refused {codes.count(503)} (503), other "
            f"{len(codes) - codes.count(200) - codes.count(503)}; TTFT ms {ttft}")


async def run(url: str, chats: int, words: int, seed: int | None, warm: bool, choices: int,
              bursts: int) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=120) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        if warm:
            await warm_up(client, url, model)
        if choices:
            await many_choices(client, url, model, choices)
        for b in range(bursts):
            if b:
                await asyncio.sleep(5)
            codes, ttft = await burst(client, url, model, _system_prompt(rng, words), chats)
            print(f"{chats} chats behind a new system prompt: {_summary(codes, ttft)}",
                  flush=True)


async def _take_turns(systems: dict[str, tuple[str, str]], chats: int, words: int,
                      rounds: int, seed: int | None, choices: int,
                      ) -> tuple[dict[str, list[tuple[list[int], list[int]]]], dict[str, list[int]]]:
    """Per system: each round's (status codes, first tokens) of the chats, and the status codes
    of the n=`choices` requests sent before them (none without `choices`)."""
    rng = random.Random(seed)
    out: dict[str, list[tuple[list[int], list[int]]]] = {name: [] for name in systems}
    many: dict[str, list[int]] = {name: [] for name in systems}
    async with httpx.AsyncClient(timeout=120) as client:
        for name, (url, model) in systems.items():
            print(f"warming up {name}...", flush=True)
            await warm_up(client, url, model)
        for r in range(rounds):
            system = _system_prompt(rng, words)
            order = list(systems) if r % 2 == 0 else list(reversed(systems))
            for name in order:
                url, model = systems[name]
                await quiet_host(f"round {r + 1}, {name}")
                if choices:
                    many[name] += await many_choices(client, url, model, choices,
                                                     label=f"round {r + 1}, {name}: ")
                codes, ttft = await burst(client, url, model, system, chats)
                out[name].append((codes, ttft))
                print(f"round {r + 1}, {name}: {_summary(codes, ttft)}", flush=True)
                await asyncio.sleep(3)
    return out, many


@contextlib.contextmanager
def beside(peer: str, log_prefix: str) -> Iterator[dict[str, tuple[str, str]]]:
    """`splitserve up` (every shipped default) and `peer`'s server started side by side, each
    system's (url, model name) by name while the block runs; both stopped after it. Prints the
    settings: splitserve's dtype is auto (bfloat16 on a CPU with native bf16); vLLM is started
    as the project's peer runs always are, --dtype bfloat16, in its best configuration here."""
    import tempfile
    from pathlib import Path

    from bench.compare.systems import SYSTEMS, ServeOptions, start_system

    root = Path(__file__).resolve().parents[1]
    model_dir = str(root / "models" / "smollm2-135m-instruct")
    logs = Path(tempfile.mkdtemp(prefix=log_prefix))
    opts = ServeOptions(peer_dtype="bfloat16")
    print("settings: splitserve up with every shipped default (dtype auto, admission on); "
          "vLLM --dtype bfloat16 in its best configuration here (bench/compare/vllm_peer.py)",
          flush=True)
    running = []
    try:
        for name in ("splitserve-disagg", peer):
            print(f"starting {name} (logs in {logs})...", flush=True)
            running.append(start_system(SYSTEMS[name], model_dir, logs, opts))
        yield {r.spec.name: (r.url, r.model_name) for r in running}
    finally:
        for r in running:
            r.stop()


def against(peer: str, chats: int, words: int, rounds: int, seed: int | None,
            choices: int = 0) -> None:
    import statistics

    with beside(peer, "cold-system-prompt-") as systems:
        results, many = asyncio.run(_take_turns(systems, chats, words, rounds, seed, choices))
    before = f", each after 13 requests of n={choices} under a regex" if choices else ""
    print(f"\n{chats} chats at once behind a new system prompt{before}, {rounds} rounds "
          "(medians over rounds of each burst's first / median / last first token, ms; "
          "refused in all):")
    for name, bursts in results.items():
        served = [ttft for _, ttft in bursts if ttft]
        cells = " / ".join(f"{statistics.median(pick(t) for t in served):.0f}" for pick in (
            lambda t: t[0], lambda t: t[len(t) // 2], lambda t: t[-1])) if served else "-"
        refused = sum(codes.count(503) for codes, _ in bursts)
        n_refused = (f"; n={choices} requests refused {len(many[name]) - many[name].count(200)} "
                     f"of {len(many[name])}" if choices else "")
        print(f"  {name:<20} {cells}   refused {refused} of {chats * len(bursts)}{n_refused}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--chats", type=int, default=12)
    parser.add_argument("--words", type=int, default=160, help="system prompt words (~7 tokens each: a word and a number)")
    parser.add_argument("--seed", type=int, default=None, help="default: a new prompt each run")
    parser.add_argument("--warm-up", action="store_true",
                        help="two bursts of 32 short completions first")
    parser.add_argument("--choices", type=int, default=0, metavar="N",
                        help="before the chats, 13 requests of n=N under a regex at once "
                        "(with --against: before each system's burst, every round)")
    parser.add_argument("--bursts", type=int, default=1, help="bursts of chats, 5 s apart, "
                        "each behind a new system prompt")
    parser.add_argument("--against", choices=("vllm",),
                        help="start splitserve up and this peer, and take turns (not --url)")
    parser.add_argument("--rounds", type=int, default=3, help="with --against")
    args = parser.parse_args()
    if args.against:
        against(args.against, args.chats, args.words, args.rounds, args.seed, args.choices)
    else:
        asyncio.run(run(args.url, args.chats, args.words, args.seed, args.warm_up, args.choices,
                        args.bursts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
