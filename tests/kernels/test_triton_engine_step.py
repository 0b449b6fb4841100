"""A tiny Llama (GQA 8/4, head_dim 8) through the engine with --attention-backend triton gives
the same greedy tokens and logprobs as the torch reference: chunked prompts over their cached
prefix, a prefix-cache hit, decode rows beside prefill chunks. The Triton path covers rotary
embedding with the cache write (kernels/triton/rotary_kv.py) and both attention kernels.

Without CUDA the kernels run under Triton's interpreter (conftest.py sets TRITON_INTERPRET,
which is what lets the triton backend run on a CPU device)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from engine.sampling_params import SamplingParams  # noqa: E402
from tests.engine.engine_harness import add_all, drive, make_engine, random_prompts  # noqa: E402


def run(model_dir, prompts, backend):
    # 8-token steps: the 13-token prompt is chunked, later chunks read their prefix from the
    # cache, and decode rows share steps with prompt chunks; prompt "c" repeats "a" (prefix hit)
    engine = make_engine(model_dir, max_num_batched_tokens=8, long_prefill_token_threshold=8,
                         cpu_attention="torch", attention_backend=backend)
    add_all(engine, prompts, SamplingParams(max_tokens=4, temperature=0.0, logprobs=2))
    return drive(engine)


def test_triton_attention_gives_the_reference_tokens(tiny_llama_dir):
    a, b = random_prompts([13, 5], seed=7)
    prompts = {"a": a, "b": b, "c": a + [9, 10]}
    reference = run(tiny_llama_dir, prompts, "torch")
    ours = run(tiny_llama_dir, prompts, "triton")
    assert ours["c"].num_cached_tokens > 0  # the prefix hit happened
    for rid, ref in reference.items():
        assert ours[rid].token_ids == ref.token_ids, rid
        for mine, theirs in zip(ours[rid].logprobs, ref.logprobs, strict=True):
            assert mine.top.keys() == theirs.top.keys(), rid
            err = max(abs(mine.top[t] - theirs.top[t]) for t in theirs.top)
            assert abs(mine.logprob - theirs.logprob) < 1e-4 and err < 1e-4, (rid, err)
