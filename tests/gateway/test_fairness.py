"""Fairness between tenants, on real processes: a small random model behind a gateway whose
in-flight limit is small enough that requests queue and the fair queue decides the order.

A flooding tenant (10x its share) leaves a modest tenant of equal weight its served-token share
and its time to first token; weights 2:1 split served tokens 2:1 when both are backlogged.
The flood runs from its own process, on and off in turns, so that the modest tenant's "alone"
and "with the flood" samples come from the same minutes of the same machine.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import httpx
import pytest
from gateway_processes import REPO_ROOT, admin_url, start_gateway, start_worker
from tenant_load import tenants_file

from bench.fairness import TenantLoad, run_closed, run_loads
from bench.loadgen.metrics import percentile

# Slow enough per token that the workers, not the gateway or the load generator, are what the
# in-flight limit rations; still built in a second.
SMALL_MODEL = {"hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 1024,
               "head_dim": 32}
INFLIGHT = 8
PROMPT, OUTPUT = 32, 128
# B: a steady load (requests at even intervals) of long-prompt, short-answer requests: its TTFT
# is its own prefill, as for real prompts (on a small shared CPU the TTFT of tiny prompts is
# scheduling noise). Its rate is a fraction of the measured capacity, well under its half.
STEADY_PROMPT, STEADY_OUTPUT, STEADY_FRACTION = 448, 16, 0.2
ON_S, OFF_S, PERIODS = 8.0, 8.0, 5
SETTLE_S = 2.0  # after each switch, before samples count

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    from splitserve_cli.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("small-llama"), arch="llama", seed=0,
                            **SMALL_MODEL)


@pytest.fixture(scope="module")
def small_workers(small_model):
    workers = [start_worker(small_model, "prefill"), start_worker(small_model, "decode")]
    try:
        for worker in workers:
            worker.wait_ready()
        yield workers
    finally:
        for worker in workers:
            worker.stop()


@pytest.fixture
def fair_gateway(small_model, small_workers, tmp_path):
    started = []

    def start(tenants: dict[str, dict], *flags: str):
        prefill, decode = small_workers
        gateway = start_gateway(small_model, "--prefill", prefill.address, "--decode",
                                decode.address, "--tenants-file", tenants_file(tmp_path, tenants),
                                "--max-inflight-per-decode", str(INFLIGHT), *flags)
        started.append(gateway)
        return f"http://{gateway.address}"

    yield start
    for gateway in started:
        gateway.stop()


def _served_tokens(text: str, tenant: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith("splitserve_gateway_served_tokens_total{") and f'tenant="{tenant}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


async def _served_in_windows(url: str, start_at: float, windows, tenants) -> dict:
    """Tokens each tenant was served within the (begin, end, kind) windows (seconds from
    start_at, in time order), summed per kind: {kind: {tenant: tokens}}."""
    served: dict = {}
    async with httpx.AsyncClient(timeout=10) as client:
        for begin, end, kind in windows:
            marks = []
            for at in (begin, end):
                await asyncio.sleep(max(0.0, start_at + at - time.time()))
                marks.append((await client.get(f"{admin_url(url)}/metrics")).text)
            totals = served.setdefault(kind, dict.fromkeys(tenants, 0.0))
            for tenant in tenants:
                totals[tenant] += _served_tokens(marks[1], tenant) - _served_tokens(marks[0], tenant)
    return served


def _refusals(url: str, tenant: str) -> dict[str, float]:
    """The gateway's refusals of `tenant`, by reason."""
    text = httpx.get(f"{admin_url(url)}/metrics", timeout=10).text
    return {line.split('reason="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("splitserve_gateway_rejected_requests_total{")
            and f'tenant="{tenant}"' in line}


def _capacity(url: str, model: str) -> float:
    """Requests per second the gateway serves with every slot busy (closed loop)."""
    records = asyncio.run(run_closed(url, model, [TenantLoad("a", 1, PROMPT, OUTPUT)],
                                     2 * INFLIGHT, 4.0))
    return sum(r.ok for r in records) / 4.0


def test_a_flooding_tenant_leaves_a_modest_one_its_share_and_its_latency(fair_gateway,
                                                                        small_model):
    """B sends long prompts at even intervals, under its half of the capacity; A floods at ten
    times its share, on and off in turns. B's samples with and without the flood come from the
    same stretch of time, so machine noise hits both alike."""
    url = fair_gateway({"a": {"weight": 1}, "b": {"weight": 1}})
    capacity = _capacity(url, small_model.name)
    flood_rate = 10 * 0.5 * capacity  # ten times A's share
    period = ON_S + OFF_S
    duration = period * PERIODS
    start_at = time.time() + 3.0  # the flood process needs a moment to start
    # The flood's client is the load generator, not the system under test: niced, so that on a
    # small machine it takes CPU from the gateway and the workers only when they leave it idle.
    flood = subprocess.Popen(
        ["nice", "-n", "19", sys.executable, "-m", "bench.fairness", "offer", url,
         small_model.name, "a", str(flood_rate), str(PROMPT), str(OUTPUT), str(duration), str(ON_S), str(OFF_S),
         str(start_at)], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    steady = TenantLoad("b", STEADY_FRACTION * capacity, STEADY_PROMPT, STEADY_OUTPUT)
    # Flood on, then flood off, in each period: the same length after the same settling.
    windows = [w for p in range(PERIODS) for w in (
        (p * period + SETTLE_S, p * period + ON_S, "flood"),
        (p * period + ON_S + SETTLE_S, (p + 1) * period, "alone"))]

    async def scenario():
        await asyncio.sleep(max(0.0, start_at - time.time()))
        return await asyncio.gather(
            run_loads(url, small_model.name, [steady], duration, steady=True),
            _served_in_windows(url, start_at, windows, ("a", "b")))

    try:
        records, served = asyncio.run(scenario())
        flood_out = flood.communicate(timeout=120)[0]
    finally:
        flood.kill()

    def flooded(record) -> bool:
        return SETTLE_S <= record.start_s % period < ON_S

    def alone(record) -> bool:
        return ON_S + SETTLE_S <= record.start_s % period

    with_flood = [r.ttft_s for r in records if r.ok and flooded(r)]
    by_itself = [r.ttft_s for r in records if r.ok and alone(r)]
    refused = [r for r in records if not r.ok]
    during, apart = served["flood"], served["alone"]
    share = during["b"] / (during["a"] + during["b"])
    kept = during["b"] / max(apart["b"], 1.0)  # B's served tokens with the flood / without it
    p95_flood, p95_alone = percentile(with_flood, 95), percentile(by_itself, 95)
    report = (f"flood {flood_rate:.0f} req/s ({flood_out.strip()[:120]}); b share {share:.0%}, "
              f"b served {kept:.0%} of its tokens without the flood, "
              f"b ttft p95 {p95_flood:.3f}s with the flood vs {p95_alone:.3f}s alone (p50 "
              f"{percentile(with_flood, 50):.3f}s vs {percentile(by_itself, 50):.3f}s, p99 "
              f"{percentile(with_flood, 99):.3f}s vs {percentile(by_itself, 99):.3f}s, "
              f"{len(with_flood)} and {len(by_itself)} samples), {len(refused)} b refused "
              f"{_refusals(url, 'b')}")
    print(report)  # shown with -s, and on failure
    # Niced, the flood still offered its ten shares (a starved generator would prove nothing).
    assert json.loads(flood_out)["sent"] >= 0.9 * flood_rate * ON_S * PERIODS, report
    # B asks for less than its half, so its share of the tokens is what it asks for against
    # whatever A's flood fills (about 37-44% here, lower the better the flood is served); what
    # fairness owes B is all it asks for: the tokens it is served alone, flood or no flood.
    assert kept >= 0.9, report
    assert share >= 0.30, report
    # The tail B sees: p95, not p99, which over ~78 samples a side is the mean of the two
    # slowest, one stray stall of a shared core (a clean-clone CI run: p99 0.152 s against
    # 0.074 s alone, p50 0.091 s against 0.061 s).
    assert p95_flood <= 2 * p95_alone, report
    # B's TTFT prediction is made from measured service times, which the flood's CPU use on
    # two shared cores inflates now and then: a stray early refusal of B is the predictor's
    # noise (and costs B share, checked above); a pattern of them is a bug.
    assert len(refused) <= 0.02 * len(records), report
    # The admission-level reason: B never waited behind A's flood in the fair queue.
    text = httpx.get(f"{admin_url(url)}/metrics", timeout=10).text
    waited = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("splitserve_gateway_queue_wait_seconds_")
              and 'tenant="b"' in line and "_bucket" not in line}
    assert waited["splitserve_gateway_queue_wait_seconds_sum"] <= (
        0.005 * waited["splitserve_gateway_queue_wait_seconds_count"]), waited


def test_weights_two_to_one_split_served_tokens_two_to_one(fair_gateway, small_model):
    # No early rejection here: every client's request waits its turn, so both tenants stay
    # backlogged whatever the machine's speed, and the order alone decides the shares.
    url = fair_gateway({"heavy": {"weight": 2}, "light": {"weight": 1}}, "--ttft-target-s", "0")
    # Short requests: many of them finish in the window, so the shares are not lumpy.
    loads = [TenantLoad("heavy", 1, PROMPT, 32), TenantLoad("light", 1, PROMPT, 32)]
    start_at = time.time()

    async def scenario():
        # Both tenants keep more requests outstanding than the in-flight limit: both backlogged.
        return await asyncio.gather(
            run_closed(url, small_model.name, loads, 2 * INFLIGHT, 28.0),
            _served_in_windows(url, start_at, [(4.0, 28.0, "both")], ("heavy", "light")))

    _, windows = asyncio.run(scenario())
    served = windows["both"]
    ratio = served["heavy"] / served["light"]
    print(f"served tokens {served}: heavy/light {ratio:.2f}")
    assert ratio == pytest.approx(2.0, rel=0.10), served
