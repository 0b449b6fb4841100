"""Fairness between tenants of one gateway: served-token shares, TTFT p50/p99 per tenant, reject
rates and goodput under three queueing policies (FCFS, per-tenant round robin by request count,
the virtual token counter) on the same mixed workload: tenant `long` sends long prompts,
tenant `short` short ones, together more than the cluster serves, with equal weights.

    python -m bench.fairness                      # small random model, about 2 minutes
    python -m bench.fairness --duration 20 --json bench/results/fairness.json

Real processes: one prefill and one decode worker, and a gateway per policy in front of them
with the shipped admission settings except a small in-flight limit (printed, with the reason),
so that requests queue and the policy decides the order. The load is open-loop (Poisson
arrivals per tenant); the same seed gives the same arrivals.
The pieces (`TenantLoad`, `run_loads`, `run_closed`, `summarize`) serve the fairness tests
too, and `python -m bench.fairness offer ...` runs one tenant's load from its own process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

from bench.loadgen.client import Target, send
from bench.loadgen.metrics import RequestRecord, percentile
from bench.loadgen.workload import RequestSpec
from bench.run_settings import (
    Override,
    RunSettings,
    gateway_default,
    gateway_override,
    with_inherited,
)
from services.gateway.admission.tenants import key_digest

POLICIES = ("fcfs", "round_robin", "vtc")
REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class TenantLoad:
    name: str
    rate: float  # requests per second offered (Poisson arrivals)
    prompt_len: int
    output_len: int
    weight: float = 1.0
    priority: int = 0

    @property
    def api_key(self) -> str:
        return f"sk-{self.name}"


def tenants_yaml(loads: Sequence[TenantLoad], **settings) -> str:
    """A tenants file for these loads (each its own key), plus `settings` for every tenant."""
    lines = ["tenants:"]
    for load in loads:
        extra = "".join(f", {k}: {v}" for k, v in settings.items())
        lines.append(f"  {load.name}: {{api_key_sha256: '{key_digest(load.api_key)}', "
                     f"weight: {load.weight}, priority: {load.priority}{extra}}}")
    return "\n".join(lines) + "\n"


async def run_loads(url: str, model: str, loads: Sequence[TenantLoad], duration_s: float,
                    seed: int = 0, drain_s: float = 30.0, vocab: int = 700,
                    on_off: tuple[float, float] | None = None,
                    steady: bool = False) -> list[RequestRecord]:
    """Offer every load for `duration_s`; returns one record per request sent (status
    `http_429`/`http_503` for refusals, `timeout` if still open `drain_s` after the end).
    With `on_off` = (on, off) seconds, the loads pause in the off part of each period.
    `steady` sends at exact intervals of 1/rate instead of Poisson arrivals."""
    target = Target(url, model)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    loop = asyncio.get_running_loop()
    start, run_start = loop.time(), time.perf_counter()
    deadline = start + duration_s + drain_s
    pending: list[asyncio.Task] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(duration_s + drain_s), limits=limits) as client:

        async def offer(index: int, load: TenantLoad) -> None:
            rng = np.random.default_rng([seed, index])
            at, n = 0.0, 0
            while True:
                at += 1.0 / load.rate if steady else rng.exponential(1.0 / load.rate)
                if at >= duration_s:
                    return
                if on_off is not None and at % sum(on_off) >= on_off[0]:
                    continue
                await asyncio.sleep(max(0.0, start + at - loop.time()))
                prompt = rng.integers(3, vocab, load.prompt_len).tolist()
                spec = RequestSpec(index=n, cls=load.name, prompt_len=load.prompt_len,
                                   output_len=load.output_len, tenant=load.name,
                                   api_key=load.api_key)
                pending.append(asyncio.ensure_future(
                    send(client, target, spec, prompt, run_start, deadline)))
                n += 1

        await asyncio.gather(*(offer(i, load) for i, load in enumerate(loads)))
        return list(await asyncio.gather(*pending))


async def run_closed(url: str, model: str, loads: Sequence[TenantLoad], clients: int,
                     duration_s: float, seed: int = 0, vocab: int = 700) -> list[RequestRecord]:
    """`clients` loops per load, each sending its next request when the last one ends (after
    a short pause if it was refused): every tenant stays backlogged without a flood of
    refusals. `TenantLoad.rate` is unused."""
    target = Target(url, model)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    loop = asyncio.get_running_loop()
    start, run_start = loop.time(), time.perf_counter()
    records: list[RequestRecord] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(duration_s + 60), limits=limits) as client:

        async def client_loop(index: int, load: TenantLoad) -> None:
            rng = np.random.default_rng([seed, index])
            n = 0
            while loop.time() - start < duration_s:
                prompt = rng.integers(3, vocab, load.prompt_len).tolist()
                spec = RequestSpec(index=n, cls=load.name, prompt_len=load.prompt_len,
                                   output_len=load.output_len, tenant=load.name,
                                   api_key=load.api_key)
                record = await send(client, target, spec, prompt, run_start)
                records.append(record)
                if not record.ok:
                    await asyncio.sleep(0.05)
                n += 1

        await asyncio.gather(*(client_loop(i * clients + c, load)
                               for i, load in enumerate(loads) for c in range(clients)))
    return records


@dataclass(frozen=True)
class TenantResult:
    tenant: str
    sent: int
    served: int
    rejected: int  # 429 + 503
    failed: int  # anything else that did not complete
    served_tokens: int  # prompt + output of completed requests
    token_share: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    goodput_rps: float  # completed within the TTFT target, per second

    @property
    def reject_rate(self) -> float:
        return self.rejected / self.sent if self.sent else 0.0


def summarize(records: Sequence[RequestRecord], duration_s: float,
              ttft_target_s: float = 1.0) -> dict[str, TenantResult]:
    by_tenant: dict[str, list[RequestRecord]] = {}
    for record in records:
        by_tenant.setdefault(record.tenant, []).append(record)
    tokens = {t: sum(r.prompt_len + r.output_tokens for r in rs if r.ok)
              for t, rs in by_tenant.items()}
    total = sum(tokens.values()) or 1
    results = {}
    for tenant, rs in sorted(by_tenant.items()):
        ttfts = [r.ttft_s for r in rs if r.ok and r.ttft_s is not None]
        rejected = sum(r.status in ("http_429", "http_503") for r in rs)
        served = sum(r.ok for r in rs)
        results[tenant] = TenantResult(
            tenant, len(rs), served, rejected, len(rs) - served - rejected, tokens[tenant],
            tokens[tenant] / total, percentile(ttfts, 50), percentile(ttfts, 99),
            sum(t <= ttft_target_s for t in ttfts) / duration_s)
    return results


class GatewayProcess:
    """`splitserve gateway` as a child process; its output is kept for failure messages."""

    def __init__(self, args: list[str]) -> None:
        self.lines: deque[str] = deque(maxlen=200)
        self.address = ""
        self._ready = threading.Event()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "splitserve_cli.main", "gateway", "--port", "0", *args],
            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, text=True)
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line.rstrip())
            if line.startswith("SPLITSERVE_READY") and not self._ready.is_set():
                self.address = line.split()[2]
                self._ready.set()

    def wait_ready(self, timeout: float = 90.0) -> GatewayProcess:
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.1):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("gateway did not start:\n" + "\n".join(self.lines))
        return self

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def stop(self) -> None:
        if self.process.poll() is None:  # our own child, by its handle
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


@dataclass
class Cluster:
    """A prefill and a decode worker of `model`, and gateways started in front of them."""

    model: Path
    workers: list = field(default_factory=list)
    gateways: list[GatewayProcess] = field(default_factory=list)

    def __enter__(self) -> Cluster:
        from splitserve_cli.processes import start_worker

        flags = ["--num-kv-blocks", "512"]
        self.workers = [start_worker("prefill", self.model, *flags),
                        start_worker("decode", self.model, *flags)]
        # First requests set up the KV channel between the workers: not part of any policy.
        warm = self.gateway()
        asyncio.run(run_closed(warm.url, self.model.name,
                               [TenantLoad("anonymous", 1, 64, 8)], 4, 3.0))
        warm.stop()
        self.gateways.remove(warm)
        return self

    def __exit__(self, *exc) -> None:
        for gateway in self.gateways:
            gateway.stop()
        for worker in self.workers:
            worker.kill()

    def gateway(self, *flags: str) -> GatewayProcess:
        prefill, decode = self.workers
        gateway = GatewayProcess(["--model", str(self.model), "--prefill", prefill.address,
                                  "--decode", decode.address, "--health-interval-s", "0.2",
                                  *flags])
        self.gateways.append(gateway)
        return gateway.wait_ready()


def run_settings(inflight: int, ttft_target_s: float | None) -> RunSettings:
    """The shipped admission except what fairness needs, and the other changes from the
    shipped defaults, each with its reason. `inflight` 0 / `ttft_target_s` None: shipped."""
    overrides: tuple[Override, ...] = ()
    if inflight:
        overrides += (gateway_override(
            "max_inflight_per_decode", inflight,
            "requests must queue at the gateway so the fairness policy decides their order; "
            "released up to the decode worker's max_running, few would wait (--inflight 0 "
            "keeps the shipped limit)"),)
    if ttft_target_s is not None:
        overrides += (gateway_override("ttft_target_s", ttft_target_s,
                                       "--ttft-target-s given"),)
    overrides += (
        gateway_override("health_interval_s", 0.2, "a gateway per policy: routable sooner"),
        Override("bench", "--fairness", "each of --policies in turn", str(gateway_default(
            "fairness")), "the variable under test"),
        Override("bench", "--tenants-file", "tenants long and short, equal weights", "none",
                 "fairness is between tenants"),
        Override("workers", "--num-kv-blocks", "512", "from --kv-cache-memory 1GiB",
                 "a small random model on a shared machine"))
    return RunSettings("bench.fairness", with_inherited(overrides))


def goodput_target_s(settings: RunSettings) -> float:
    """Goodput counts requests within the gateway's TTFT target (the shipped one if off)."""
    target = float(settings.admission()["ttft_target_s"].split(" ")[0])
    return target or float(gateway_default("ttft_target_s"))


def measure_policy(cluster: Cluster, policy: str, loads: Sequence[TenantLoad], duration_s: float,
                   settings: RunSettings, seed: int) -> dict[str, TenantResult]:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as tenants:
        tenants.write(tenants_yaml(loads))
    # Cluster.gateway passes --health-interval-s itself; the same value again is harmless.
    gateway = cluster.gateway("--tenants-file", tenants.name, "--fairness", policy,
                              *settings.gateway_args())
    try:
        records = asyncio.run(run_loads(gateway.url, cluster.model.name, loads, duration_s, seed))
    finally:
        gateway.stop()
        cluster.gateways.remove(gateway)
        Path(tenants.name).unlink()
    return summarize(records, duration_s, goodput_target_s(settings))


def table(results: dict[str, dict[str, TenantResult]]) -> str:
    rows = ["| policy | tenant | served-token share | TTFT p50 (ms) | TTFT p99 (ms) | rejected "
            "| goodput (req/s) |", "|---|---|---|---|---|---|---|"]

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.0f}"

    for policy, tenants in results.items():
        for r in tenants.values():
            rows.append(f"| {policy} | {r.tenant} | {r.token_share:.0%} | {ms(r.ttft_p50_s)} | "
                        f"{ms(r.ttft_p99_s)} | {r.rejected} of {r.sent} ({r.reject_rate:.0%}) "
                        f"| {r.goodput_rps:.1f} |")
        total = sum(r.goodput_rps for r in tenants.values())
        rejected = sum(r.rejected for r in tenants.values())
        sent = sum(r.sent for r in tenants.values())
        rows.append(f"| {policy} | (all) | | | | {rejected} of {sent} "
                    f"({rejected / max(1, sent):.0%}) | {total:.1f} |")
    return "\n".join(rows)


def offer(argv: list[str]) -> int:
    """`python -m bench.fairness offer URL MODEL NAME RATE PROMPT OUTPUT SECONDS [ON OFF [AT]]`:
    one open-loop tenant load from its own process (so that a flood does not slow the client
    measuring another tenant), optionally on and off in turns from wall-clock time AT; prints
    its summary as JSON."""
    url, model, name, rate, prompt_len, output_len, seconds, *pattern = argv
    on_off = tuple(map(float, pattern[:2]))
    if len(pattern) > 2:
        time.sleep(max(0.0, float(pattern[2]) - time.time()))
    load = TenantLoad(name, float(rate), int(prompt_len), int(output_len))
    records = asyncio.run(run_loads(url, model, [load], float(seconds), seed=7,
                                    on_off=on_off or None))
    result = summarize(records, float(seconds))[name]
    print(json.dumps({**asdict(result), "reject_rate": result.reject_rate}))
    return 0


SMALL_MODEL = {"hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 1024,
               "head_dim": 32}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None,
                        help="model folder (default: a small random Llama built for the run)")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of load per policy")
    parser.add_argument("--inflight", type=int, default=4,
                        help="the gateway's --max-inflight-per-decode (0: the shipped default, "
                             "the decode worker's max_running)")
    parser.add_argument("--ttft-target-s", type=float, default=None,
                        help="the gateway's --ttft-target-s (default: the shipped one)")
    parser.add_argument("--long", default="12:384:32",
                        help="tenant `long`: rate:prompt_len:output_len (req/s, tokens)")
    parser.add_argument("--short", default="24:32:32", help="tenant `short`: the same")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["offer"]:
        return offer(argv[1:])
    args = build_parser().parse_args(argv)

    settings = run_settings(args.inflight, args.ttft_target_s)
    print(settings.text(), flush=True)
    loads = []
    for name in ("long", "short"):
        rate, prompt_len, output_len = getattr(args, name).split(":")
        loads.append(TenantLoad(name, float(rate), int(prompt_len), int(output_len)))
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from splitserve_cli.tiny_model import build_tiny_model

            model = build_tiny_model(Path(tmp) / "small-llama", arch="llama", seed=0,
                                     **SMALL_MODEL)
        results = {}
        with Cluster(model) as cluster:
            for policy in args.policies.split(","):
                results[policy] = measure_policy(cluster, policy, loads, args.duration,
                                                 settings, args.seed)
                print(f"{policy}: done", file=sys.stderr, flush=True)
    workload = ", ".join(f"{load.name}: {load.rate:g} req/s of {load.prompt_len} in + "
                         f"{load.output_len} out" for load in loads)
    admission = settings.admission()
    print(settings.text())
    print(f"{workload}; {args.duration:g}s per policy; in-flight limit "
          f"{admission['max_inflight_per_decode']} per decode worker; TTFT target "
          f"{admission['ttft_target_s']} s; goodput within {goodput_target_s(settings):g} s; "
          "equal weights; rejected: refused with 429/503")
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps({
            "settings": settings.to_json(),
            "results": {p: {t: {**asdict(r), "reject_rate": r.reject_rate} for t, r in ts.items()}
                        for p, ts in results.items()}}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
