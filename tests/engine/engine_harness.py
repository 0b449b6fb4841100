"""Helpers for engine tests: small engines, a step loop that keeps every output, and the
transformers reference (greedy `generate`, log_softmax) with the parity rule of DESIGN.md."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import Logprobs, RequestOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerConfig

# Logprobs of the same float32 model computed by two implementations (different batching,
# different summation order) agree to about 1e-6 on the tiny models; 1e-4 leaves room for
# BLAS differences between machines while still catching any real numerical bug.
LOGPROB_ATOL = 1e-4
# A greedy divergence on a real model counts as a near-tie only when transformers' own float32
# logprobs of the two tokens differ by less than this (issue 17; "each in the other's top 5"
# admitted gaps of whole nats). tests/engine/test_bf16_parity.py states the bfloat16 bound.
NEAR_TIE_NATS = 0.05


def make_engine(
    model_dir: Path,
    *,
    block_size: int = 4,
    num_kv_blocks: int = 256,
    max_num_batched_tokens: int = 2048,
    long_prefill_token_threshold: int | None = None,
    max_num_seqs: int = 128,
    enable_chunked_prefill: bool = True,
    itl_target_s: float = 0.0,
    device: str = "cpu",
    dtype: str = "float32",
    **config,
) -> LLMEngine:
    """A float32 CPU engine (unless told otherwise) with an explicit (small) KV cache. A test
    that names long_prefill_token_threshold gets its chunks in every step, decoding or not."""
    scheduler = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        long_prefill_token_threshold=long_prefill_token_threshold or 512,
        chunk_prompts_alone=long_prefill_token_threshold is not None,
        enable_chunked_prefill=enable_chunked_prefill,
        itl_target_s=itl_target_s,
    )
    return LLMEngine(
        EngineConfig(
            model=str(model_dir), dtype=dtype, device=device, block_size=block_size,
            num_kv_blocks=num_kv_blocks, scheduler=scheduler, **config,
        )
    )


@dataclass
class Collected:
    """Everything the engine streamed for one request, concatenated."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprobs] = field(default_factory=list)
    prompt_logprobs: list[Logprobs | None] | None = None
    prompt_logprobs_deliveries: int = 0
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    kv: torch.Tensor | None = None
    outputs: list[RequestOutput] = field(default_factory=list)


def drive(engine: LLMEngine, max_steps: int = 5000) -> dict[str, Collected]:
    """Step until nothing is unfinished; returns what each request produced."""
    collected: dict[str, Collected] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return collected
        for out in engine.step():
            absorb(collected, out)
    raise AssertionError(f"engine did not finish in {max_steps} steps: {engine.stats()}")


def absorb(collected: dict[str, Collected], out: RequestOutput) -> None:
    entry = collected.setdefault(out.request_id, Collected())
    entry.outputs.append(out)
    entry.token_ids.extend(out.new_token_ids)
    entry.logprobs.extend(out.new_logprobs)
    if out.prompt_logprobs is not None:
        entry.prompt_logprobs = out.prompt_logprobs
        entry.prompt_logprobs_deliveries += 1
    if out.kv is not None:
        entry.kv = out.kv
    if out.finished:
        entry.finish_reason = out.finish_reason
        entry.num_cached_tokens = out.num_cached_tokens


def add_all(engine: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams) -> None:
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)


def assert_no_leak(engine: LLMEngine) -> None:
    """After every request has finished or been aborted, every KV block is free."""
    pool = engine.kv.pool
    assert pool.num_free_blocks == pool.num_blocks, engine.stats()
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    assert engine.kv._req_blocks == {}
    assert not engine.has_unfinished()
    assert engine.scheduler.requests == {} and engine._held == {}


def random_prompts(lengths: list[int], seed: int, vocab: int = 768, low: int = 3) -> list[list[int]]:
    """Token ids above the tiny models' special tokens (0-2), so prompts hold no EOS."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(low, vocab, (n,), generator=generator).tolist() for n in lengths]


# -- transformers reference -----------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def generate_greedy(model, prompt: tuple[int, ...], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers `generate` on `model` (greedy, stops at EOS like the engine): tokens and the
    log_softmax of the logits at every generated position, [n, vocab], in float32."""
    input_ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
            do_sample=False, temperature=None, top_p=None, top_k=None,
            output_logits=True, return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = torch.stack([step[0] for step in out.logits]).float().log_softmax(-1)
    return tokens, logprobs


@functools.lru_cache(maxsize=256)
def hf_greedy(model_dir: str, prompt: tuple[int, ...], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """generate_greedy on the checkpoint as loaded by hf_model."""
    return generate_greedy(hf_model(model_dir), prompt, max_new_tokens)


@functools.lru_cache(maxsize=64)
def hf_prompt_logprobs(model_dir: str, prompt: tuple[int, ...]) -> torch.Tensor:
    """log_softmax of one forward over the prompt: row i scores token i + 1."""
    model = hf_model(model_dir)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0]
    return logits.float().log_softmax(-1)


def assert_logprobs_close(ours: Logprobs, ref_row: torch.Tensor, token: int, atol: float) -> None:
    assert abs(ours.logprob - float(ref_row[token])) <= atol, (ours.logprob, float(ref_row[token]))
    for alt, value in ours.top.items():
        assert abs(value - float(ref_row[alt])) <= atol, (alt, value, float(ref_row[alt]))
    if ours.top:
        ref_top = set(ref_row.topk(len(ours.top)).indices.tolist())
        # Same set, unless the n-th and (n+1)-th are a float tie.
        assert set(ours.top) == ref_top or len(set(ours.top) ^ ref_top) == 2


def assert_greedy_parity(
    model_dir: Path,
    prompt: list[int],
    ours: Collected,
    max_new_tokens: int,
    *,
    real_model: bool = False,
    atol: float = LOGPROB_ATOL,
) -> int:
    """Token-for-token equality with transformers' greedy `generate`, and logprobs within
    `atol` of its log_softmax. On a real model a divergence is accepted only as a genuine
    near-tie (transformers' logprobs of the two tokens within NEAR_TIE_NATS), and the
    comparison stops there.
    Returns the number of tokens compared."""
    ref_tokens, ref_logprobs = hf_greedy(str(model_dir), tuple(prompt), max_new_tokens)
    assert len(ours.logprobs) == len(ours.token_ids), "ask for logprobs=5 to compare"
    for i, (mine, theirs) in enumerate(zip(ours.token_ids, ref_tokens, strict=False)):
        if mine != theirs:
            assert real_model, (
                f"position {i}: engine {mine}, transformers {theirs}\n"
                f"engine:       {ours.token_ids}\ntransformers: {ref_tokens}"
            )
            gap = float(ref_logprobs[i][theirs] - ref_logprobs[i][mine])
            assert gap < NEAR_TIE_NATS, (
                f"position {i}: engine {mine} vs transformers {theirs} is not a near-tie: "
                f"transformers' logprobs differ by {gap:.4f} nats (bound {NEAR_TIE_NATS})"
            )
            return i
        assert_logprobs_close(ours.logprobs[i], ref_logprobs[i], mine, atol)
        assert ours.logprobs[i].rank == 1
    assert ours.token_ids == ref_tokens
    return len(ref_tokens)


SMOL_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
]


def smollm2_chat_prompts(model_dir) -> dict[str, list[int]]:
    """SMOL_QUESTIONS as SmolLM2 chat prompts (token ids), keyed q0, q1, ..."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return {f"q{i}": tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                return_dict=False)
            for i, q in enumerate(SMOL_QUESTIONS)}


def parse_worker_flags(model_dir, *argv: str, role: str = "decode"):
    """The WorkerConfig a worker of `role` builds from these command-line flags."""
    import argparse

    from services.common.worker_cli import add_worker_arguments, worker_config_from_args

    parser = argparse.ArgumentParser()
    add_worker_arguments(parser, role=role)
    return worker_config_from_args(parser.parse_args(["--model", str(model_dir), *argv]), role)
