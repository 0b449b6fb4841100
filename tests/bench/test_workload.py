"""Workloads (length distributions, class mix, prefixes, tenants) and prompts of exact token
counts built from a real tokenizer."""

from __future__ import annotations

import numpy as np
import pytest

from bench.loadgen.prompts import PromptBuilder, load_tokenizer
from bench.loadgen.workload import (
    LongTailed,
    RequestSpec,
    Tenant,
    Uniform,
    preset,
    with_prefixes,
    with_tenants,
)


def rng(seed=0):
    return np.random.default_rng(seed)


def test_uniform_covers_both_ends_and_nothing_outside():
    x = Uniform(3, 6).sample(rng(), 4000)
    assert set(np.unique(x)) == {3, 4, 5, 6}


def test_long_tailed_is_right_skewed_within_bounds_without_piling_on_them():
    x = LongTailed(64, 512, median=176).sample(rng(), 20000)
    assert x.min() >= 64 and x.max() <= 512
    assert np.median(x) == pytest.approx(176, rel=0.1)
    assert x.mean() > np.median(x)  # a long right tail
    assert np.mean(x == 512) < 0.01 and np.mean(x == 64) < 0.01
    assert np.mean(x > 400) > 0.02  # the tail is there


def test_chat_preset_lengths_stay_in_the_issue_ranges():
    specs = preset("chat").sample(rng(), 2000)
    assert min(s.prompt_len for s in specs) >= 64 and max(s.prompt_len for s in specs) <= 512
    assert min(s.output_len for s in specs) >= 32 and max(s.output_len for s in specs) <= 256


def test_interference_mix_follows_class_weights():
    specs = preset("interference", long_prompt_len=1000).sample(rng(), 5000)
    long = [s for s in specs if s.cls == "long"]
    assert len(long) / len(specs) == pytest.approx(0.2, abs=0.02)
    assert all(s.prompt_len == 1000 and s.output_len == 4 for s in long)


def test_first_requests_do_not_depend_on_how_many_are_drawn():
    w = preset("uniform")
    assert w.sample(rng(5), 10) == w.sample(rng(5), 1000)[:10]
    assert w.sample(rng(5), 10) != w.sample(rng(6), 10)


def test_shared_prefix_is_added_in_front_of_the_sampled_length():
    w = with_prefixes(preset("fixed", input_len=50), groups=3, length=200)
    specs = w.sample(rng(), 600)
    assert {s.prefix_group for s in specs} == {0, 1, 2}
    assert all(s.prompt_len == 250 for s in specs)


def test_tenants_are_drawn_by_weight_and_carry_their_keys():
    w = with_tenants(preset("fixed"), (Tenant("a", "ka", 3.0), Tenant("b", "kb", 1.0)))
    specs = w.sample(rng(), 4000)
    share_a = sum(s.tenant == "a" for s in specs) / len(specs)
    assert share_a == pytest.approx(0.75, abs=0.03)
    assert all(s.api_key == {"a": "ka", "b": "kb"}[s.tenant] for s in specs)


def test_prefix_settings_must_come_together():
    with pytest.raises(ValueError):
        with_prefixes(preset("fixed"), groups=2, length=0)


# -- prompts -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_llama_dir):
    return load_tokenizer(str(tiny_llama_dir))


def spec(n: int, group: int = -1) -> RequestSpec:
    return RequestSpec(index=0, cls="c", prompt_len=n, output_len=8, prefix_group=group)


@pytest.mark.parametrize("n", [1, 2, 17, 128, 400])
def test_completion_text_prompts_have_exactly_the_asked_token_count(tiny_tokenizer, n):
    builder = PromptBuilder(tiny_tokenizer, seed=1)
    built = builder.build(spec(n), rng(n))
    assert isinstance(built.prompt, str)
    assert len(tiny_tokenizer(built.prompt)["input_ids"]) == n == built.num_tokens


def test_chat_prompts_count_the_template_tokens_too(tiny_tokenizer):
    builder = PromptBuilder(tiny_tokenizer, endpoint="chat", seed=1)
    assert builder.template_tokens > 0
    for n in (builder.template_tokens + 1, 100, 300):
        messages = builder.build(spec(n), rng(n)).prompt
        ids = tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        assert len(ids) == n


def test_token_id_prompts_have_exact_length(tiny_tokenizer):
    built = PromptBuilder(tiny_tokenizer, prompt_format="token_ids").build(spec(77), rng())
    assert isinstance(built.prompt, list) and len(built.prompt) == 77


def test_requests_of_a_group_share_the_prefix_and_groups_differ(tiny_tokenizer):
    builder = PromptBuilder(tiny_tokenizer, prompt_format="token_ids", seed=3)
    a1 = builder.build(spec(120, group=0), rng(1), prefix_len=100).prompt
    a2 = builder.build(spec(130, group=0), rng(2), prefix_len=100).prompt
    b = builder.build(spec(120, group=1), rng(1), prefix_len=100).prompt
    assert a1[:100] == a2[:100] and a1[100:] != a2[100:]
    assert a1[:100] != b[:100]


def test_shared_prefix_text_prompts_stay_exact(tiny_tokenizer):
    builder = PromptBuilder(tiny_tokenizer, seed=3)
    texts = [builder.build(spec(150, group=0), rng(i), prefix_len=100).prompt for i in range(3)]
    ids = [tiny_tokenizer(t)["input_ids"] for t in texts]
    assert all(len(x) == 150 for x in ids)
    assert ids[0][:100] == ids[1][:100] == ids[2][:100]


def test_smollm2_prompts_are_exact(smollm2_dir):
    tokenizer = load_tokenizer(str(smollm2_dir))
    for endpoint in ("completions", "chat"):
        builder = PromptBuilder(tokenizer, endpoint=endpoint, seed=0)
        for n in (64, 511):
            built = builder.build(spec(n), rng(n))
            if endpoint == "chat":
                ids = tokenizer.apply_chat_template(built.prompt, add_generation_prompt=True,
                                                    tokenize=True)["input_ids"]
            else:
                ids = tokenizer(built.prompt)["input_ids"]
            assert len(ids) == n


def test_sampled_chat_mix_carries_each_class_sampling_in_its_share():
    specs = preset("chat-sampled").sample(rng(), 5000)
    by_class = {name: [s for s in specs if s.cls == name] for name in ("greedy", "sampled", "penalized")}
    assert len(by_class["sampled"]) / len(specs) == pytest.approx(0.4, abs=0.03)
    assert len(by_class["penalized"]) / len(specs) == pytest.approx(0.2, abs=0.03)
    assert all(dict(s.sampling) == {"temperature": 0.0} for s in by_class["greedy"])
    assert all(dict(s.sampling) == {"temperature": 0.8, "top_p": 0.95} for s in by_class["sampled"])
    penalized = dict(by_class["penalized"][0].sampling)
    assert penalized["presence_penalty"] > 0 and penalized["logprobs"] == 2
    assert "top_p=0.95" in preset("chat-sampled").describe()
