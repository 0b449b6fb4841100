"""Workers export vLLM-named metric families (names, `model_name` label, buckets) beside their
own, holding the same values: real worker processes serve requests over gRPC with KV moved over
gloo, and their /metrics pages are scraped and compared family by family."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from splitserve.v1 import decode_pb2, decode_pb2_grpc

from splitserve_cli.processes import start_worker
from tests.services.flows import aggregated, disaggregated, disaggregated_reusing, greedy

pytestmark = pytest.mark.timeout(150)

PROMPT_LEN, MAX_TOKENS, REQUESTS = 40, 8, 3
# (vLLM name, ours) of the per-request histograms; both are fed the same observations.
HISTOGRAMS = [
    ("vllm:time_to_first_token_seconds", "splitserve_worker_ttft_seconds"),
    ("vllm:inter_token_latency_seconds", "splitserve_worker_itl_seconds"),
    ("vllm:time_per_output_token_seconds", "splitserve_worker_itl_seconds"),
    ("vllm:e2e_request_latency_seconds", "splitserve_worker_e2e_latency_seconds"),
    ("vllm:request_queue_time_seconds", "splitserve_worker_queue_time_seconds"),
    ("vllm:iteration_tokens_total", "splitserve_worker_batched_tokens"),
]
COUNTERS = [
    ("vllm:prompt_tokens_total", "splitserve_worker_prompt_tokens_total"),
    ("vllm:generation_tokens_total", "splitserve_worker_generation_tokens_total"),
    ("vllm:prefix_cache_queries_total", "splitserve_prefix_cache_queries_tokens_total"),
    ("vllm:prefix_cache_hits_total", "splitserve_prefix_cache_hits_tokens_total"),
    ("vllm:num_preemptions_total", "splitserve_preemptions_total"),
]
GAUGES = [
    ("vllm:num_requests_running", "splitserve_worker_running_requests"),
    ("vllm:kv_cache_usage_perc", "splitserve_kv_usage_ratio"),
]


def samples(worker) -> list[tuple[str, dict[str, str], float]]:
    text = httpx.get(f"http://{worker.metrics_address}/metrics", timeout=5).text
    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(text)
            for s in family.samples]


def value(found, name: str, **labels: str) -> float:
    """The one sample of `name` whose labels include `labels`."""
    matches = [v for n, ls, v in found if n == name and labels.items() <= ls.items()]
    assert len(matches) == 1, (name, labels, matches)
    return matches[0]


def wait_for(worker, check, what: str, timeout: float = 10.0) -> list:
    import time

    deadline = time.monotonic() + timeout
    while True:
        found = samples(worker)
        if check(found):
            return found
        assert time.monotonic() < deadline, f"{worker.role}: {what}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def served(tiny_llama_dir):
    """A decode and a prefill worker after REQUESTS disaggregated requests and one request
    cancelled while it waited for its KV; a `both` worker with --no-vllm-metrics after one
    aggregated request."""
    workers = [start_worker(role, tiny_llama_dir, "--num-kv-blocks", "64", *extra)
               for role, extra in (("decode", ()), ("prefill", ()),
                                   ("both", ("--no-vllm-metrics",)))]
    decode, prefill, both = workers
    try:
        async def run() -> None:
            await asyncio.gather(*[
                disaggregated(decode.address, prefill.address, f"m{i}",
                              list(range(100 * i + 10, 100 * i + 10 + PROMPT_LEN)),
                              greedy(MAX_TOKENS)) for i in range(REQUESTS)])
            await aggregated(both.address, "agg", list(range(20, 60)), greedy(4))
            # Reserved on decode, never prefilled: the caller goes away while it waits.
            async with grpc.aio.insecure_channel(decode.address) as channel:
                stream = decode_pb2_grpc.DecodeStub(channel).Generate(decode_pb2.GenerateRequest(
                    request_id="left", prompt_token_ids=list(range(5, 25)),
                    sampling=greedy(4), remote_prefill=True))
                assert (await stream.read()).WhichOneof("kind") == "reserved"
                stream.cancel()

        asyncio.run(run())
        aborted = wait_for(decode, lambda f: value(f, "vllm:request_success_total",
                                                   finished_reason="abort") == 1,
                           "the cancelled request is not counted as abort")
        yield {"decode": aborted, "prefill": samples(prefill), "both": samples(both),
               "model": tiny_llama_dir.name}
    finally:
        for worker in workers:
            worker.kill()


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_vllm_families_carry_model_name_and_equal_ours(served, role) -> None:
    found, model = served[role], served["model"]
    ours = {"model": model, "role": role}
    vllm = {"model_name": model, "engine": "0"}
    for vllm_name, our_name in GAUGES + COUNTERS:
        assert value(found, vllm_name, **vllm) == value(found, our_name, **ours), vllm_name
    for vllm_name, our_name in HISTOGRAMS:
        for suffix in ("_count", "_sum"):
            assert value(found, vllm_name + suffix, **vllm) == pytest.approx(
                value(found, our_name + suffix, **ours)), vllm_name + suffix
    # Every vLLM sample is labelled with the served model.
    vllm_samples = [(n, ls) for n, ls, _ in found if n.startswith("vllm:")]
    assert vllm_samples and all(ls.get("model_name") == model for _, ls in vllm_samples)
    # waiting includes the requests waiting for remote KV, and for blocks to take it in, as
    # vLLM's waiting queue does.
    assert value(found, "vllm:num_requests_waiting", **vllm) == (
        value(found, "splitserve_worker_waiting_requests", **ours)
        + value(found, "splitserve_worker_waiting_for_kv_requests", **ours)
        + value(found, "splitserve_worker_waiting_for_blocks_requests", **ours))


def test_request_counts_follow_what_each_role_served(served) -> None:
    decode, prefill = served["decode"], served["prefill"]
    # The prefill worker ends each request at its first token; decode sends all of them.
    assert value(prefill, "vllm:time_to_first_token_seconds_count") == REQUESTS
    assert value(prefill, "vllm:prompt_tokens_total") == REQUESTS * PROMPT_LEN
    assert value(prefill, "vllm:generation_tokens_total") == REQUESTS
    assert value(prefill, "vllm:request_success_total", finished_reason="length") == REQUESTS
    assert value(prefill, "vllm:prefix_cache_queries_total") > 0
    assert value(decode, "vllm:time_to_first_token_seconds_count") == REQUESTS
    # The first token came with the KV from prefill; decode generated the rest.
    assert value(decode, "vllm:generation_tokens_total") == REQUESTS * (MAX_TOKENS - 1)
    assert value(decode, "vllm:prompt_tokens_total") == REQUESTS * PROMPT_LEN
    assert value(decode, "vllm:request_success_total", finished_reason="length") == REQUESTS
    assert value(decode, "vllm:request_success_total", finished_reason="stop") == 0
    assert value(decode, "vllm:e2e_request_latency_seconds_count") == REQUESTS
    assert value(decode, "vllm:request_queue_time_seconds_count") == REQUESTS
    gaps = value(decode, "vllm:inter_token_latency_seconds_count")
    assert 0 < gaps <= REQUESTS * (MAX_TOKENS - 2)
    assert value(decode, "vllm:num_requests_running") == 0
    assert value(decode, "vllm:kv_cache_usage_perc") == 0


def test_vllm_bucket_boundaries(served) -> None:
    found = served["decode"]

    def bounds(name: str) -> list[float]:
        return sorted(float(ls["le"]) for n, ls, _ in found if n == name + "_bucket")

    assert bounds("vllm:time_to_first_token_seconds")[-2:] == [2560.0, float("inf")]
    assert bounds("vllm:e2e_request_latency_seconds")[-2:] == [7680.0, float("inf")]
    assert bounds("vllm:request_queue_time_seconds")[0] == 0.3
    assert bounds("vllm:inter_token_latency_seconds")[-2:] == [80.0, float("inf")]


def test_no_vllm_metrics_flag_leaves_only_ours(served) -> None:
    found = served["both"]
    assert not [n for n, _, _ in found if n.startswith("vllm:")]
    assert value(found, "splitserve_worker_ttft_seconds_count") == 1
    assert value(found, "splitserve_worker_generation_tokens_total") == 4


@pytest.mark.parametrize("role", ["decode", "prefill", "both"])
def test_worker_series_carry_the_model_label(served, role) -> None:
    ours = [(n, ls) for n, ls, _ in served[role] if n.startswith("splitserve_")]
    assert "splitserve_worker_startup_seconds" in {n for n, _ in ours}
    assert len({n for n, _ in ours}) > 20
    assert [(n, ls) for n, ls in ours if ls.get("model") != served["model"]] == []


def test_prompt_tokens_by_source_tell_computed_from_transferred(served) -> None:
    """Disaggregated, a prompt counts on both workers (as in vLLM's P/D): by source, the
    prefill worker's are computed (or its cache's) and the decode worker's came by KV
    transfer, so `sum by (source)` separates them."""
    decode, prefill = served["decode"], served["prefill"]
    total = REQUESTS * PROMPT_LEN
    computed = value(prefill, "vllm:prompt_tokens_by_source_total", source="local_compute")
    hits = value(prefill, "vllm:prompt_tokens_by_source_total", source="local_cache_hit")
    assert computed + hits == total and computed > 0
    assert value(prefill, "vllm:prompt_tokens_by_source_total",
                 source="external_kv_transfer") == 0
    assert value(prefill, "vllm:prompt_tokens_cached_total") == hits
    transferred = value(decode, "vllm:prompt_tokens_by_source_total",
                        source="external_kv_transfer")
    assert transferred + value(decode, "vllm:prompt_tokens_by_source_total",
                               source="local_cache_hit") == total
    assert transferred > 0
    assert value(decode, "vllm:prompt_tokens_by_source_total", source="local_compute") == 0


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_per_request_phases_add_up_to_what_the_request_took(served, role) -> None:
    """vLLM's breakdown of each finished request: queue time then inference (prefill, then
    decode) make up its end-to-end time, and its sizes match the token counters."""
    found = served[role]

    def total(name: str) -> float:
        return value(found, name + "_sum")

    for name in ("prefill_time_seconds", "decode_time_seconds", "inference_time_seconds",
                 "time_per_output_token_seconds", "prompt_tokens", "generation_tokens",
                 "prefill_kv_computed_tokens"):
        assert value(found, f"vllm:request_{name}_count") == REQUESTS, name
    assert total("vllm:request_prefill_time_seconds") + total(
        "vllm:request_decode_time_seconds") == pytest.approx(
        total("vllm:request_inference_time_seconds"))
    assert total("vllm:request_queue_time_seconds") + total(
        "vllm:request_inference_time_seconds") == pytest.approx(
        total("vllm:e2e_request_latency_seconds"))
    assert total("vllm:request_prompt_tokens") == REQUESTS * PROMPT_LEN
    assert total("vllm:request_generation_tokens") == value(found, "vllm:generation_tokens_total")
    computed = value(found, "vllm:prompt_tokens_by_source_total", source="local_compute")
    assert total("vllm:request_prefill_kv_computed_tokens") == computed
    if role == "decode":  # every prompt's KV came from the prefill worker
        assert computed == 0
        # Each request generated MAX_TOKENS - 1 tokens here: decode time over the gaps.
        assert total("vllm:request_time_per_output_token_seconds") * (
            MAX_TOKENS - 2) == pytest.approx(total("vllm:request_decode_time_seconds"))
    else:  # one token each: no decode, and a time per output token of 0
        assert total("vllm:request_decode_time_seconds") == 0
        assert total("vllm:request_time_per_output_token_seconds") == 0
    # Token counts are bucketed 1, 2, 5, 10, ... up to the context length.
    bounds = sorted(float(ls["le"]) for n, ls, _ in found if n == "vllm:request_prompt_tokens_bucket")
    assert bounds[:4] == [1.0, 2.0, 5.0, 10.0] and bounds[-1] == float("inf")


def test_a_decode_workers_prompt_counts_held_blocks_as_hits_and_one_token_requests(
        tiny_llama_dir) -> None:
    """Two undercounts an observability audit found on a decode worker: the prompt blocks it
    held already (reused, not sent) were counted as transferred, and a request whose only
    token came from the prefill worker (max_tokens 1) never counted its prompt."""
    decode, prefill = (start_worker(role, tiny_llama_dir, "--num-kv-blocks", "64")
                       for role in ("decode", "prefill"))
    try:
        prompt = list(range(300, 300 + PROMPT_LEN))

        async def run():
            await disaggregated_reusing(decode.address, prefill.address, "first", prompt,
                                        greedy(MAX_TOKENS))
            _, reserved, _ = await disaggregated_reusing(decode.address, prefill.address,
                                                         "again", prompt, greedy(MAX_TOKENS))
            await disaggregated(decode.address, prefill.address, "one",
                                list(range(500, 500 + PROMPT_LEN)), greedy(1))
            return reserved.num_cached_tokens

        held = asyncio.run(run())
        assert held > 0, "the decode worker held none of the repeated prompt"
        found = wait_for(decode, lambda f: value(
            f, "vllm:request_success_total", finished_reason="length") == 3,
            "three requests served")
        assert value(found, "vllm:prompt_tokens_total") == 3 * PROMPT_LEN
        assert value(found, "vllm:prompt_tokens_by_source_total",
                     source="local_cache_hit") == held
        assert value(found, "vllm:prompt_tokens_by_source_total",
                     source="external_kv_transfer") == 3 * PROMPT_LEN - held
        assert value(found, "vllm:prompt_tokens_cached_total") == 3 * PROMPT_LEN
    finally:
        decode.kill()
        prefill.kill()
