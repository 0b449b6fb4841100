"""Speculative decoding parts in isolation: the n-gram proposer's lookups, adaptive k, the
batch-size gate, configuration errors, and the draft model's tokenizer check."""

from __future__ import annotations

import pytest

from engine.config import ModelConfig
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.draft import check_same_tokenizer
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.policy import MIN_ACCEPT_CHANCE, PROBE_EVERY, AdaptiveK, BatchGate


def _request(tokens: list[int], rid: str = "r", num_prompt: int | None = None) -> Request:
    prompt = tokens[: num_prompt or len(tokens)]
    request = Request(rid, prompt, SamplingParams(max_tokens=100))
    request.all_token_ids.extend(tokens[len(prompt) :])
    return request


# -- n-gram -----------------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_latest_match_of_the_longest_suffix():
    proposer = NgramProposer(ngram_min=1, ngram_max=3)
    #        0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [5, 6, 7, 8, 9, 6, 7, 1, 2, 5, 6, 7]
    # Suffix [5, 6, 7] occurred at 0..2, followed by 8, 9, 6, 7; the 2-gram [6, 7] also
    # occurred later (5..6, followed by 1, 2), but the longest match wins.
    got = proposer.propose([_request(tokens)], {"r": 4})
    assert got.token_ids == {"r": [8, 9, 6, 7]}
    # Only [6, 7] matches now: its latest earlier occurrence is 5..6.
    got = proposer.propose([_request([3, 6, 7, 1, 2, 4, 6, 7, 9, 9, 6, 7], rid="s")], {"s": 3})
    assert got.token_ids == {"s": [9, 9, 6]}


def test_ngram_index_follows_appended_tokens_and_never_matches_the_suffix_itself():
    proposer = NgramProposer(ngram_min=2, ngram_max=2)
    request = _request([1, 2, 3, 4])
    assert proposer.propose([request], {"r": 2}).token_ids == {}  # [3, 4] seen only as suffix
    request.all_token_ids.extend([1, 2])  # output copies the prompt's start
    assert proposer.propose([request], {"r": 2}).token_ids == {"r": [3, 4]}
    request.all_token_ids.extend([3, 9, 3])  # the suffix [9, 3] was never seen before
    assert proposer.propose([request], {"r": 2}).token_ids == {}
    request.all_token_ids.append(4)  # [3, 4] again: latest earlier occurrence is 2..3
    assert proposer.propose([request], {"r": 5}).token_ids == {"r": [1, 2, 3, 9, 3]}


def test_ngram_proposal_is_cut_at_the_end_of_the_history_and_to_k():
    proposer = NgramProposer(ngram_min=1, ngram_max=2)
    request = _request([7, 8, 7, 8, 7])
    # [8, 7] last seen at 1..2, followed by [8, 7] (the end of the sequence).
    assert proposer.propose([request], {"r": 5}).token_ids == {"r": [8, 7]}
    assert proposer.propose([request], {"r": 1}).token_ids == {"r": [8]}
    assert proposer.propose([request], {"r": 0}).token_ids == {}


def test_ngram_forgets_released_and_unretained_requests():
    proposer = NgramProposer(ngram_min=1, ngram_max=2)
    a, b = _request([1, 2, 1], rid="a"), _request([3, 4, 3], rid="b")
    proposer.propose([a, b], {"a": 1, "b": 1})
    assert set(proposer._indexes) == {"a", "b"}
    proposer.release(["a"])
    proposer.retain({"a"})
    assert proposer._indexes == {}


# -- adaptive k -------------------------------------------------------------------------------


def test_adaptive_k_starts_at_the_cap_and_follows_acceptance():
    policy = AdaptiveK(k_max=5)
    assert policy.num_tokens("r") == 5
    for _ in range(20):
        policy.record("r", 5, 5)  # everything accepted
    assert policy.num_tokens("r") == 5
    for _ in range(20):
        policy.record("r", 4, 1)  # one of four, then a rejection: rate about 1/2
    assert policy.num_tokens("r") == 2
    for _ in range(20):
        policy.record("r", 2, 0)
    assert policy.num_tokens("r") == 0


def test_adaptive_k_probes_a_request_it_stopped_speculating_for():
    policy = AdaptiveK(k_max=4)
    for _ in range(30):
        policy.record("r", 1, 0)
    ks = [policy.num_tokens("r") for _ in range(2 * PROBE_EVERY)]
    assert ks.count(1) == 2 and ks.count(0) == 2 * PROBE_EVERY - 2
    # A request that starts copying earns k back.
    for _ in range(30):
        policy.record("r", 1, 1)
    assert policy.num_tokens("r") == 4


def test_adaptive_k_rule_keeps_tokens_whose_acceptance_chance_is_worth_it():
    policy = AdaptiveK(k_max=16)
    for _ in range(50):
        policy.record("r", 16, 7)  # rate = 7 / 8 per token
    k = policy.num_tokens("r")
    rate = 7 / 8
    assert rate**k >= MIN_ACCEPT_CHANCE > rate ** (k + 1)


def test_fixed_k_ignores_acceptance():
    policy = AdaptiveK(k_max=3, adaptive=False)
    for _ in range(10):
        policy.record("r", 3, 0)
    assert policy.num_tokens("r") == 3


# -- batch gate -------------------------------------------------------------------------------


def test_gate_turns_speculation_off_above_the_fixed_batch_limit():
    gate = BatchGate(max_batch_size=8, adaptive=False)
    assert gate.allow(1) and gate.allow(8)
    assert not gate.allow(9) and not gate.allow(0)


def _run_gate(gate: BatchGate, n: int, rate_on: float, rate_off: float, steps: int,
              load=lambda step: 1.0, noise: float = 0.0, seed: int = 0) -> list[bool]:
    """Feed the gate steps whose tokens/s is the mode's rate times the machine's `load` at
    that step, times a random factor within +-noise."""
    import random

    rng = random.Random(seed)
    choices = []
    for step in range(steps):
        on = gate.allow(n)
        choices.append(on)
        rate = (rate_on if on else rate_off) * load(step) * (1 + rng.uniform(-noise, noise))
        gate.observe(n, on, num_tokens=n, seconds=n / rate)
    return choices


def test_gate_keeps_speculation_where_it_measures_faster():
    gate = BatchGate(explore_every=16)
    choices = _run_gate(gate, 1, rate_on=50.0, rate_off=30.0, steps=200)
    assert sum(choices[20:]) / len(choices[20:]) > 0.9
    assert gate.snapshot()["1+"] == pytest.approx(50 / 30, rel=0.01)


def test_gate_steps_down_in_the_batch_range_where_speculation_is_slower():
    gate = BatchGate(explore_every=16)
    small = _run_gate(gate, 2, rate_on=50.0, rate_off=30.0, steps=100)
    large = _run_gate(gate, 32, rate_on=300.0, rate_off=400.0, steps=100)
    assert sum(small[20:]) / 80 > 0.9
    # Off in the large range, but still trying speculation now and then.
    assert 0 < sum(large[20:]) / 80 < 0.15
    # 3 decoding requests share 2's range (2-3), where speculation pays.
    assert gate.allow(3)


def test_gate_notices_when_speculation_starts_to_pay():
    gate = BatchGate(explore_every=8)
    _run_gate(gate, 4, rate_on=20.0, rate_off=40.0, steps=60)
    later = _run_gate(gate, 4, rate_on=80.0, rate_off=40.0, steps=200)
    assert sum(later[-50:]) / 50 > 0.8


def test_gate_is_not_fooled_by_the_machine_slowing_down_or_by_noise():
    # Speculation is 1.3x faster throughout, while the machine gets 4x slower (other load)
    # and single steps vary by +-40%: paired samples still see the 1.3x.
    gate = BatchGate()
    choices = _run_gate(gate, 1, rate_on=39.0, rate_off=30.0, steps=600,
                        load=lambda step: 1.0 - 0.75 * step / 600, noise=0.4, seed=3)
    assert sum(choices[50:]) / 550 > 0.85
    gate = BatchGate()
    choices = _run_gate(gate, 1, rate_on=30.0, rate_off=39.0, steps=600,
                        load=lambda step: 0.25 + 0.75 * step / 600, noise=0.4, seed=4)
    assert sum(choices[50:]) / 550 < 0.15


def _simulate(gate: BatchGate | None, always: bool, n: int, on_step, off_step, steps: int,
              seed: int) -> float:
    """Tokens per second over `steps` decode steps whose (tokens, seconds) come from
    on_step/off_step(rng), with +-30% noise per step and the machine slowing 2x over the run;
    `gate` None means always `always`."""
    import random

    rng = random.Random(seed)
    tokens = seconds = 0.0
    for step in range(steps):
        on = gate.allow(n) if gate is not None else always
        made, took = on_step(rng) if on else off_step(rng)
        took *= (1 + step / steps) * rng.uniform(0.7, 1.3)
        if gate is not None:
            gate.observe(n, on, made, took)
        tokens += made
        seconds += took
    return tokens / seconds


def _verify_step(accept_all: float, k: int, cost: float, batch: int = 1):
    """A verification's (tokens, seconds) per request: all k proposals kept with probability
    accept_all, else none; `cost` is its time relative to a plain 0.09 s step."""
    def step(rng):
        per = [(k + 1) if rng.random() < accept_all else 1 for _ in range(batch)]
        return sum(per), 0.09 * cost
    return step


def test_gate_keeps_most_of_speculations_gain_on_realistic_steps():
    # Batch 1 copying: 60% of verifications keep all 4 proposals, a verification costs 1.7x.
    on, off = _verify_step(0.6, 4, 1.7), (lambda rng: (1, 0.09))
    for seed in range(3):
        best = _simulate(None, True, 1, on, off, 800, seed)
        got = _simulate(BatchGate(), True, 1, on, off, 800, seed)
        assert got > 0.9 * best, (seed, got, best)


def test_gate_keeps_most_of_plain_decodings_speed_where_speculation_loses():
    # Batch 16 chat: 25% of verifications keep their one proposal, a verification costs 2x.
    on = _verify_step(0.25, 1, 2.0, batch=16)
    off = lambda rng: (16, 0.09)  # noqa: E731
    for seed in range(3):
        best = _simulate(None, False, 16, on, off, 800, seed)
        got = _simulate(BatchGate(), True, 16, on, off, 800, seed)
        assert got > 0.9 * best, (seed, got, best)


# -- configuration ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"method": "medusa"}, r"unknown speculative method 'medusa' \(choose ngram, draft\)"),
        ({"method": "ngram", "num_speculative_tokens": 0}, r"num_speculative_tokens must be in \[1, 16\]"),
        ({"method": "draft"}, r"speculative method 'draft' needs a draft model folder"),
        ({"method": "draft", "draft_model": "/nonexistent"}, r"is not a model folder"),
        ({"method": "ngram", "ngram_min": 3, "ngram_max": 2}, r"need 1 <= ngram_min <= ngram_max"),
        ({"method": "ngram", "max_batch_size": -1}, r"max_batch_size must be >= 0"),
    ],
)
def test_bad_speculative_settings_are_explained(fields, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(**fields).validate()


def test_draft_model_must_share_the_targets_tokenizer(tmp_path, tiny_llama_dir):
    from splitserve_cli.tiny_model import build_tiny_model

    target = ModelConfig.from_dir(tiny_llama_dir)
    check_same_tokenizer(ModelConfig.from_dir(tiny_llama_dir), target)  # same folder: fine
    bigger = build_tiny_model(tmp_path / "bigger", vocab_size=target.vocab_size + 8)
    with pytest.raises(ValueError, match="vocabulary .* is larger than the target's"):
        check_same_tokenizer(ModelConfig.from_dir(bigger), target)
    other = build_tiny_model(tmp_path / "other")
    file = other / "tokenizer.json"
    file.write_text(file.read_text().replace('"Ġthe":', '"Ġthe_":', 1))
    with pytest.raises(ValueError, match="different tokenizer"):
        check_same_tokenizer(ModelConfig.from_dir(other), target)
