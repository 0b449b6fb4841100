"""Overload, on real processes and with the gateway's shipped admission settings (TTFT target
1 s, no in-flight limit): 10x the cluster's capacity offered for 30 s. Admitted requests meet
the TTFT target (at least 85% of those clear of its load generator's stalls), the others are
refused at once (90% within 50 ms, none later than half the target), nothing hangs, and the
gateway's memory stays flat. Within 5 s of
the overload's end, and likewise after a burst of cancelled streams, a normal load is admitted
and served in full: nothing the overload taught the admission estimator locks the gateway out.

Latencies are measured by the load generator, in this process. A refusal the generator could
not have seen in time because its own event loop was stalled (the machine's other work
descheduled it) says nothing about the gateway: such refusals are counted apart, and must
still come back within half the target once the stall's own length is taken off."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time

import httpx
import pytest
from gateway_processes import start_gateway, start_worker, worker_stats
from tenant_load import metric

from bench.fairness import TenantLoad, run_closed, run_loads
from services.gateway.config import GatewayConfig

# Big enough that 10x its capacity (a few req/s in bfloat16 on 2 cores) is a load the test's
# own client and the gateway can still offer and answer on the same 2 cores.
SMALL_MODEL = {"hidden_size": 512, "num_hidden_layers": 8, "intermediate_size": 2048,
               "head_dim": 64}
CLIENTS = 8  # closed-loop clients that measure capacity
PROMPT, OUTPUT = 32, 256
TTFT_TARGET_S = 1.0  # the gateway's default, asserted by test_the_stack_runs_the_shipped_defaults
DURATION_S = 30.0
RECOVERY_S = 5.0  # after the overload, a normal load starts this much later

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def overload_stack(tmp_path_factory):
    from splitserve_cli.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path_factory.mktemp("small-llama"), arch="llama", seed=0,
                             **SMALL_MODEL)
    # The KV cache at its shipped size (the test harness otherwise makes it small). Decode
    # batches at most 16: the admitted streams' tokens are parsed by this process's load
    # generator and sent by the gateway on the same 2 cores as the workers, and with many
    # more of them the refusals' 50 ms would measure that streaming, not admission.
    workers = [start_worker(model, role, "--num-kv-blocks", "0", "--max-num-seqs", "16",
                            shipped_dtype=True) for role in ("prefill", "decode")]
    try:
        for worker in workers:
            worker.wait_ready()
        prefill, decode = workers
        # No admission flags: what a user gets.
        gateway = start_gateway(model, "--prefill", prefill.address, "--decode", decode.address)
        try:
            yield model, gateway, decode
        finally:
            gateway.stop()
    finally:
        for worker in workers:
            worker.stop()


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


async def _with_stalls(run, threshold_s: float = 0.02):
    """Runs `run`; also returns the intervals (seconds from its start) in which this event
    loop was stalled longer than `threshold_s`."""
    stalls: list[tuple[float, float]] = []
    start = time.perf_counter()

    async def watch() -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(0.005)
            after = time.perf_counter()
            if after - before > 0.005 + threshold_s:
                stalls.append((before - start, after - start))

    watcher = asyncio.ensure_future(watch())
    try:
        return await run, stalls
    finally:
        watcher.cancel()


def _code(record) -> str:
    try:
        return json.loads(record.error)["error"]["code"] or ""
    except (ValueError, KeyError, TypeError):
        return ""


def _capacity(url: str, model: str) -> float:
    """Requests per second served by CLIENTS closed-loop clients, after a warm-up."""
    load = TenantLoad("anonymous", 1, PROMPT, OUTPUT)
    asyncio.run(run_closed(url, model, [load], CLIENTS, 3.0))  # warm the workers
    warm = asyncio.run(run_closed(url, model, [load], CLIENTS, 8.0))
    return sum(r.ok for r in warm) / 8.0


def _normal_load(url: str, model: str, capacity: float, seed: int, delay_s: float = 0.0):
    """Half the capacity for 8 s, starting `delay_s` from now."""

    async def offer():
        await asyncio.sleep(delay_s)
        return await run_loads(url, model, [TenantLoad("anonymous", capacity / 2, PROMPT, 32)],
                               8.0, seed=seed, drain_s=30.0)

    return offer()


def _assert_all_served(records, what: str) -> None:
    failed = [r for r in records if not r.ok]
    assert records and not failed, (f"{what}: {len(failed)} of {len(records)} not served",
                                    [(r.status, r.error[:200]) for r in failed[:5]])


def _wait_for_idle(decode_address: str, baseline, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while True:
        stats = worker_stats(decode_address)
        idle = (stats.kv_blocks_free == baseline.kv_blocks_free and stats.running == 0
                and stats.waiting == 0 and stats.waiting_for_kv == 0)
        if idle or time.monotonic() > deadline:
            return idle, stats
        time.sleep(0.05)


def test_the_stack_runs_the_shipped_defaults(overload_stack):
    _, gateway, _ = overload_stack
    defaults = {f.name: f.default for f in dataclasses.fields(GatewayConfig)}
    assert defaults["ttft_target_s"] == TTFT_TARGET_S
    assert defaults["max_inflight"] == 0 and defaults["max_inflight_per_decode"] == 0
    assert "--ttft-target-s" not in gateway.process.args


def test_ten_times_capacity_for_30s_then_a_normal_load(overload_stack):
    model, gateway, decode = overload_stack
    url = f"http://{gateway.address}"
    baseline = worker_stats(decode.address)
    capacity = _capacity(url, model.name)
    flood = TenantLoad("anonymous", 10 * capacity, PROMPT, OUTPUT)

    rss: list[tuple[float, int]] = []
    queued: list[float] = []
    stop = threading.Event()

    def sample() -> None:
        start = time.monotonic()
        while not stop.wait(1.0):
            rss.append((time.monotonic() - start, _rss_bytes(gateway.process.pid)))
            queued.append(metric(url, "splitserve_gateway_queued_requests",
                                 'tenant="anonymous"'))

    async def overload_then_normal():
        return await asyncio.gather(
            _with_stalls(run_loads(url, model.name, [flood], DURATION_S, seed=5, drain_s=30.0)),
            _normal_load(url, model.name, capacity, seed=6, delay_s=DURATION_S + RECOVERY_S))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        (records, stalls), after = asyncio.run(overload_then_normal())
    finally:
        stop.set()
        sampler.join(10)

    served = [r for r in records if r.ok]
    late = [r for r in records if r.status == "http_503" and _code(r) == "ttft_deadline_passed"]
    refused = [r for r in records if r.status in ("http_503", "http_429") and r not in late]
    other = [r for r in records if not r.ok and r not in late and r not in refused]

    def undisturbed_by_stalls(rs, after_s=0.0):
        # A load-generator stall on these 2 cores stalls the gateway and workers too, and the
        # client's own clock: what it overlapped says nothing about admission. Nor, for a
        # refusal's latency, do the `after_s` after it, while the requests the client held back
        # reach the gateway together.
        return [r for r in rs if not any(
            begin < r.start_s + r.e2e_s and r.start_s < end + after_s for begin, end in stalls)]

    calm_served, calm_late = undisturbed_by_stalls(served), undisturbed_by_stalls(late)
    admitted = len(calm_served) + len(calm_late)
    on_time = sum(r.ttft_s <= TTFT_TARGET_S for r in calm_served)
    undisturbed = undisturbed_by_stalls(refused, after_s=0.2)
    refused_fast = sum(r.e2e_s <= 0.050 for r in undisturbed)
    report = (f"capacity {capacity:.1f} req/s, offered {flood.rate:.0f} req/s: {len(records)} "
              f"sent, {len(served)} served, {len(late)} dropped late ({admitted} admitted clear "
              f"of stalls, {on_time} of them on time), "
              f"{len(refused)} refused ({len(refused) - len(undisturbed)} during "
              f"{len(stalls)} load-generator stalls; of the others {refused_fast} within 50 ms), "
              f"slowest {max((r.e2e_s for r in refused), default=0) * 1000:.0f} ms, "
              f"{len(other)} other; "
              f"gateway RSS {rss[0][1] >> 20} -> {rss[-1][1] >> 20} MiB, "
              f"max queued {max(queued, default=0):.0f}; "
              f"afterwards {sum(r.ok for r in after)} of {len(after)} served")
    print(report)  # shown with -s, and on failure
    assert not other, (report, other[:3])  # nothing hung, nothing failed otherwise
    assert len(refused) > 0.5 * len(records), report  # it really was overloaded
    if admitted < 0.5 * (len(served) + len(late)):
        # The load generator's own stalls (it shares the 2 cores) hid most of the run: the
        # checks below would judge a handful of requests. Inconclusive, not a pass; a clean-
        # clone CI run had 16 stalls and 29 of 146 admitted requests clear of them.
        pytest.skip(f"load-generator stalls hid the run: {report}")
    # 85%: clean-clone CI runs on 2 shared cores had 155 of 164 (94.5%) and 78 of 87 (89.7%,
    # 3 stalls) on time, the misses the load generator's own late reads; an admission that let
    # the queue grow misses most (10x capacity for 30 s queues tens of seconds of work).
    assert on_time >= 0.85 * admitted, report
    # Refused at once: 90% within 50 ms and none clear of stalls past half the TTFT target,
    # where a refusal that waited in a queue takes about the target or more. Clean-clone CI
    # runs on 2 cores shared with the load generator and the engine had 98.4%, 97.2% and 94.4%
    # within 50 ms (the slowest 184, -, 116 ms): how fast is the machine's to decide; that
    # none waited is the gateway's.
    assert refused_fast >= 0.90 * len(undisturbed), report
    assert all(r.e2e_s <= TTFT_TARGET_S / 2 for r in undisturbed), report
    # A refusal that overlapped a stall took the stall's length longer, whatever the gateway
    # did (a clean-clone CI run: 1,011 ms through a load-generator stall); less the time this
    # client was stalled, it too came back within half the target.
    def unstalled_s(r) -> float:
        end = r.start_s + r.e2e_s
        return r.e2e_s - sum(max(0.0, min(end, stop) - max(r.start_s, begin))
                             for begin, stop in stalls)

    slowest = max(refused, key=unstalled_s, default=None)
    assert slowest is None or unstalled_s(slowest) <= TTFT_TARGET_S / 2, (
        report, slowest.e2e_s, unstalled_s(slowest))
    # Bounded memory: after the first 10 s (buffers, caches warm), RSS grows by at most 10%.
    settled = [b for t, b in rss if t >= 10]
    assert max(settled) <= 1.10 * settled[0], report
    # The queue holds about one TTFT target's worth of work, never the offered backlog.
    assert max(queued) <= 2 * capacity * TTFT_TARGET_S + CLIENTS, report
    _assert_all_served(after, f"normal load {RECOVERY_S:g}s after the overload")
    idle, stats = _wait_for_idle(decode.address, baseline)
    assert idle, (baseline, stats)


def test_a_burst_of_cancelled_streams_then_a_normal_load(overload_stack):
    """64 streams at once, each cut after its first content chunk or before any byte; the
    decode worker is back at its baseline and a normal load is served in full."""
    model, gateway, decode = overload_stack
    url = f"http://{gateway.address}"
    baseline = worker_stats(decode.address)
    capacity = _capacity(url, model.name)

    async def cut(client: httpx.AsyncClient, index: int) -> None:
        body = {"model": model.name, "prompt": [3 + index % 500] * PROMPT, "max_tokens": OUTPUT,
                "stream": True, "ignore_eos": True}
        try:
            async with asyncio.timeout(0.02 if index % 4 == 0 else 10.0):
                async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            return  # leaving the block closes the connection mid-stream
        except TimeoutError:
            return  # cut before any byte

    async def burst_then_normal():
        limits = httpx.Limits(max_connections=None)
        async with httpx.AsyncClient(timeout=30, limits=limits) as client:
            await asyncio.gather(*(cut(client, i) for i in range(64)))
        return await _normal_load(url, model.name, capacity, seed=7, delay_s=0.5)

    after = asyncio.run(burst_then_normal())
    _assert_all_served(after, "normal load after 64 cancelled streams")
    idle, stats = _wait_for_idle(decode.address, baseline)
    assert idle, (baseline, stats)
