"""The path users run held to transformers: `--dtype auto` (bfloat16 on this CPU) with every C++
kernel on (fused decode, small-M linear, AVX-512 head_dim-64 decode attention, prefill
attention), greedy, against transformers in bfloat16, on SmolLM2 and on tiny random head_dim-64
models (a Llama, and a Mistral whose sliding window is shorter than the context).

Divergence rule in bfloat16: tokens must be equal until the first mismatch, which counts as a
near-tie only when transformers' own logprobs of the two tokens differ by less than
BF16_NEAR_TIE_NATS; the comparison of that sequence stops there. Float32 parity
(engine_harness.NEAR_TIE_NATS, 0.05 nats) is the exact one; this one is wider because a bf16
logit between 16 and 32 (SmolLM2's top logits) moves in steps of 0.125.
"""

from __future__ import annotations

import functools

import pytest
import torch
from engine_harness import (
    Collected,
    add_all,
    assert_no_leak,
    drive,
    generate_greedy,
    random_prompts,
    smollm2_chat_prompts,
)
from kernel_build import require_cpu_kernels
from tiny_mistral import build_tiny_mistral

from engine.config import EngineConfig, cpu_has_fast_bf16
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerConfig
from kernels.linear import small_m_linear_available

# Two bf16 steps of a logit in [16, 32): SmolLM2's divergences here sat at exactly one step.
BF16_NEAR_TIE_NATS = 0.25
# Logprobs of compared tokens: three such steps (the largest difference seen was 0.248, on
# SmolLM2, where 30 layers of bf16 rounding in another order than transformers add up).
BF16_LOGPROB_ATOL = 0.375

pytestmark = require_cpu_kernels(
    cpu_has_fast_bf16() and small_m_linear_available(),
    "dtype auto is float32 on this CPU (no native bf16 dot products)",
)

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, logprobs=5)


@functools.lru_cache(maxsize=4)
def _hf_bf16(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()


@functools.lru_cache(maxsize=64)
def hf_bf16_greedy(model_dir: str, prompt: tuple[int, ...], max_new_tokens: int):
    """transformers `generate` in bfloat16 (greedy, stops at EOS): tokens, [n, vocab] logprobs."""
    return generate_greedy(_hf_bf16(model_dir), prompt, max_new_tokens)


def assert_bf16_parity(model_dir, prompt: list[int], ours: Collected, max_new_tokens: int) -> int:
    """The rule of the module docstring; returns the number of tokens compared."""
    ref_tokens, ref_logprobs = hf_bf16_greedy(str(model_dir), tuple(prompt), max_new_tokens)
    for i, (mine, theirs) in enumerate(zip(ours.token_ids, ref_tokens, strict=False)):
        if mine != theirs:
            gap = float(ref_logprobs[i][theirs] - ref_logprobs[i][mine])
            assert gap < BF16_NEAR_TIE_NATS, (
                f"position {i}: engine {mine}, transformers {theirs}: their bf16 logprobs differ "
                f"by {gap:.3f} nats (bound {BF16_NEAR_TIE_NATS})\nengine:       {ours.token_ids}\n"
                f"transformers: {ref_tokens}"
            )
            return i
        ref = float(ref_logprobs[i][mine])
        assert abs(ours.logprobs[i].logprob - ref) <= BF16_LOGPROB_ATOL, (i, ours.logprobs[i].logprob, ref)
    assert ours.token_ids == ref_tokens
    return len(ref_tokens)


def shipped_engine(model_dir, **scheduler) -> LLMEngine:
    """The defaults `splitserve` serves with (dtype, kernels: auto), a small explicit cache."""
    engine = LLMEngine(EngineConfig(
        model=str(model_dir), device="cpu", block_size=16, num_kv_blocks=64,
        scheduler=SchedulerConfig(**scheduler),
    ))
    runner = engine.runner
    assert runner.dtype == torch.bfloat16
    # The prefill attention (C++ or torch's SDPA) and the small-M rows are measured at start.
    assert runner.native_decode and runner.small_m_linear
    assert runner.fused_decode
    return engine


def _check(model_dir, prompts, results, max_new_tokens) -> int:
    return sum(assert_bf16_parity(model_dir, prompts[rid], results[rid], max_new_tokens)
               for rid in prompts)


@pytest.fixture(scope="module")
def tiny_d64_llama_dir(tmp_path_factory):
    from splitserve_cli.tiny_model import build_tiny_model

    # SmolLM2's attention shape (head_dim 64, three query heads per KV head), two layers.
    return build_tiny_model(tmp_path_factory.mktemp("tiny-d64"), arch="llama", seed=0,
                            hidden_size=192, intermediate_size=384, num_attention_heads=6,
                            num_key_value_heads=2, head_dim=64)


@pytest.fixture(scope="module")
def tiny_d64_mistral_dir(tmp_path_factory):
    return build_tiny_mistral(tmp_path_factory.mktemp("tiny-d64-mistral"), window=24, head_dim=64,
                              heads=6, kv_heads=2, hidden_size=192, intermediate_size=384)


@pytest.mark.parametrize("model", ["llama", "mistral-window-24"])
def test_tiny_head_dim_64_bf16_matches_transformers_bf16(model, tiny_d64_llama_dir, tiny_d64_mistral_dir):
    model_dir = {"llama": tiny_d64_llama_dir, "mistral-window-24": tiny_d64_mistral_dir}[model]
    lengths = [1, 17, 45, 70, 130]  # the longest spans three 64-key chunks of the prefill kernel
    prompts = {f"p{n}": p for n, p in zip(lengths, random_prompts(lengths, seed=3), strict=True)}
    engine = shipped_engine(model_dir)
    add_all(engine, prompts, GREEDY)
    compared = _check(model_dir, prompts, drive(engine), GREEDY.max_tokens)
    assert compared >= len(prompts) * GREEDY.max_tokens * 3 // 4
    assert_no_leak(engine)


SMOL_TOKENS = 32


@pytest.mark.slow
def test_smollm2_bf16_matches_transformers_bf16(smollm2_dir):
    prompts = smollm2_chat_prompts(smollm2_dir)
    engine = shipped_engine(smollm2_dir)
    params = SamplingParams(max_tokens=SMOL_TOKENS, temperature=0.0, logprobs=5)
    add_all(engine, prompts, params)
    compared = _check(smollm2_dir, prompts, drive(engine), SMOL_TOKENS)
    # Tokens before a one-step (0.125 nat) near-tie, which moves with the kernels' summation
    # order: 8 (EOS), 32 and 20 with the earlier decode attention; with the bf16-dot one, 8, 17
    # and 32 with the C++ prefill attention, 8, 17 and 20 with SDPA (which the start-up
    # measurement picks on some hosts). At least 40 of the 3 x 32 keeps the check's power.
    assert compared >= 40
    assert_no_leak(engine)
