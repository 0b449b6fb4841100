"""Per-request opt-out of speculative decoding through the OpenAI API (`disable_speculation`,
a splitserve extension sent like `ignore_eos`): same text, and the speculating worker makes no
proposals for it."""

from __future__ import annotations

from gateway_processes import openai_client, start_gateway

from splitserve_cli.processes import start_worker
from tests.metrics_text import scrape_worker

PROPOSED = 'splitserve_spec_proposed_tokens_total{role="both"}'


def test_a_request_can_opt_out_of_speculation_and_keeps_its_text(tiny_llama_dir):
    # The draft is the target itself, so a speculating request has its proposals accepted.
    worker = start_worker("both", tiny_llama_dir, "--num-kv-blocks", "64",
                          "--speculative-method", "draft", "--draft-model", str(tiny_llama_dir),
                          "--num-speculative-tokens", "3")
    gateway = start_gateway(tiny_llama_dir, "--worker", worker.address)
    try:
        client = openai_client(f"http://{gateway.address}")
        request = {"model": tiny_llama_dir.name, "prompt": "a b c d e f", "max_tokens": 16,
                   "temperature": 0}

        def complete(**extra) -> str:
            choice = client.completions.create(**request, extra_body={"ignore_eos": True, **extra})
            return choice.choices[0].text

        speculated = complete()
        before = scrape_worker(worker).get(PROPOSED, 0.0)
        assert before > 0, "the worker did not speculate at all: the test proves nothing"
        plain = complete(disable_speculation=True)
        assert plain == speculated
        assert scrape_worker(worker).get(PROPOSED, 0.0) == before
    finally:
        gateway.stop()
        worker.kill()
