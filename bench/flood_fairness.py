"""Benchmark: a steady tenant beside a flood that reaches the cluster all at once, on the shipped
defaults (`splitserve up`, the one change a tenants file with three tenants, printed).

Phases, one deployment: varied warm-up traffic (waves of 4, 12 and 24 requests, so the decode
worker's steps have run at several batch sizes); tenant `light` alone at 1 request a second
(short prompt, 24 tokens) for --phase-s; then tenant `heavy` opens --flood streams of 256
tokens at once, each sent again when it ends (0.2 s after a refusal, ignoring Retry-After), with
`light` at the same rate beside it for --phase-s. It prints, per phase, light's requests served
and refused and its TTFT p50/p99, and the flood's admitted count and its streams' time per
output token.

    python -m bench.flood_fairness [--flood 64] [--phase-s 20] [--port 8800]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
LIGHT_PROMPT = "Write one sentence about the sea."
HEAVY_PROMPT = "Write a very long essay about the history of the Roman empire, in detail. " * 2


def _tenants_file(folder: str) -> str:
    lines = ["tenants:"]
    for name in ("heavy", "light", "warm"):
        digest = hashlib.sha256(f"sk-{name}".encode()).hexdigest()
        lines.append(f"  {name}: {{api_key_sha256: ['{digest}']}}")
    path = Path(folder) / "tenants.yaml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


async def one(client: httpx.AsyncClient, url: str, key: str, prompt: str, max_tokens: int,
              record: dict | None = None) -> dict:
    """One streamed completion; `record` (filled as it goes) holds its status, TTFT and gaps."""
    record = {} if record is None else record
    record.update({"status": None, "ttft": None, "gaps": []})
    start = time.monotonic()
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True}
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=300,
                                 headers={"Authorization": f"Bearer sk-{key}"}) as response:
            record["status"] = response.status_code
            if response.status_code != 200:
                await response.aread()
                return record
            last = None
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                if json.loads(line[6:])["choices"][0].get("text"):
                    now = time.monotonic()
                    if last is None:
                        record["ttft"] = now - start
                    else:
                        record["gaps"].append(now - last)
                    last = now
    except httpx.HTTPError as exc:
        record["status"] = type(exc).__name__
    return record


async def steady(client, url, seconds: float) -> list[dict]:
    tasks = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        tasks.append(asyncio.create_task(one(client, url, "light", LIGHT_PROMPT, 24)))
        await asyncio.sleep(1.0)
    return await asyncio.gather(*tasks)


async def flooder(client, url, stop: asyncio.Event, records: list[dict]) -> None:
    while not stop.is_set():
        record: dict = {}
        records.append(record)  # counted when the phase ends, finished or not
        await one(client, url, "heavy", HEAVY_PROMPT, 256, record)
        if record["status"] != 200:
            await asyncio.sleep(0.2)


def _p(values: list[float], q: float) -> str:
    if not values:
        return "-"
    values = sorted(values)
    return f"{values[min(len(values) - 1, round(q * (len(values) - 1)))] * 1000:.0f}"


def report(name: str, light: list[dict], heavy: list[dict] | None = None) -> None:
    served = [r for r in light if r["status"] == 200 and r["ttft"] is not None]
    ttfts = [r["ttft"] for r in served]
    line = (f"{name}: light {len(served)} of {len(light)} served, TTFT p50 {_p(ttfts, 0.5)} ms "
            f"p99 {_p(ttfts, 0.99)} ms")
    if heavy is not None:
        admitted = [r for r in heavy if r["status"] == 200]
        gaps = [g for r in admitted for g in r["gaps"]]
        mean = statistics.fmean(gaps) * 1000 if gaps else 0.0
        line += (f"; flood: {len(admitted)} of {len(heavy)} admitted, time per output token "
                 f"mean {mean:.0f} ms, p50 {_p(gaps, 0.5)} ms")
    print(line, flush=True)


async def run(url: str, args) -> None:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits) as client:
        for wave in (4, 12, 24, 12, 4):  # varied batch sizes before anything is measured
            await asyncio.gather(*(one(client, url, "warm", LIGHT_PROMPT, 32)
                                   for _ in range(wave)))
        print("warm-up done", flush=True)
        report("alone", await steady(client, url, args.phase_s))
        stop, heavy = asyncio.Event(), []
        floods = [asyncio.create_task(flooder(client, url, stop, heavy))
                  for _ in range(args.flood)]
        light = await steady(client, url, args.phase_s)
        stop.set()
        for task in floods:
            task.cancel()
        await asyncio.gather(*floods, return_exceptions=True)
        report(f"beside a flood of {args.flood}", light, heavy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flood", type=int, default=64)
    parser.add_argument("--phase-s", type=float, default=20.0)
    parser.add_argument("--port", type=int, default=8800)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        tenants = _tenants_file(folder)
        print(f"splitserve up as shipped; changed: SPLITSERVE_TENANTS_FILE={tenants} (tenants "
              "heavy, light, warm, equal weights)", flush=True)
        env = {**os.environ, "SPLITSERVE_TENANTS_FILE": tenants}
        up = subprocess.Popen([sys.executable, "-m", "splitserve_cli.main", "up", "--port",
                               str(args.port)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        try:
            for line in up.stdout:
                if line.startswith("SPLITSERVE_UP "):
                    url = line.split()[1]
                    break
            else:
                raise SystemExit("splitserve up did not start")
            # Its output read to the end, so that no process of it blocks on a full pipe.
            threading.Thread(target=lambda: [None for _ in up.stdout], daemon=True).start()
            asyncio.run(run(url, args))
        finally:
            up.terminate()
            up.wait(60)


if __name__ == "__main__":
    main()
