"""Cost per query through real processes: the compute seconds the workers charge each
request come back in `usage.splitserve`, add up to the workers' busy step seconds, feed the
per-tenant counter and the access log, and a cached prefix is charged less."""

from __future__ import annotations

import json
import random
import threading
import time

import grpc
import httpx
import pytest
from gateway_processes import Stack, start_gateway, start_worker
from splitserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

from engine.outputs import ComputeSeconds
from services.common.convert import compute_from_pb
from tests.metrics_text import scrape

# Long prompts in small chunks, so prefill chunks share steps with other requests' decodes.
CHUNKED = ("--long-prefill-token-threshold", "48", "--max-num-batched-tokens", "96")
MODEL_NAME = ""  # the served name: the model folder's (set by _served_name)
MIXED_LOAD = [(20, 40), (300, 6), (90, 24), (450, 3), (150, 12), (8, 30)]  # (prompt, max_tokens)


@pytest.fixture(autouse=True, scope="module")
def _served_name(tiny_llama_dir):
    global MODEL_NAME
    MODEL_NAME = tiny_llama_dir.name


@pytest.fixture(scope="module")
def chunked_agg_stack(tiny_llama_dir):
    worker = start_worker(tiny_llama_dir, "both", *CHUNKED)
    try:
        worker.wait_ready()
        gateway = start_gateway(tiny_llama_dir, "--worker", worker.address)
        try:
            _complete(f"http://{gateway.address}", _prompt(100), 2, stream=False)  # warm-up
            yield Stack(gateway, worker)
        finally:
            gateway.stop()
    finally:
        worker.stop()


_RNG = random.Random()


def _prompt(length: int) -> list[int]:
    """A prompt no other shares a block with (random tokens of the tiny vocabulary)."""
    return [_RNG.randrange(3, 250) for _ in range(length)]


def _complete(url: str, prompt: list[int], max_tokens: int, stream: bool,
              request_id: str | None = None) -> dict:
    """The final usage of one completion (the last SSE chunk's, when streamed)."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    headers = {"x-request-id": request_id} if request_id else {}
    if not stream:
        response = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)
        response.raise_for_status()
        return response.json()["usage"]
    body["stream_options"] = {"include_usage": True}
    usage = None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers,
                      timeout=120) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
    assert usage is not None
    return usage


def _busy_seconds(*workers) -> float:
    """Sum of splitserve_worker_step_seconds over the workers (a worker's name is its role)."""
    return sum(scrape(f"http://{w.field('metrics')}")
               [f'splitserve_worker_step_seconds_sum{{role="{w.name}"}}'] for w in workers)


def _tenant_seconds(stack: Stack) -> dict[str, float]:
    values = scrape(stack.admin_url)
    return {phase: values.get(
        f'splitserve_tenant_compute_seconds_total{{phase="{phase}",tenant="anonymous"}}', 0.0)
        for phase in ("prefill", "decode", "transfer")}


def _run_mixed_load(stack: Stack) -> list[dict]:
    usages: list[dict | None] = [None] * len(MIXED_LOAD)

    def one(i: int, length: int, max_tokens: int) -> None:
        usages[i] = _complete(stack.url, _prompt(length), max_tokens,
                              stream=i % 2 == 0)

    threads = [threading.Thread(target=one, args=(i, *shape)) for i, shape in enumerate(MIXED_LOAD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert all(u is not None for u in usages)
    time.sleep(0.3)  # the last step's histogram sample lands just after its output
    return usages


def _check_adds_up(stack: Stack, workers) -> list[dict]:
    busy_before, tenant_before = _busy_seconds(*workers), _tenant_seconds(stack)
    usages = _run_mixed_load(stack)
    busy = _busy_seconds(*workers) - busy_before
    charged = [u["splitserve"]["compute_seconds"] for u in usages]
    total = sum(c["prefill"] + c["decode"] + c["transfer"] for c in charged)
    # The step-seconds metric is the engines' own timing of the steps they charge, so the two
    # agree but for the responses' rounding to microseconds (0.002% measured). A decode worker
    # writes arriving KV as a command between steps: those seconds are charged (transfer) but
    # are not in its step_seconds, so they may add to the total.
    outside_steps = sum(c["transfer"] for c in charged) if len(workers) > 1 else 0.0
    assert busy * 0.995 <= total <= busy * 1.005 + outside_steps, (total, busy, charged)
    assert all(c["prefill"] > 0 and c["decode"] > 0 for c in charged), charged
    # The tenant counter grew by what the responses carried (rounded to microseconds there).
    tenant = _tenant_seconds(stack)
    for phase in ("prefill", "decode", "transfer"):
        grown = tenant[phase] - tenant_before[phase]
        assert abs(grown - sum(c[phase] for c in charged)) < 1e-4 * len(charged), phase
    return charged


def test_charged_seconds_add_up_to_busy_step_seconds_on_an_aggregated_worker(chunked_agg_stack):
    charged = _check_adds_up(chunked_agg_stack, [chunked_agg_stack.decode])
    assert all(c["transfer"] == 0 for c in charged)
    # The 450-token prompt paid more prefill than the 8-token one, the 40-token answer more
    # decoding than the 3-token one (wide margins: the tiny model's steps are noisy).
    assert charged[3]["prefill"] > charged[5]["prefill"]
    assert charged[0]["decode"] > charged[3]["decode"]


def test_charged_seconds_add_up_over_prefill_and_decode_workers(disagg_stack):
    charged = _check_adds_up(disagg_stack, [disagg_stack.prefill, disagg_stack.decode])
    assert all(c["transfer"] > 0 for c in charged), charged  # the KV copy out and in


def test_a_request_sharing_a_cached_prefix_is_charged_less_prefill(chunked_agg_stack):
    url = chunked_agg_stack.url
    shared = _prompt(400)
    _complete(url, _prompt(402), 1, stream=False)  # warm-up of this shape
    cold = _complete(url, shared + [5, 6], 1, stream=False)
    warm = _complete(url, shared + [7, 8], 1, stream=False)
    other = _complete(url, _prompt(402), 1, stream=False)
    assert warm["splitserve"]["cached_tokens"] >= 384
    assert cold["splitserve"]["cached_tokens"] == 0
    warm_s, cold_s, other_s = (u["splitserve"]["compute_seconds"]["prefill"]
                               for u in (warm, cold, other))
    assert warm_s < 0.5 * min(cold_s, other_s), (warm_s, cold_s, other_s)


def test_the_access_log_records_each_requests_compute_seconds(chunked_agg_stack):
    request_id = f"cost-{_RNG.getrandbits(48):x}"
    usage = _complete(chunked_agg_stack.url, _prompt(30), 5, stream=True, request_id=request_id)
    deadline = time.monotonic() + 10
    mine: list[dict] = []
    while not mine and time.monotonic() < deadline:
        mine = [json.loads(line) for line in list(chunked_agg_stack.gateway.lines)
                if request_id in line and '"splitserve.access"' in line]
        time.sleep(0.05)
    assert len(mine) == 1, chunked_agg_stack.gateway.output()
    assert mine[0]["compute_seconds"] == {k: usage["splitserve"]["compute_seconds"][k]
                                          for k in ("prefill", "decode", "transfer")}
    assert mine[0]["compute_seconds"]["prefill"] > 0
    assert (mine[0]["api"], mine[0]["endpoint"]) == ("http", "/v1/completions")


def test_the_grpc_front_door_returns_compute_seconds_in_the_last_usage(chunked_agg_stack):
    request = gateway_pb2.GenerateTextRequest(
        token_ids=gateway_pb2.TokenIds(ids=_prompt(40)),
        sampling=common_pb2.SamplingParams(max_tokens=4, ignore_eos=True))
    with grpc.insecure_channel(chunked_agg_stack.grpc_address) as channel:
        responses = list(gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=60))
    compute = responses[-1].usage.compute_seconds
    assert compute.prefill > 0 and compute.decode > 0 and compute.transfer == 0


@pytest.mark.parametrize("stack_name", ["chunked_agg_stack", "disagg_stack"])
def test_a_stream_the_client_leaves_is_charged_what_it_used(stack_name, request):
    """A streamed request whose client goes away mid-answer never gets a last usage: the
    decode seconds it used still reach the tenant counter and the access log (before, only
    the seconds a finished stream reported counted, so a client that left paid nothing)."""
    stack = request.getfixturevalue(stack_name)
    workers = [w for w in (stack.prefill, stack.decode) if w is not None]
    request_id = f"left-{_RNG.getrandbits(48):x}"
    busy_before, tenant_before = _busy_seconds(*workers), _tenant_seconds(stack)
    body = {"model": MODEL_NAME, "prompt": _prompt(40), "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    chunks = 0
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=body,
                      headers={"x-request-id": request_id}, timeout=60) as response:
        for line in response.iter_lines():
            chunks += line.startswith("data: {")
            if chunks == 60:
                break  # leaves: the connection closes with the answer unfinished
    mine: list[dict] = []
    deadline = time.monotonic() + 10
    while not mine and time.monotonic() < deadline:
        mine = [json.loads(line) for line in list(stack.gateway.lines)
                if request_id in line and '"splitserve.access"' in line]
        time.sleep(0.05)
    assert len(mine) == 1 and mine[0]["outcome"] == "cancelled", stack.gateway.output()
    time.sleep(0.5)  # the worker's abort and its last step's histogram sample
    busy = _busy_seconds(*workers) - busy_before
    tenant = _tenant_seconds(stack)
    charged = {phase: tenant[phase] - tenant_before[phase] for phase in tenant}
    logged = mine[0]["compute_seconds"]
    assert logged["decode"] > 0 and logged["prefill"] > 0, logged
    assert all(abs(logged[p] - charged[p]) < 1e-4 for p in charged), (logged, charged)
    # What the worker ran after its last message (the abort lands between steps) is not
    # charged: a few steps of the dozens the stream ran.
    assert 0.7 * busy <= sum(charged.values()) <= busy * 1.005 + charged["transfer"], (
        charged, busy)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_seconds_a_bad_peer_reports_count_as_none(bad):
    pb = common_pb2.ComputeSeconds(prefill=bad, decode=0.25, transfer=bad)
    assert compute_from_pb(pb) == ComputeSeconds(decode=0.25)


def test_a_running_total_that_goes_down_adds_nothing():
    """The gateway charges what a worker's running total grew by; a phase a confused peer
    reports lower than before is no credit."""
    assert ComputeSeconds(1.0, 2.0, 3.0).since(ComputeSeconds(2.0, 1.5, 0.0)) == ComputeSeconds(
        0.0, 0.5, 3.0)
