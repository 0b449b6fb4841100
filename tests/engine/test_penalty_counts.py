"""Penalties from per-request token counts kept incrementally: the same logits as counting the
whole history at every step (the former computation, kept here as the reference), each token
counted once, and an engine whose per-step penalty work stays flat as a generation grows."""

from __future__ import annotations

import random

import pytest
import torch
from engine_harness import hf_greedy, hf_model, make_engine, random_prompts
from torch.overrides import TorchFunctionMode

from engine.sampler import SamplingRow, _apply_penalties
from engine.sampling_params import SamplingParams
from engine.token_counts import TokenCounts

VOCAB = 50
SETTINGS = [
    dict(repetition_penalty=1.3),
    dict(presence_penalty=0.5, frequency_penalty=0.25),
    dict(repetition_penalty=0.8, presence_penalty=-0.4, frequency_penalty=1.5),
]


def _direct(logits: torch.Tensor, token_ids: list[int], num_prompt_tokens: int,
            params: SamplingParams) -> torch.Tensor:
    """Penalties counted from the whole history (what the sampler did at every step before)."""
    logits = logits.clone()
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(token_ids)), dtype=torch.long)
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / params.repetition_penalty,
                                   values * params.repetition_penalty)
    output = token_ids[num_prompt_tokens:]
    if output and (params.presence_penalty or params.frequency_penalty):
        ids = torch.tensor(output, dtype=torch.long)
        counts = torch.zeros_like(logits).index_add_(0, ids, torch.ones_like(ids, dtype=logits.dtype))
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    return logits


@pytest.mark.parametrize("settings", SETTINGS)
@pytest.mark.parametrize("seed", range(3))
def test_incremental_penalties_equal_counting_the_whole_history(settings, seed):
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    params = SamplingParams(**settings)
    prompt = [rng.randrange(VOCAB // 2) for _ in range(rng.randrange(1, 30))]
    token_ids, counts = list(prompt), TokenCounts()
    for _ in range(60):
        logits = torch.randn(VOCAB, generator=generator) * 3
        # Some steps verify speculative proposals: counted for that row only.
        pending = [rng.randrange(VOCAB) for _ in range(rng.choice([0, 0, 1, 3]))]
        ours = logits.clone()
        _apply_penalties(ours, SamplingRow(params, seed, len(token_ids) + len(pending), token_ids,
                                           len(prompt), counts=counts, pending_token_ids=pending))
        assert torch.equal(ours, _direct(logits, token_ids + pending, len(prompt), params))
        # Each token counted once, the prompt included; the proposals were not kept.
        assert counts.num_counted == counts.tokens_counted == len(token_ids)
        # Up to three tokens accepted per step (a verified run), skewed to repeat.
        token_ids.extend(rng.choice([rng.randrange(VOCAB), token_ids[-1]])
                         for _ in range(rng.randint(1, 3)))


def test_each_token_is_counted_once():
    counts = TokenCounts()
    token_ids = [3, 3, 7]  # the prompt
    for step in range(100):
        counts.update(token_ids, 3, VOCAB, torch.device("cpu"))
        assert counts.num_counted == counts.tokens_counted == len(token_ids)
        token_ids.append(step % VOCAB)
    assert counts.seen[[3, 7]].all() and counts.output[[3, 7]].tolist() == [2.0, 2.0]  # prompt not in output
    assert counts.output.sum() == 100 - 1  # the last appended token is not counted yet


def test_a_state_that_no_longer_matches_is_rebuilt():
    counts = TokenCounts()
    counts.update([1, 2, 3, 4], 2, VOCAB, torch.device("cpu"))
    counts.update([9], 1, VOCAB, torch.device("cpu"))  # shorter: not the same list any more
    assert counts.seen.nonzero().flatten().tolist() == [9] and counts.output.sum() == 0
    counts.update([9, 5], 1, 20, torch.device("cpu"))  # another vocabulary (a draft model's)
    assert counts.seen.shape == (20,) and counts.output.nonzero().flatten().tolist() == [5]


def test_tokens_outside_a_smaller_draft_vocabulary_are_not_penalised():
    """A draft may have a prefix of the target's vocabulary: the request's history can hold
    ids it has no logit for. Counting them raised IndexError in the engine loop."""
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5)
    history = [3, 45, 7, 49, 3]  # prompt [3, 45], output [7, 49, 3]; 45 and 49 beyond 40
    logits = torch.ones(40)
    _apply_penalties(logits, SamplingRow(params, 0, 6, history, 2, counts=TokenCounts(),
                                         pending_token_ids=[47, 7]))
    expected = torch.ones(40)
    expected[3], expected[7] = 0.5 - 0.5, 0.5 - 1.0  # seen; output once and twice
    assert torch.equal(logits, expected)


class _TokenIdsFromPython(TorchFunctionMode):
    """Adds up the elements of every integer tensor built from Python data (`torch.tensor`,
    `torch.as_tensor`): token-id lists turned into index tensors are the per-step work that
    grew with the history."""

    def __init__(self) -> None:
        super().__init__()
        self.elements = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func in (torch.tensor, torch.as_tensor) and not result.is_floating_point():
            self.elements += result.numel()
        return result


class _RecordingSampler:
    def __init__(self, sampler) -> None:
        self.sampler = sampler
        self.per_call: list[int] = []

    def __call__(self, logits, rows):
        with _TokenIdsFromPython() as mode:
            result = self.sampler(logits, rows)
        self.per_call.append(mode.elements)
        return result


def test_the_engine_penalty_work_per_step_does_not_grow_with_the_generation(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    recorder = _RecordingSampler(engine.runner.sampler)
    engine.runner.sampler = recorder
    params = SamplingParams(max_tokens=40, temperature=0.0, repetition_penalty=1.2,
                            frequency_penalty=0.3, ignore_eos=True)
    prompt = random_prompts([20], seed=41)[0]
    engine.add_request("r", prompt, params)
    counted = []  # (tokens counted, tokens held) by the runner's state after each step
    tokens = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
        state = engine.runner.requests.get("r")
        counts = getattr(state, "penalty_counts", None)
        if counts is not None:
            counted.append((counts.tokens_counted, len(state.token_ids)))
    assert len(recorder.per_call) == 40
    # The first call counts the prompt; every later one only the token the step before added.
    decode = recorder.per_call[1:]
    assert max(decode) == min(decode), recorder.per_call
    # Every token counted once; the one sampled last is counted at the next step.
    assert counted and all(n == held - 1 for n, held in counted), counted
    # The same text as transformers' greedy generate with the penalties counted from scratch.
    assert tokens == _hf_greedy_with_direct_penalties(tiny_llama_dir, prompt, params)
    plain, _ = hf_greedy(str(tiny_llama_dir), tuple(prompt), params.max_tokens)
    assert tokens[: len(plain)] != plain, "the penalties must have changed the text"


class _DirectPenalties:
    """A transformers logits processor applying `_direct` to each row's whole history."""

    def __init__(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        self.num_prompt_tokens, self.params = num_prompt_tokens, params

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return torch.stack([_direct(row.float(), ids.tolist(), self.num_prompt_tokens, self.params)
                            for ids, row in zip(input_ids, scores, strict=True)])


def _hf_greedy_with_direct_penalties(model_dir, prompt: list[int], params: SamplingParams) -> list[int]:
    from transformers import LogitsProcessorList

    model = hf_model(str(model_dir))
    input_ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            # min_new_tokens only keeps generate from stopping early (the engine ignores EOS);
            # were EOS the engine's choice anywhere, the texts would differ and the test fail.
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=params.max_tokens,
            min_new_tokens=params.max_tokens, do_sample=False, temperature=None, top_p=None,
            top_k=None, logits_processor=LogitsProcessorList([_DirectPenalties(len(prompt), params)]),
        )
    return out[0, len(prompt):].tolist()
