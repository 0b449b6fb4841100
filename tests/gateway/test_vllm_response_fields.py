"""The fields vLLM adds to an answer, through a real gateway and real workers (both
deployments, the tiny model), held to the engine's own output: return_token_ids,
prompt_logprobs and stop_reason."""

from __future__ import annotations

import json

import httpx
import pytest

PROMPT = "The engineer reads a long letter"


def test_stop_reason_names_the_stop_string_or_token_as_vllm_does(stack, engine, tiny_llama_dir):
    """vLLM's stop_reason beside finish_reason: the stop string that matched, the stop token
    id, or null (EOS, the length limit); streamed, on the finishing chunk."""
    from engine.sampling_params import SamplingParams

    [plain] = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8,
                                                       ignore_eos=True))
    url, model = stack.url, tiny_llama_dir.name
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    stop = plain.text[len(plain.text) // 2:][:3]

    def choice(**extra) -> dict:
        return httpx.post(url + "/v1/completions", json={**body, **extra},
                          timeout=30).json()["choices"][0]

    assert choice(stop=["never appears", stop])["stop_reason"] == stop
    by_token = choice(stop_token_ids=[plain.token_ids[1]])
    assert (by_token["finish_reason"], by_token["stop_reason"]) == ("stop", plain.token_ids[1])
    assert choice()["stop_reason"] is None  # the length limit
    chat = httpx.post(url + "/v1/chat/completions", timeout=30, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "stop_token_ids": [plain.token_ids[0]], "logit_bias": {str(plain.token_ids[0]): 100},
    }).json()["choices"][0]
    assert (chat["finish_reason"], chat["stop_reason"]) == ("stop", plain.token_ids[0])
    finishing = []
    with httpx.stream("POST", url + "/v1/completions", timeout=30,
                      json={**body, "stop": [stop], "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                streamed = json.loads(line[6:])["choices"][0]
                assert ("stop_reason" in streamed) == (streamed["finish_reason"] is not None)
                if streamed["finish_reason"] is not None:
                    finishing.append(streamed["stop_reason"])
    assert finishing == [stop]


def test_return_token_ids_gives_the_tokens_beside_the_text(stack, engine, tiny_llama_dir):
    """vLLM's return_token_ids: completions' choices and chat's response carry the prompt's
    ids once and each choice's output ids, streamed as deltas that add up to the same."""
    from engine.sampling_params import SamplingParams

    url, model = stack.url, tiny_llama_dir.name
    [expected] = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=6,
                                                          ignore_eos=True))
    body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    plain = httpx.post(url + "/v1/completions", json=body, timeout=30).json()["choices"][0]
    assert plain["token_ids"] == expected.token_ids
    assert plain["prompt_token_ids"] == expected.prompt_token_ids
    streamed, prompt_ids = [], []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                      timeout=30) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                streamed += choice["token_ids"]
                prompt_ids += choice.get("prompt_token_ids", [])
    assert streamed == expected.token_ids and prompt_ids == expected.prompt_token_ids
    chat = httpx.post(url + "/v1/chat/completions", timeout=30, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "ignore_eos": True, "return_token_ids": True}).json()
    tokenized = httpx.post(url + "/tokenize", timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["prompt_token_ids"] == tokenized["tokens"]
    assert len(chat["choices"][0]["token_ids"]) == chat["usage"]["completion_tokens"] == 4
    without = httpx.post(url + "/v1/completions", timeout=30, json={**body,
                                                                  "return_token_ids": False})
    assert "token_ids" not in without.json()["choices"][0]


def test_prompt_logprobs_as_vllm_returns_them(stack, engine, tiny_llama_dir):
    """vLLM's prompt_logprobs: each prompt token after the first with its logprob, rank and
    text, then the k likeliest tokens in its place, equal to the engine's own; beside each
    completion choice (streamed: on its first chunk), and once beside a chat's choices."""
    from engine.sampling_params import SamplingParams

    url, model = stack.url, tiny_llama_dir.name
    [expected] = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=1,
                                                          prompt_logprobs=2))
    body = {"model": model, "prompt": PROMPT, "max_tokens": 2, "temperature": 0,
            "prompt_logprobs": 2}
    plain = httpx.post(url + "/v1/completions", json=body, timeout=30).json()["choices"][0]
    got = plain["prompt_logprobs"]
    assert len(got) == len(expected.prompt_token_ids) and got[0] is None
    for token_id, entry, want in zip(expected.prompt_token_ids[1:], got[1:],
                                     expected.prompt_logprobs[1:], strict=True):
        assert list(entry)[0] == str(token_id)  # the prompt's own token first
        assert entry[str(token_id)]["rank"] == want.rank
        assert entry[str(token_id)]["logprob"] == pytest.approx(want.logprob, abs=1e-3)
        top = sorted(want.top.items(), key=lambda kv: -kv[1])
        for rank, (other, value) in enumerate(top, start=1):
            assert entry[str(other)]["logprob"] == pytest.approx(value, abs=1e-3)
            if other != token_id:
                assert entry[str(other)]["rank"] == rank
        assert set(entry) == {str(token_id)} | {str(t) for t in want.top}
        assert all(isinstance(e["decoded_token"], str) for e in entry.values())
    streamed = []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True, "n": 2},
                      timeout=30) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                if "prompt_logprobs" in choice:
                    streamed.append((choice["index"], choice["prompt_logprobs"]))
    assert sorted(index for index, _ in streamed) == [0, 1]
    assert all(lps == got for _, lps in streamed)
    messages = [{"role": "user", "content": "hi"}]
    chat = httpx.post(url + "/v1/chat/completions", timeout=30, json={
        "model": model, "messages": messages, "max_tokens": 2, "n": 2, "prompt_logprobs": 0,
    }).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(entry) == 1 for entry in chat["prompt_logprobs"][1:])  # k = 0: its own only
    without = httpx.post(url + "/v1/completions", timeout=30,
                         json={**body, "prompt_logprobs": None}).json()["choices"][0]
    assert "prompt_logprobs" not in without


def test_with_echo_prompt_logprobs_keeps_its_own_count(stack, tiny_llama_dir):
    """`prompt_logprobs: 1` beside echo's `logprobs: 2`: each prompt token has its own entry
    and its one likeliest (1 or 2 entries), in the field and in echo's prompt part, as vLLM
    gives them; the generated token has echo's 2. Computed with the larger count, both carried
    3 entries a prompt token."""
    body = {"model": tiny_llama_dir.name, "prompt": PROMPT, "max_tokens": 1, "temperature": 0,
            "logprobs": 2, "prompt_logprobs": 1, "echo": True}
    choice = httpx.post(stack.url + "/v1/completions", json=body, timeout=30).json()["choices"][0]
    field = choice["prompt_logprobs"]
    assert field[0] is None and all(1 <= len(entry) <= 2 for entry in field[1:]), field
    echoed = choice["logprobs"]["top_logprobs"]
    assert echoed[0] is None and [len(e) for e in echoed[1:-1]] == [len(e) for e in field[1:]]
    assert len(echoed[-1]) == 2
