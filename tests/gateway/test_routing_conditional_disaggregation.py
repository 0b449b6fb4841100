"""Conditional disaggregation with real workers: a prompt whose uncached part is short is
prefilled on the decode worker itself (same greedy output, the prefill worker untouched),
a longer one still goes to the prefill worker, and 0 turns it off."""

from __future__ import annotations

import httpx
import pytest
from gateway_processes import worker_stats

pytestmark = pytest.mark.timeout(180)


def complete(gateway, model: str, prompt: list[int]) -> str:
    response = httpx.post(f"http://{gateway.address}/v1/completions", timeout=60, json={
        "model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_short_uncached_prompts_are_prefilled_on_the_decode_worker(disagg_workers,
                                                                    gateway_factory,
                                                                    tiny_llama_dir):
    prefill, decode = disagg_workers  # shared with the other gateway tests of the session
    model = tiny_llama_dir.name
    flags = ("--prefill", prefill.address, "--decode", decode.address)
    local = gateway_factory(*flags, "--local-prefill-tokens", "40")
    strict = gateway_factory(*flags, "--local-prefill-tokens", "0")
    short = [7, 8, 9] * 10  # 30 tokens
    long = list(range(100, 160))  # 60 tokens

    def prefill_queries() -> int:
        return worker_stats(prefill.address, "prefill").prefix_queries

    before = prefill_queries()
    text = complete(local, model, short)
    assert prefill_queries() == before, "the short prompt went to the prefill worker"
    assert complete(strict, model, short) == text  # the same greedy output either way
    assert prefill_queries() > before
    before = prefill_queries()
    complete(local, model, long)
    assert prefill_queries() > before, "the long prompt did not go to the prefill worker"
