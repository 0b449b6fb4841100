"""The HTTP API through the official openai SDK, against real workers in both deployments."""

from __future__ import annotations

import importlib.metadata
import json

import httpx
import pytest
from gateway_processes import openai_client


@pytest.fixture(scope="module")
def model_name(tiny_llama_dir) -> str:
    """The served name: the model folder's name, as the workers report it."""
    return tiny_llama_dir.name


def _chat(client, model, **kwargs):
    kwargs.setdefault("messages", [{"role": "user", "content": "What is the capital of France?"}])
    return client.chat.completions.create(model=model, **kwargs)


def test_chat_non_streaming_returns_message_finish_reason_and_usage(stack, model_name):
    response = _chat(openai_client(stack.url), model_name, max_tokens=8, temperature=0)
    assert response.object == "chat.completion"
    assert response.model == model_name
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert response.usage.prompt_tokens > 0
    assert 1 <= response.usage.completion_tokens <= 8
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_chat_stream_has_role_first_content_then_finish_then_usage(stack, model_name):
    chunks = list(_chat(openai_client(stack.url), model_name, max_tokens=8, temperature=0,
                        stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("stop", "length") and all(f is None for f in finishes[:-1])
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1]
    assert chunks[-1].choices == []
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = _chat(openai_client(stack.url), model_name, max_tokens=8, temperature=0)
    assert streamed == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(disagg_stack, model_name):
    """vLLM's stream_options.continuous_usage_stats (with include_usage): each content chunk
    carries the usage so far, counting up to the final usage chunk's; without include_usage
    it changes nothing."""
    client = openai_client(disagg_stack.url)
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.completions.create(model=model_name, prompt="The old library",
                                            max_tokens=6, n=2, stream=True,
                                            stream_options=options,
                                            extra_body={"ignore_eos": True}))
    content = [c for c in chunks if c.choices]
    assert content and all(c.usage is not None for c in content)
    counts = [c.usage.completion_tokens for c in content]
    assert counts == sorted(counts) and counts[-1] == 12 == chunks[-1].usage.completion_tokens
    assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in content)
    plain = list(_chat(client, model_name, max_tokens=4, stream=True,
                       stream_options={"continuous_usage_stats": True}))
    assert all(c.usage is None for c in plain)
    # Chat's first chunk (the role) carries it too, with nothing generated yet, as vLLM's.
    chat = list(_chat(client, model_name, max_tokens=4, stream=True, stream_options=options))
    assert chat[0].choices[0].delta.role == "assistant"
    assert chat[0].usage.completion_tokens == 0
    assert chat[0].usage.prompt_tokens == chat[-1].usage.prompt_tokens > 0
    assert all(c.usage is not None for c in chat)


def test_stream_without_include_usage_has_no_usage_chunk(disagg_stack, model_name):
    chunks = list(_chat(openai_client(disagg_stack.url), model_name, max_tokens=4, stream=True))
    assert all(c.usage is None for c in chunks)
    assert all(c.choices for c in chunks)


def test_completions_streaming_equals_non_streaming(stack, model_name):
    client = openai_client(stack.url)
    whole = client.completions.create(model=model_name, prompt="The old library", max_tokens=12,
                                      temperature=0)
    assert whole.object == "text_completion"
    chunks = list(client.completions.create(model=model_name, prompt="The old library",
                                            max_tokens=12, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 12


def test_max_tokens_one_is_the_prefill_workers_token(stack, model_name):
    response = openai_client(stack.url).completions.create(
        model=model_name, prompt="A small cat", max_tokens=1, temperature=0, logprobs=0)
    assert response.usage.completion_tokens == 1
    assert len(response.choices[0].logprobs.tokens) == 1
    assert response.choices[0].finish_reason == "length"


def test_stop_string_ends_output_before_it_and_never_leaks(disagg_stack, model_name):
    client = openai_client(disagg_stack.url)
    prompt = "Our team builds"
    full = client.completions.create(model=model_name, prompt=prompt, max_tokens=40,
                                     temperature=0, extra_body={"ignore_eos": True})
    text = full.choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert len(stop.strip()) >= 2, f"no usable stop string in {text!r}"
    expected = text[: text.index(stop)]
    stopped = client.completions.create(model=model_name, prompt=prompt, max_tokens=40,
                                        temperature=0, stop=[stop, "\x00never"],
                                        extra_body={"ignore_eos": True})
    assert stopped.choices[0].text == expected
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens < 40
    chunks = list(client.completions.create(model=model_name, prompt=prompt, max_tokens=40,
                                            temperature=0, stop=stop, stream=True,
                                            extra_body={"ignore_eos": True}))
    pieces = [c.choices[0].text for c in chunks]
    assert "".join(pieces) == expected
    assert not any(stop in p for p in pieces)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_same_seed_gives_same_sample_and_other_seeds_differ(stack, model_name):
    client = openai_client(stack.url)

    def sample(seed):
        return client.completions.create(model=model_name, prompt="Every student", max_tokens=24,
                                         temperature=1.0, seed=seed).choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert len({sample(s) for s in (1, 2, 3)} | {first}) > 1


def test_seeds_are_64_bit_signed_and_none_shares_another_ones_stream(disagg_stack, model_name):
    """vLLM's range: a seed past a signed 64-bit integer is a 400 naming it. Inside it,
    seeds that used to share a stream (2^64 wrapped to 0; Python's int hash is modulo
    2^61 - 1) draw their own text."""
    import httpx

    url = f"{disagg_stack.url}/v1/completions"

    def sample(seed):
        response = httpx.post(url, timeout=60, json={
            "model": model_name, "prompt": "Every student", "max_tokens": 24,
            "temperature": 1.0, "seed": seed})
        return response.status_code, response.json()

    for seed in (2**63, 2**64, -(2**63) - 1):
        status, body = sample(seed)
        assert status == 400 and body["error"]["param"] == "seed", body
    texts = {seed: sample(seed)[1]["choices"][0]["text"]
             for seed in (5, 5 + 2**61 - 1, 2**63 - 1, -1 - 2**62, -(2**63))}
    assert len(set(texts.values())) == len(texts), texts


def test_n_choices_sample_with_distinct_seeds(disagg_stack, model_name):
    client = openai_client(disagg_stack.url)
    response = client.completions.create(model=model_name, prompt="My neighbour", max_tokens=16,
                                         temperature=1.0, seed=7, n=3)
    assert [c.index for c in response.choices] == [0, 1, 2]
    again = client.completions.create(model=model_name, prompt="My neighbour", max_tokens=16,
                                      temperature=1.0, seed=8)
    # Choice 1 samples with seed+1: the same as a single request with seed 8.
    assert response.choices[1].text == again.choices[0].text
    single = client.completions.create(model=model_name, prompt="My neighbour", max_tokens=1)
    assert response.usage.prompt_tokens == single.usage.prompt_tokens  # counted once, not n times
    assert 3 <= response.usage.completion_tokens <= 48
    streamed = list(client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=2,
        stream=True, seed=3))
    assert {c.choices[0].index for c in streamed if c.choices} == {0, 1}


def test_chat_logprobs_with_top_logprobs(stack, model_name):
    response = _chat(openai_client(stack.url), model_name, max_tokens=6, temperature=0,
                     logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token


def test_completion_top_logprobs_hold_the_chosen_token_and_the_likeliest(stack, model_name):
    """OpenAI's legacy completions (and vLLM): top_logprobs gives the chosen token as well as
    the `logprobs` likeliest, so logprobs=0 still names the chosen one (with sampling it is
    often not among the likeliest)."""
    client = openai_client(stack.url)
    for k in (0, 2):
        response = client.completions.create(model=model_name, prompt="A small cat", max_tokens=8,
                                             temperature=1.5, seed=5, logprobs=k)
        lp = response.choices[0].logprobs
        for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs,
                                       strict=True):
            assert top[token] == pytest.approx(logprob)
            assert 1 <= len(top) <= k + 1  # fewer where two tokens share a text


def test_completion_echo_with_logprobs_includes_prompt_tokens(stack, model_name):
    prompt = "The river follows the quiet road"
    response = openai_client(stack.url).completions.create(
        model=model_name, prompt=prompt, max_tokens=5, temperature=0, logprobs=2, echo=True)
    choice = response.choices[0]
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    n_prompt = response.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 5
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens[:n_prompt]) == prompt
    assert lp.text_offset[:3] == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]


def test_echo_keeps_the_prompts_special_tokens_and_max_tokens_0_scores_it(stack, model_name):
    """The prompt is echoed as given, special tokens included, so text_offset indexes the
    text (before, "<|im_start|>user" came back as "user" with offsets past its end); with
    max_tokens 0 echo scores the prompt: its logprobs, no output, as vLLM answers."""
    prompt = "<|im_start|>user\nThe river<|im_end|>\n"
    body = {"model": model_name, "prompt": prompt, "echo": True, "logprobs": 1,
            "temperature": 0}
    for max_tokens in (3, 0):
        response = httpx.post(f"{stack.url}/v1/completions", timeout=60,
                              json={**body, "max_tokens": max_tokens})
        assert response.status_code == 200, response.text
        choice, usage = response.json()["choices"][0], response.json()["usage"]
        assert choice["text"].startswith(prompt)
        lp = choice["logprobs"]
        for token, offset in zip(lp["tokens"], lp["text_offset"], strict=True):
            assert choice["text"][offset:offset + len(token)] == token
        assert usage["completion_tokens"] == max_tokens
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert len(lp["tokens"]) == usage["prompt_tokens"]
    assert lp["token_logprobs"][0] is None and all(v <= 0 for v in lp["token_logprobs"][1:])
    # Without echo, max_tokens 0 is still refused, as by vLLM.
    refused = httpx.post(f"{stack.url}/v1/completions", timeout=60,
                         json={**body, "echo": False, "max_tokens": 0})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def test_what_vllm_accepts_a_switching_client_sends(stack, model_name):
    """No model (vLLM serves its one model; scripts for it leave the field out), and
    completions' logprobs as chat's flag: true is 1 (vLLM's reading), false is none."""
    answer = httpx.post(f"{stack.url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert answer.status_code == 200 and answer.json()["model"] == model_name
    for flag, expected in ((True, 2), (False, None)):  # the chosen token and one alternative
        choice = httpx.post(f"{stack.url}/v1/completions", timeout=60, json={
            "model": model_name, "prompt": "hi", "max_tokens": 1, "temperature": 0,
            "logprobs": flag}).json()["choices"][0]
        if expected is None:
            assert choice["logprobs"] is None
        else:
            assert 1 <= len(choice["logprobs"]["top_logprobs"][0]) <= expected


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(stack, model_name):
    """vLLM's return_tokens_as_token_ids: every logprob token is "token_id:N", N the id that
    return_token_ids gives; the text, its offsets and the chosen token's bytes stay the text's."""
    client = openai_client(stack.url)
    settings = dict(max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    plain = _chat(client, model_name, **settings).choices[0]
    choice = _chat(client, model_name, **settings, extra_body={
        "return_tokens_as_token_ids": True, "return_token_ids": True}).choices[0]
    content = choice.logprobs.content
    assert [e.token for e in content] == [f"token_id:{t}" for t in choice.token_ids]
    assert choice.message.content == plain.message.content
    assert [e.bytes for e in content] == [e.bytes for e in plain.logprobs.content]
    for entry in content:
        assert entry.top_logprobs[0].token == entry.token  # greedy: the likeliest
        assert all(bytes(t.bytes).decode() == t.token for t in entry.top_logprobs)
    plain = client.completions.create(model=model_name, prompt="A small cat", max_tokens=6,
                                      temperature=0, logprobs=1, echo=True)
    named = client.completions.create(model=model_name, prompt="A small cat", max_tokens=6,
                                      temperature=0, logprobs=1, echo=True,
                                      extra_body={"return_tokens_as_token_ids": True,
                                                  "return_token_ids": True})
    lp, choice = named.choices[0].logprobs, named.choices[0]
    ids = [*choice.prompt_token_ids, *choice.token_ids]
    assert lp.tokens == [f"token_id:{t}" for t in ids]
    assert choice.text == plain.choices[0].text
    assert lp.text_offset == plain.choices[0].logprobs.text_offset
    assert lp.token_logprobs == pytest.approx(plain.choices[0].logprobs.token_logprobs)
    for token, top in zip(lp.tokens[1:], lp.top_logprobs[1:], strict=True):
        assert token in top and all(name.startswith("token_id:") for name in top)


def test_token_id_prompts_and_prompt_lists(disagg_stack, model_name, tiny_llama_dir):
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(tiny_llama_dir / "tokenizer.json")).encode("A curious child").ids
    client = openai_client(disagg_stack.url)
    by_text = client.completions.create(model=model_name, prompt="A curious child", max_tokens=6,
                                        temperature=0)
    by_ids = client.completions.create(model=model_name, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)
    several = client.completions.create(model=model_name, prompt=["A curious child", "The server"],
                                        max_tokens=6, temperature=0)
    assert [c.index for c in several.choices] == [0, 1]
    assert several.choices[0].text == by_text.choices[0].text
    lists = client.completions.create(model=model_name, prompt=[ids, ids[:2]], max_tokens=6,
                                      temperature=0)
    assert lists.choices[0].text == by_text.choices[0].text


def test_models_lists_the_served_model_with_its_context(stack, model_name):
    models = openai_client(stack.url).models.list().data
    assert [m.id for m in models] == [model_name]
    card = httpx.get(f"{stack.url}/v1/models", timeout=10).json()["data"][0]
    assert {"id", "object", "created", "owned_by", "root", "max_model_len"} <= card.keys()
    assert card["max_model_len"] == 512  # the tiny model's max_position_embeddings
    [permission] = card["permission"]  # OpenAI's legacy object, as vLLM serves it
    assert permission["object"] == "model_permission" and permission["allow_sampling"]


def test_every_answer_carries_one_system_fingerprint(stack, model_name):
    client = openai_client(stack.url)
    whole = _chat(client, model_name, max_tokens=2)
    chunks = list(client.completions.create(model=model_name, prompt="hi", max_tokens=2,
                                            stream=True))
    assert whole.system_fingerprint.startswith("fp_") and len(whole.system_fingerprint) == 13
    assert {c.system_fingerprint for c in chunks} == {whole.system_fingerprint}


def test_health_and_ready(stack):
    assert httpx.get(f"{stack.url}/health", timeout=10).json() == {"status": "ok"}
    for method in ("GET", "POST"):  # vLLM's /ping, as load balancers probe it
        assert httpx.request(method, f"{stack.url}/ping", timeout=10).json() == {"status": "ok"}
    # vLLM's /version: splitserve's version there.
    version = httpx.get(f"{stack.url}/version", timeout=10).json()["version"]
    assert version == importlib.metadata.version("splitserve")
    ready = httpx.get(f"{stack.admin_url}/ready", timeout=10)
    assert ready.status_code == 200 and ready.json()["status"] == "ready"


def test_unknown_fields_are_ignored_as_openai_does(disagg_stack, model_name):
    response = httpx.post(f"{disagg_stack.url}/v1/chat/completions", timeout=30, json={
        "model": model_name, "messages": [{"role": "user", "content": "hi", "extra": 1}],
        "max_tokens": 2, "some_future_field": {"x": 1}, "metadata": {"k": "v"}})
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] <= 2


def test_null_means_the_default_and_whole_floats_are_integers(disagg_stack, model_name):
    """Typed clients (Java, .NET, Go structs without omit-null) write every field, null ones
    included; OpenAI's reference types them "... or null" and vLLM reads null as the default.
    A max_tokens computed in floating point arrives as 3.0."""
    hi = [{"role": "user", "content": "hi"}]
    chat = httpx.post(f"{disagg_stack.url}/v1/chat/completions", timeout=30, json={
        "model": model_name, "messages": hi, "max_tokens": 3.0, "stream": None, "n": None,
        "logprobs": None, "top_logprobs": None, "stream_options": None, "temperature": None,
        "parallel_tool_calls": None, "ignore_eos": None})
    assert chat.status_code == 200, chat.text
    body = chat.json()
    assert len(body["choices"]) == 1 and body["choices"][0]["logprobs"] is None
    assert body["usage"]["completion_tokens"] <= 3
    completion = httpx.post(f"{disagg_stack.url}/v1/completions", timeout=30, json={
        "model": model_name, "prompt": "hi", "max_tokens": 2, "n": 2.0, "echo": None,
        "stream": True, "stream_options": {"include_usage": None}})
    assert completion.status_code == 200, completion.text
    chunks = [json.loads(line[len("data: "):]) for line in completion.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert {c["index"] for chunk in chunks for c in chunk["choices"]} == {0, 1}
    assert not any(chunk.get("usage") for chunk in chunks)  # include_usage null: off
    for field, value in (("max_tokens", 2.5), ("messages", None)):
        refused = httpx.post(f"{disagg_stack.url}/v1/chat/completions", timeout=30,
                             json={"model": model_name, "messages": hi, field: value})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field


def test_n_takes_what_sampling_jobs_ask_for(stack, model_name):
    """n up to 128, OpenAI's limit (it was 8; vLLM has none, and RL jobs ask for 16-64)."""
    response = httpx.post(f"{stack.url}/v1/completions", timeout=120, json={
        "model": model_name, "prompt": "hi", "max_tokens": 3, "n": 32, "seed": 5,
        "temperature": 1.0})
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert sorted(c["index"] for c in choices) == list(range(32))
    assert len({c["text"] for c in choices}) > 1  # choice i samples with seed + i
    assert response.json()["usage"]["completion_tokens"] == 96
