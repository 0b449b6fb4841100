"""Speculative decoding on a decode worker: the flags become the engine's configuration (with
errors an operator can act on), and a speculating decode worker behind a plain prefill worker
streams the same greedy tokens as a plain engine while its metrics count the proposals."""

from __future__ import annotations

import argparse
import asyncio

import pytest
from engine_harness import drive, make_engine

from engine.sampling_params import SamplingParams
from services.common.worker_cli import add_worker_arguments, worker_config_from_args
from tests.metrics_text import scrape_worker


def _config(model_dir, *flags: str, role: str = "decode"):
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser, role)
    return worker_config_from_args(parser.parse_args(["--model", str(model_dir), *flags]), role)


def test_flags_configure_speculation_on_decode_workers(tiny_llama_dir):
    config = _config(tiny_llama_dir, "--speculative-method", "draft", "--draft-model",
                     str(tiny_llama_dir), "--num-speculative-tokens", "6",
                     "--speculative-max-batch-size", "24")
    spec = config.engine_config().speculative
    assert (spec.method, spec.num_speculative_tokens, spec.draft_model, spec.max_batch_size) == (
        "draft", 6, str(tiny_llama_dir), 24)
    assert _config(tiny_llama_dir).engine_config().speculative.enabled is False
    ngram = _config(tiny_llama_dir, "--speculative-method", "ngram", role="both")
    assert ngram.engine_config().speculative.method == "ngram"
    # A prefill worker never decodes past the first token: the flag is harmless there.
    prefill = _config(tiny_llama_dir, "--speculative-method", "ngram", role="prefill")
    assert prefill.engine_config().speculative.enabled is False


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--speculative-method", "eagle"], "--speculative-method 'eagle' is not one of ngram, draft"),
        (["--speculative-method", "draft"], "--speculative-method draft needs --draft-model DIR"),
        (["--speculative-method", "ngram", "--draft-model", "x"], "--draft-model is used only with"),
        (["--speculative-method", "draft", "--draft-model", "/nope"], "is not a model folder"),
        (["--speculative-method", "ngram", "--num-speculative-tokens", "0"], r"must be in \[1, 16\]"),
        (["--speculative-max-batch-size", "-1"], "--speculative-max-batch-size must be >= 0"),
    ],
)
def test_bad_flags_stop_the_worker_with_a_clear_message(tiny_llama_dir, flags, message):
    with pytest.raises(SystemExit, match=message):
        _config(tiny_llama_dir, *flags)


def test_speculating_decode_worker_streams_the_plain_engines_tokens(tiny_llama_dir):
    from splitserve_cli.processes import start_worker
    from tests.services.flows import aggregated, disaggregated, greedy

    prompts = {f"w{i}": list(range(40 * i + 10, 40 * i + 10 + 7 * (i + 1))) for i in range(3)}
    reference = make_engine(tiny_llama_dir, block_size=16)
    for rid, prompt in prompts.items():
        reference.add_request(rid, prompt, SamplingParams(max_tokens=20, temperature=0.0,
                                                          ignore_eos=True))
    expected = {rid: c.token_ids for rid, c in drive(reference).items()}
    # The draft is the target itself: every proposal is accepted, so the counters are exact.
    decode = start_worker("decode", tiny_llama_dir, "--num-kv-blocks", "64",
                          "--speculative-method", "draft", "--draft-model", str(tiny_llama_dir),
                          "--num-speculative-tokens", "3", "--speculative-max-batch-size", "8")
    prefill = start_worker("prefill", tiny_llama_dir, "--num-kv-blocks", "64")
    try:
        async def run():
            remote = [disaggregated(decode.address, prefill.address, rid, prompt, greedy(20))
                      for rid, prompt in list(prompts.items())[:2]]
            local = aggregated(decode.address, "w2", prompts["w2"],
                               greedy(20, disable_speculation=True))
            return await asyncio.gather(*remote, local)

        outputs = asyncio.run(run())
        assert dict(zip(prompts, outputs, strict=True)) == expected
        decode.wait_for(lambda h: h.stats.running == 0, what="idle")
        metrics = scrape_worker(decode)
        proposed = metrics['splitserve_spec_proposed_tokens_total{role="decode"}']
        accepted = metrics['splitserve_spec_accepted_tokens_total{role="decode"}']
        # The worker's gate measures whether speculation pays (some steps go without), but
        # every proposal it made was accepted.
        assert accepted == proposed > 0
        assert metrics['splitserve_kv_blocks_used{role="decode"}'] == 0
    finally:
        decode.kill()
        prefill.kill()
