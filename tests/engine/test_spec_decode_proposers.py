"""Speculative decoding parts in isolation: the n-gram proposer's lookups, adaptive k, the
batch-size gate, configuration errors, and the draft model's tokenizer check."""

from __future__ import annotations

import pytest

from engine.config import ModelConfig
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.spec_decode.adaptive_k import MIN_ACCEPT_CHANCE, PROBE_EVERY, AdaptiveK
from engine.spec_decode.batch_gate import BatchGate
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.draft import check_same_tokenizer
from engine.spec_decode.ngram import NgramProposer


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
    ks = []
    for _ in range(2 * PROBE_EVERY):
        policy.start_step()
        ks.append(policy.num_tokens("r"))
    assert ks.count(1) == 2 and ks.count(0) == 2 * PROBE_EVERY - 2
    # A request that starts copying earns k back.
    for _ in range(30):
        policy.record("r", 1, 1)
    assert policy.num_tokens("r") == 4


def test_adaptive_k_probes_every_stopped_request_on_the_same_steps():
    # A draft model's forward costs about the same for one probe as for many: requests that
    # stopped speculating at different times must not spread their probes over most steps.
    policy = AdaptiveK(k_max=4)
    for rid, rejections in (("a", 12), ("b", 5), ("c", 3)):
        for _ in range(rejections):
            policy.record(rid, 1, 0)
    proposing_steps = []
    for step in range(4 * PROBE_EVERY):
        policy.start_step()
        ks = {rid: policy.num_tokens(rid) for rid in "abc"}
        for rid, k in ks.items():
            if k:
                policy.record(rid, k, 0)
        if any(ks.values()):
            proposing_steps.append(step)
    # Once all three are down to k = 0 (within a few steps), one probing step in PROBE_EVERY.
    assert [s for s in proposing_steps if s >= PROBE_EVERY] == [
        s for s in range(PROBE_EVERY, 4 * PROBE_EVERY) if (s + 1) % PROBE_EVERY == 0]


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
#
# Simulated decode steps: a plain step of n requests makes n tokens in 0.09 s; a speculating
# step proposes k tokens per request, keeps all of them with probability `accept` (else none)
# and takes `cost` times as long. Each step's time also has +-30% noise, and the machine
# slows down 2x over a run (other load, growing contexts).


def _spec_step(accept: float, k: int, cost: float, n: int = 1):
    def step(rng):
        tokens = sum(k + 1 if rng.random() < accept else 1 for _ in range(n))
        return tokens, 0.09 * cost, k * n
    return step


def _plain_step(n: int = 1):
    return lambda rng: (n, 0.09, 0)


def _simulate(gate: BatchGate | None, n: int, on_step, off_step, steps: int, seed: int,
              always: bool = True, slowdown: float = 2.0) -> tuple[float, list[bool]]:
    """Tokens per second over `steps`, and each step's choice; `gate` None: always `always`."""
    import random

    rng = random.Random(seed)
    tokens = seconds = 0.0
    choices = []
    for step in range(steps):
        on = gate.allow(n) if gate is not None else always
        made, took, proposed = on_step(rng) if on else off_step(rng)
        took *= (1 + (slowdown - 1) * step / steps) * rng.uniform(0.7, 1.3)
        if gate is not None:
            gate.observe(n, on, made, took, proposed)
        tokens += made
        seconds += took
        choices.append(on)
    return tokens / seconds, choices


def test_gate_turns_speculation_off_above_the_fixed_batch_limit():
    gate = BatchGate(max_batch_size=8, adaptive=False)
    assert gate.allow(1) and gate.allow(8)
    assert not gate.allow(9) and not gate.allow(0)


def test_gate_keeps_most_of_speculations_gain_where_it_pays():
    # Batch 1 copying: 60% of verifications keep all 4 proposals; one costs 1.7x a plain step.
    on, off = _spec_step(0.6, 4, 1.7), _plain_step()
    for seed in range(3):
        best, _ = _simulate(None, 1, on, off, 800, seed)
        gate = BatchGate()
        got, choices = _simulate(gate, 1, on, off, 800, seed)
        assert got > 0.93 * best, (seed, got, best)
        # 0.6 * 5 + 0.4 = 3.4 tokens a step at a cost of 1 + 0.175 * 4 = 1.7: a gain of 2,
        # estimated from the latest steps' acceptance (all-or-nothing here, so noisy).
        assert gate.snapshot()["1+"]["cost"] == pytest.approx(0.175, rel=0.35)
        assert 1.3 < gate.snapshot()["1+"]["gain"] < 2.7


def test_gate_turns_off_a_rarely_right_draft_whose_cost_it_cannot_time():
    # Batch 16 with a draft that is almost never right: adaptive k has cut proposals to a
    # probe or two per step, too few to time their cost, yet every speculating step pays a
    # draft forward (30% of a plain step). Acceptance alone shows there is nothing to win.
    def on_step(rng):
        return 16 + (rng.random() < 0.02), 0.09 * 1.3, 2

    plain = _plain_step(16)
    for seed in range(3):
        best, _ = _simulate(None, 16, plain, plain, 600, seed)
        gate = BatchGate()
        got, choices = _simulate(gate, 16, on_step, plain, 600, seed)
        assert got > 0.95 * best, (seed, got, best)
        assert sum(choices[100:]) < 0.1 * len(choices[100:])


def test_gate_steps_down_where_speculation_loses():
    # Batch 16 chat: 25% of verifications keep their one proposal; one costs 2x.
    on, off = _spec_step(0.25, 1, 2.0, n=16), _plain_step(16)
    for seed in range(3):
        best, _ = _simulate(None, 16, on, off, 800, seed, always=False)
        got, choices = _simulate(BatchGate(), 16, on, off, 800, seed)
        assert got > 0.93 * best, (seed, got, best)
        # Off, but still trying speculation now and then.
        assert 0 < sum(choices[100:]) / 700 < 0.1


def test_gate_ranges_learn_separately():
    gate = BatchGate()
    _simulate(gate, 2, _spec_step(0.6, 4, 1.7, n=2), _plain_step(2), 300, seed=1)
    _simulate(gate, 32, _spec_step(0.25, 1, 2.0, n=32), _plain_step(32), 300, seed=2)
    assert gate.allow(3)  # 3 shares the 2-3 range, where speculation pays
    assert [gate.allow(40) for _ in range(10)].count(False) >= 8  # 32-63 does not


def test_gate_follows_a_change_of_workload():
    # Copy-heavy traffic, where speculation pays, then chat, where it loses (and where one
    # proposed token costs more than a copy step's tokens did, each: the cost model is
    # only locally linear), then copying again.
    copy_on, chat_on, off = _spec_step(0.7, 3, 1.6, 16), _spec_step(0.2, 1, 1.5, 16), _plain_step(16)
    for seed in range(3):
        gate = BatchGate()
        _simulate(gate, 16, copy_on, off, 400, seed)
        assert gate.snapshot()["16+"]["speculate"]
        best, _ = _simulate(None, 16, chat_on, off, 300, seed, always=False)
        got, choices = _simulate(gate, 16, chat_on, off, 300, seed)
        assert got > 0.9 * best, (seed, got, best)
        assert sum(choices[60:]) / 240 < 0.15
        back, choices = _simulate(gate, 16, copy_on, off, 300, seed)
        assert sum(choices[50:]) / 250 > 0.85


def test_gate_learns_each_range_while_batch_sizes_alternate():
    # Traffic alternates between one request and sixteen while the machine slows 4x:
    # speculation pays alone and loses at sixteen. Each range learns its own answer.
    import random

    gate, rng = BatchGate(), random.Random(5)
    on = {1: _spec_step(0.6, 4, 1.7), 16: _spec_step(0.2, 1, 2.4, n=16)}
    late = {1: [], 16: []}
    for step in range(1200):
        n = 1 if (step // 25) % 2 else 16
        choice = gate.allow(n)
        made, took, proposed = on[n](rng) if choice else _plain_step(n)(rng)
        gate.observe(n, choice, made, took * (1 + 3 * step / 1200) * rng.uniform(0.8, 1.2),
                     proposed)
        if step >= 600:
            late[n].append(choice)
    assert sum(late[1]) / len(late[1]) > 0.85
    assert sum(late[16]) / len(late[16]) < 0.15


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
