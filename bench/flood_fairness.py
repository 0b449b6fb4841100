"""Benchmark: a steady tenant beside a flood that reaches the cluster all at once, on the shipped
defaults (`splitserve up`, the one change a tenants file with three tenants, printed).

Phases, one deployment: varied warm-up traffic (waves of 4, 12 and 24 requests, so the decode
worker's steps have run at several batch sizes); tenant `light` alone at 1 request a second
(short prompt, 24 tokens) for --phase-s; then tenant `heavy` opens --flood streams of 256
tokens at once, each sent again when it ends (0.2 s after a refusal, ignoring Retry-After), with
`light` at the same rate beside it for --phase-s. It prints, per phase, light's requests served
and refused and its TTFT p50/p99, and the flood's admitted count and its streams' time per
output token.

With --anonymous there is no tenants file and no key (as `make run` ships): `light` and
`heavy` are two clients, `light` from 127.0.0.2, the rest from 127.0.0.1; it runs twice, with
the shipped per-client shares of the fair queue and with all clients one share
(SPLITSERVE_GATEWAY_ANONYMOUS_FAIRNESS=none, as before December 7), one after the other, and
with --peer vllm then against vLLM's CPU build (`make peers`; bfloat16, its best configuration
here, bench/compare/vllm_peer.py), which has no admission: every request is served, however
long it waits. Each system is started fresh (no prefix cached, nothing learned).

With --phases each splitserve deployment writes its trace (SPLITSERVE_TRACE_FILE, every
request sampled: printed as a change) and the benchmark prints where light's time to first
token went beside the flood, from the spans (light_phases). --repo runs `splitserve up` from
another checkout of this project (a `git worktree` of an older commit, its models/ linked),
to set a change against the commit before it; --shipped-only leaves out the `none` half.

    python -m bench.flood_fairness [--flood 64] [--phase-s 20] [--port 8800] [--anonymous]
                                   [--peer vllm] [--phases] [--repo DIR] [--shipped-only]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from bench.loadgen.client import Target, send
from bench.loadgen.metrics import RequestRecord
from bench.loadgen.workload import RequestSpec
from bench.ttft_phases import spans_by_trace

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


@contextlib.contextmanager
def shipped_up(port: int, env: dict[str, str] | None = None,
               repo: Path = REPO) -> Iterator[str]:
    """`splitserve up` on `port` as shipped (with `env` over this process's environment), from
    the checkout `repo`: its URL once it serves; stopped on leaving."""
    up = subprocess.Popen([sys.executable, "-m", "splitserve_cli.main", "up", "--port",
                           str(port)], cwd=repo, env={**os.environ, **(env or {})},
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in up.stdout:
            if line.startswith("SPLITSERVE_UP "):
                url = line.split()[1]
                break
        else:
            raise SystemExit("splitserve up did not start")
        # Its output read to the end, so that no process of it blocks on a full pipe.
        threading.Thread(target=lambda: [None for _ in up.stdout], daemon=True).start()
        yield url
    finally:
        up.terminate()
        up.wait(60)


def request(tenant: str, output_len: int) -> RequestSpec:
    """One completion of `output_len` tokens for `tenant` (its key `sk-TENANT`; "": none)."""
    return RequestSpec(0, tenant or "-", 0, output_len, tenant=tenant,
                       api_key=f"sk-{tenant}" if tenant else "")


def admitted(record: RequestRecord) -> bool:
    """Served, or cut off by the phase's end after it was admitted."""
    return record.ok or (record.status == "timeout" and record.ttft_s is not None)


async def steady(client, target: Target, seconds: float) -> list[RequestRecord]:
    tasks = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        tasks.append(asyncio.create_task(
            send(client, target, request("light", 24), LIGHT_PROMPT, 0.0)))
        await asyncio.sleep(1.0)
    return await asyncio.gather(*tasks)


async def flooder(client, target: Target, until: float, records: list[RequestRecord]) -> None:
    """Sends the heavy tenant's requests one after another until `until` (event-loop time),
    which cuts the last one off; 0.2 s after a refusal, ignoring Retry-After."""
    loop = asyncio.get_running_loop()
    while loop.time() < until:
        record = await send(client, target, request("heavy", 256), HEAVY_PROMPT, 0.0, until)
        records.append(record)
        if not admitted(record):
            await asyncio.sleep(0.2)


def _p(values: list[float], q: float) -> str:
    if not values:
        return "-"
    values = sorted(values)
    return f"{values[min(len(values) - 1, round(q * (len(values) - 1)))] * 1000:.0f}"


def report(name: str, light: list[RequestRecord],
           heavy: list[RequestRecord] | None = None) -> None:
    ttfts = [r.ttft_s for r in light if r.ok and r.ttft_s is not None]
    line = (f"{name}: light {len(ttfts)} of {len(light)} served, TTFT p50 {_p(ttfts, 0.5)} ms "
            f"p99 {_p(ttfts, 0.99)} ms")
    if heavy is not None:
        flood = [r for r in heavy if admitted(r)]
        gaps = [g for r in flood for g in r.itl_s]
        mean = statistics.fmean(gaps) * 1000 if gaps else 0.0
        line += (f"; flood: {len(flood)} of {len(heavy)} admitted, time per output token "
                 f"mean {mean:.0f} ms, p50 {_p(gaps, 0.5)} ms")
    print(line, flush=True)


# Light's time to first token, phase by phase (label: how it is read from one trace's spans,
# by name: (span, "start"|"end") pairs, the phase running from the first to the second). The
# first token the client sees with text is the second one: the model's first after the bare
# prompt is a special token, which streams no text. So the decode worker's first step counts.
PHASES = (
    ("gateway queue", ("gateway.queue", "start"), ("gateway.queue", "end")),
    ("decode reservation", ("gateway.request", "start"), ("decode.kv_wait", "start")),
    ("prefill queue", ("prefill.queue", "start"), ("prefill.queue", "end")),
    ("prefill forward", ("prefill.forward", "start"), ("prefill.forward", "end")),
    ("KV to decode cache", ("prefill.forward", "end"), ("decode.kv_wait", "end")),
    ("decode first step", ("decode.first_step", "start"), ("decode.first_step", "end")),
)


def light_phases(trace: Path, since_ns: int) -> dict[str, list[float]]:
    """Milliseconds per phase of each of light's requests that reached the gateway after
    `since_ns` (wall clock): those whose prompt is the shortest in the trace."""
    requests = [spans for spans in spans_by_trace(trace).values() if "gateway.request" in spans
                and spans["gateway.request"]["start_ns"] >= since_ns]
    length = min((s["gateway.request"]["attributes"].get("splitserve.prompt_tokens", 0)
                  for s in requests), default=0)
    out: dict[str, list[float]] = {label: [] for label, *_ in PHASES}
    for spans in requests:
        if spans["gateway.request"]["attributes"].get("splitserve.prompt_tokens") != length:
            continue
        for label, (first, edge), (second, other) in PHASES:
            if first in spans and second in spans:
                out[label].append((spans[second][f"{other}_ns"]
                                   - spans[first][f"{edge}_ns"]) / 1e6)
    return out


def report_phases(phases: dict[str, list[float]]) -> None:
    print("  light's TTFT beside the flood, phase by phase (ms, p50 / p99): " + "; ".join(
        f"{label} {_p([v / 1000 for v in values], 0.5)} / {_p([v / 1000 for v in values], 0.99)}"
        for label, values in phases.items() if values), flush=True)


def _client(local_address: str = "") -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    transport = httpx.AsyncHTTPTransport(limits=limits, local_address=local_address or None)
    return httpx.AsyncClient(transport=transport, timeout=300)


async def run(url: str, args, model: str = MODEL) -> None:
    target = Target(url, model)
    async with _client() as client, _client("127.0.0.2" if args.anonymous else "") as other:
        for wave in (4, 12, 24, 12, 4):  # varied batch sizes before anything is measured
            await asyncio.gather(*(send(client, target, request("warm", 32), LIGHT_PROMPT, 0.0)
                                   for _ in range(wave)))
        print("warm-up done", flush=True)
        report("alone", await steady(other, target, args.phase_s))
        heavy: list[RequestRecord] = []
        args.flood_began_ns = time.time_ns()
        until = asyncio.get_running_loop().time() + args.phase_s
        floods = [asyncio.create_task(flooder(client, target, until, heavy))
                  for _ in range(args.flood)]
        light = await steady(other, target, args.phase_s)
        await asyncio.gather(*floods)
        report(f"beside a flood of {args.flood}", light, heavy)


def _against_peer(args) -> None:
    from bench.compare.systems import SYSTEMS, ServeOptions, start_system

    logs = Path(tempfile.mkdtemp(prefix="flood-fairness-"))
    print(f"{args.peer} --dtype bfloat16 in its best configuration here, light from 127.0.0.2 "
          f"and heavy from 127.0.0.1 (logs in {logs}); starting...", flush=True)
    peer = start_system(SYSTEMS[args.peer], str(REPO / "models" / MODEL), logs,
                        ServeOptions(peer_dtype="bfloat16"))
    try:
        asyncio.run(run(peer.url, args, peer.model_name))
    finally:
        peer.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flood", type=int, default=64)
    parser.add_argument("--phase-s", type=float, default=20.0)
    parser.add_argument("--port", type=int, default=8800)
    parser.add_argument("--anonymous", action="store_true",
                        help="no tenants file: light and heavy are two clients by address")
    parser.add_argument("--peer", choices=["vllm"], default="",
                        help="with --anonymous: the same phases against this peer after")
    parser.add_argument("--phases", action="store_true",
                        help="trace splitserve and print light's TTFT phase by phase")
    parser.add_argument("--repo", type=Path, default=REPO,
                        help="run splitserve up from this checkout (e.g. an older commit's)")
    parser.add_argument("--shipped-only", action="store_true",
                        help="with --anonymous: leave out the half with all clients one share")
    args = parser.parse_args()
    if args.anonymous:
        for mode in ("client",) if args.shipped_only else ("client", "none"):
            changed = ("nothing" if mode == "client" else "SPLITSERVE_GATEWAY_ANONYMOUS_FAIRNESS"
                       "=none (all clients one share of the fair queue, as before)")
            env = {} if mode == "client" else {"SPLITSERVE_GATEWAY_ANONYMOUS_FAIRNESS": mode}
            trace = Path(tempfile.mkdtemp(prefix="flood-trace-")) / "trace.jsonl"
            if outside := " ".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                                   if k.startswith("SPLITSERVE_")):
                changed = (f"{outside} (from this shell)" if changed == "nothing"
                           else f"{changed}; {outside} (from this shell)")
            if args.phases:
                env |= {"SPLITSERVE_TRACE_FILE": str(trace), "OTEL_TRACES_SAMPLER": "always_on"}
                changed += f"; traced, every request ({trace})"
            print(f"splitserve up as shipped from {args.repo}, no tenants file or key, light "
                  f"from 127.0.0.2 and heavy from 127.0.0.1; changed: {changed}", flush=True)
            with shipped_up(args.port, env, args.repo) as url:
                asyncio.run(run(url, args))
            if args.phases:
                report_phases(light_phases(trace, args.flood_began_ns))
        if args.peer:
            _against_peer(args)
        return
    with tempfile.TemporaryDirectory() as folder:
        tenants = _tenants_file(folder)
        print(f"splitserve up as shipped; changed: SPLITSERVE_TENANTS_FILE={tenants} (tenants "
              "heavy, light, warm, equal weights)", flush=True)
        with shipped_up(args.port, {"SPLITSERVE_TENANTS_FILE": tenants}) as url:
            asyncio.run(run(url, args))


if __name__ == "__main__":
    main()
