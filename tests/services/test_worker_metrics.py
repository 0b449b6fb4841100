"""Each worker serves Prometheus metrics, liveness and readiness over HTTP; the series move
the right way as requests are served."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from splitserve_cli.processes import start_worker
from tests.metrics_text import scrape_worker as scrape
from tests.services.flows import disaggregated, greedy

pytestmark = pytest.mark.timeout(120)


def test_worker_metrics_follow_served_requests(tiny_llama_dir):
    decode = start_worker("decode", tiny_llama_dir, "--num-kv-blocks", "64")
    prefill = start_worker("prefill", tiny_llama_dir, "--num-kv-blocks", "64")
    try:
        for w in (decode, prefill):
            assert httpx.get(f"http://{w.metrics_address}/health").status_code == 200
            assert httpx.get(f"http://{w.metrics_address}/ready").status_code == 200
        before = scrape(decode)
        assert before['splitserve_kv_blocks_total{role="decode"}'] == 64

        async def run():
            await asyncio.gather(*[disaggregated(decode.address, prefill.address, f"m{i}",
                                                 list(range(100 * i + 10, 100 * i + 50)), greedy(8))
                                   for i in range(3)])

        asyncio.run(run())
        decode.wait_for(lambda h: h.stats.running == 0, what="idle")
        after = scrape(decode)
        assert after['splitserve_kv_transfers_total{role="decode"}'] == 3
        assert after['splitserve_kv_transfer_bytes_total{role="decode"}'] > 0
        # Every payload here is under kv_transfer's 2 MiB threshold for the shared region.
        assert after['splitserve_kv_transfer_shared_memory_bytes_total{role="decode"}'] == 0
        assert after['splitserve_kv_blocks_used{role="decode"}'] == 0
        assert after['splitserve_worker_step_seconds_count{role="decode"}'] > 0
        sent = scrape(prefill)
        assert sent['splitserve_kv_transfers_total{role="prefill"}'] == 3
        assert sent['splitserve_worker_computed_tokens_total{role="prefill"}'] == 3 * 40
    finally:
        decode.kill()
        prefill.kill()
