"""Request options users of the OpenAI API and vLLM send, through a real gateway and real
workers (both deployments, the tiny model): logit_bias, allowed_token_ids and min_tokens change
the output as the engine says they do (the prefill worker's first token included, the gRPC front
door too); include_stop_str_in_output, skip_special_tokens, add_generation_prompt,
continue_final_message, truncate_prompt_tokens and chat_template_kwargs shape the text and the
prompt as vLLM (and transformers' chat templates) do; a malformed value is a 400 naming the
field that reaches no worker."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest
from gateway_processes import openai_client, worker_stats
from splitserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

PROMPT = "The engineer reads a long letter"


def _grpc_tokens(address: str, **sampling) -> list[int]:
    with grpc.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        request = gateway_pb2.GenerateTextRequest(
            text=PROMPT, sampling=common_pb2.SamplingParams(has_temperature=True, **sampling))
        return [t for response in stub.Generate(request, timeout=60) for t in response.token_ids]


def test_logit_bias_forces_a_token_as_the_engine_does(stack, engine, tiny_llama_dir):
    from engine.sampling_params import SamplingParams

    [plain] = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=6,
                                                       ignore_eos=True))
    forced = next(t for t in range(40, 400) if t not in plain.token_ids)
    [expected] = engine.generate([PROMPT], SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias=((forced, 100.0),)))
    assert expected.token_ids == [forced] * 6
    response = openai_client(stack.url).completions.create(
        model=tiny_llama_dir.name, prompt=PROMPT, max_tokens=6, temperature=0,
        logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})
    assert response.choices[0].text == expected.text
    assert response.usage.completion_tokens == 6
    # -100 bans: the greedy first token never comes.
    tokens = _grpc_tokens(stack.grpc_address, max_tokens=6, temperature=0.0, ignore_eos=True,
                          logit_bias=[common_pb2.TokenBias(token_id=plain.token_ids[0],
                                                           bias=-100)])
    assert len(tokens) == 6 and plain.token_ids[0] not in tokens


def test_allowed_token_ids_hold_every_sampled_token(stack):
    allowed = [101, 202, 303]
    for seed in range(3):
        tokens = _grpc_tokens(stack.grpc_address, max_tokens=8, temperature=1.0, seed=seed,
                              ignore_eos=True, allowed_token_ids=allowed)
        assert len(tokens) == 8 and set(tokens) <= set(allowed), tokens


def test_min_tokens_holds_off_stop_tokens_and_stop_strings(stack, engine, tiny_llama_dir):
    from engine.sampling_params import SamplingParams

    [plain] = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8,
                                                       ignore_eos=True))
    first = plain.token_ids[0]
    # The greedy first token as a stop token: alone it ends the output at once.
    assert _grpc_tokens(stack.grpc_address, max_tokens=8, temperature=0.0,
                        stop_token_ids=[first]) == [first]
    tokens = _grpc_tokens(stack.grpc_address, max_tokens=8, temperature=0.0,
                          stop_token_ids=[first], min_tokens=4)
    assert len(tokens) >= 4 and first not in tokens[:4]
    # A stop string in the first token's text ends nothing before min_tokens are out.
    stop = plain.text.strip()[:1]
    client = openai_client(stack.url)
    cut = client.completions.create(model=tiny_llama_dir.name, prompt=PROMPT, max_tokens=8,
                                    temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert cut.usage.completion_tokens <= 1 and cut.choices[0].finish_reason == "stop"
    held = client.completions.create(model=tiny_llama_dir.name, prompt=PROMPT, max_tokens=8,
                                     temperature=0, stop=[stop],
                                     extra_body={"ignore_eos": True, "min_tokens": 3})
    assert held.usage.completion_tokens >= 3
    assert held.choices[0].text.startswith(engine.tokenizer.decode(plain.token_ids[:3])
                                           if hasattr(engine, "tokenizer") else "")


@pytest.mark.parametrize(("field", "value", "says"), [
    ("logit_bias", {"abc": 1}, "token ids"),
    ("logit_bias", {"5": 200}, "[-100, 100]"),
    ("logit_bias", {"5": "high"}, "number"),
    ("logit_bias", {"99999999": 1}, "vocabulary"),
    ("logit_bias", [5, 1], "object"),
    ("allowed_token_ids", [], "non-empty"),
    ("allowed_token_ids", [1, -4], "vocabulary"),
    ("min_tokens", 9, "max_tokens=4"),
    ("min_tokens", "3", "integer"),
])
def test_a_malformed_value_is_a_400_naming_the_field(disagg_stack, tiny_llama_dir, field, value,
                                                     says):
    before = worker_stats(disagg_stack.decode.address).steps
    for endpoint, body in (("/v1/completions", {"prompt": "hi"}),
                           ("/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "hi"}]})):
        response = httpx.post(disagg_stack.url + endpoint, timeout=30, json={
            "model": tiny_llama_dir.name, "max_tokens": 4, field: value, **body})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == field and says in error["message"], error
    assert worker_stats(disagg_stack.decode.address).steps == before, "it reached a worker"


def test_stop_text_and_special_tokens_as_vllm_options_say(stack, engine, tiny_llama_dir):
    """include_stop_str_in_output keeps a matched stop string (or the stop token's text) at the
    end of the text; without it the token that stopped the output adds no text.
    skip_special_tokens=false keeps special tokens' text (token 0 of the tiny tokenizer is
    <|endoftext|>, not its EOS)."""
    from engine.sampling_params import SamplingParams

    [plain] = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8,
                                                       ignore_eos=True))
    client = openai_client(stack.url)

    def complete(**extra):
        return client.completions.create(model=tiny_llama_dir.name, prompt=PROMPT, max_tokens=8,
                                         temperature=0, extra_body={"ignore_eos": True, **extra})

    stop = plain.text[len(plain.text) // 2:][:3]
    cut, kept = complete(stop=[stop]), complete(stop=[stop], include_stop_str_in_output=True)
    assert kept.choices[0].text == cut.choices[0].text + stop
    assert plain.text.startswith(kept.choices[0].text)
    second = plain.token_ids[1]
    by_token = complete(stop_token_ids=[second])
    assert by_token.choices[0].text == engine.tokenizer.decode(plain.token_ids[:1])
    assert by_token.choices[0].finish_reason == "stop" and by_token.usage.completion_tokens == 2
    # Stopped at the first token (the prefill worker's, disaggregated): no text at all.
    assert complete(stop_token_ids=[plain.token_ids[0]]).choices[0].text == ""
    with_token = complete(stop_token_ids=[second], include_stop_str_in_output=True)
    assert with_token.choices[0].text == engine.tokenizer.decode(plain.token_ids[:2])
    forced = {"logit_bias": {"0": 100}, "max_tokens": 3}
    assert complete(**forced).choices[0].text == ""
    assert complete(**forced, skip_special_tokens=False).choices[0].text == "<|endoftext|>" * 3


def test_chat_template_options_match_transformers(stack, engine, tiny_llama_dir):
    """add_generation_prompt=false and continue_final_message (an answer begun by the caller)
    give the prompt transformers' apply_chat_template gives, and the engine's greedy output."""
    from transformers import AutoTokenizer

    from engine.sampling_params import SamplingParams

    hf = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    begun = [{"role": "user", "content": "What is the capital of France?"},
             {"role": "assistant", "content": "The capital is"}]
    client = openai_client(stack.url)
    for options, hf_options in (
            ({"add_generation_prompt": False, "continue_final_message": True},
             {"continue_final_message": True}),
            ({"add_generation_prompt": False}, {"add_generation_prompt": False})):
        prompt_ids = hf.apply_chat_template(begun, tokenize=True, return_dict=False, **hf_options)
        [expected] = engine.generate([list(prompt_ids)], SamplingParams(temperature=0.0,
                                                                        max_tokens=6))
        response = client.chat.completions.create(
            model=tiny_llama_dir.name, messages=begun, max_tokens=6, temperature=0,
            extra_body=options)
        assert response.usage.prompt_tokens == len(prompt_ids), options
        assert response.choices[0].message.content == hf.decode(expected.token_ids,
                                                                skip_special_tokens=True)
    bad = httpx.post(stack.url + "/v1/chat/completions", timeout=30, json={
        "model": tiny_llama_dir.name, "messages": begun, "continue_final_message": True})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "continue_final_message"


def test_truncate_prompt_tokens_keeps_the_prompts_end(stack, engine, tiny_llama_dir):
    from engine.sampling_params import SamplingParams

    long_ids = list(range(10, 110))
    [expected] = engine.generate([long_ids[-16:]], SamplingParams(temperature=0.0, max_tokens=5))
    client = openai_client(stack.url)
    response = client.completions.create(model=tiny_llama_dir.name, prompt=long_ids, max_tokens=5,
                                         temperature=0, extra_body={"truncate_prompt_tokens": 16})
    assert response.usage.prompt_tokens == 16
    assert response.choices[0].text == expected.text
    # Shorter than k: unchanged. Chat: the templated prompt's end.
    short = client.completions.create(model=tiny_llama_dir.name, prompt=long_ids[:8], max_tokens=1,
                                      extra_body={"truncate_prompt_tokens": 16})
    assert short.usage.prompt_tokens == 8
    chat = client.chat.completions.create(
        model=tiny_llama_dir.name, max_tokens=1, extra_body={"truncate_prompt_tokens": 5},
        messages=[{"role": "user", "content": "a long question " * 20}])
    assert chat.usage.prompt_tokens == 5
    for bad in (0, -2):
        answer = httpx.post(stack.url + "/v1/completions", timeout=30, json={
            "model": tiny_llama_dir.name, "prompt": "hi", "truncate_prompt_tokens": bad})
        assert answer.status_code == 400
        assert answer.json()["error"]["param"] == "truncate_prompt_tokens"


def test_chat_template_kwargs_reach_the_template(disagg_stack, tiny_llama_dir):
    """The tiny model's template ignores variables it does not know (so the prompt is the
    same); one that would replace the request's own (messages) is a 400."""
    client = openai_client(disagg_stack.url)
    messages = [{"role": "user", "content": "hi"}]
    plain = client.chat.completions.create(model=tiny_llama_dir.name, messages=messages,
                                           max_tokens=1)
    kw = client.chat.completions.create(model=tiny_llama_dir.name, messages=messages, max_tokens=1,
                                        extra_body={"chat_template_kwargs":
                                                    {"enable_thinking": False}})
    assert kw.usage.prompt_tokens == plain.usage.prompt_tokens
    bad = httpx.post(disagg_stack.url + "/v1/chat/completions", timeout=30, json={
        "model": tiny_llama_dir.name, "messages": messages,
        "chat_template_kwargs": {"messages": []}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"


def test_chat_template_kwargs_are_template_variables(tiny_llama_dir, tmp_path):
    """A template that reads a variable (as Qwen3's reads enable_thinking) sees the value."""
    import shutil

    from services.gateway.api.tokenizer import ModelTokenizer

    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% if enable_thinking is defined and not enable_thinking %}"
                               "[no thinking]{% endif %}{% for m in messages %}{{ m['content'] }}"
                               "{% endfor %}")
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    tokenizer = ModelTokenizer(model)
    messages = [{"role": "user", "content": "hi"}]
    assert tokenizer.render_chat(messages) == "hi"
    assert tokenizer.render_chat(messages, template_kwargs={"enable_thinking": False}) == (
        "[no thinking]hi")


def test_bad_words_keep_their_tokens_out(stack, engine, tiny_llama_dir):
    from engine.sampling_params import SamplingParams

    [plain] = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=6,
                                                       ignore_eos=True))
    g = plain.token_ids
    one = _grpc_tokens(stack.grpc_address, max_tokens=6, temperature=0.0, ignore_eos=True,
                       bad_words=[common_pb2.TokenSequence(token_ids=[g[0]])])
    assert g[0] not in one
    pair = _grpc_tokens(stack.grpc_address, max_tokens=6, temperature=0.0, ignore_eos=True,
                        bad_words=[common_pb2.TokenSequence(token_ids=[g[1], g[2]])])
    assert pair[:2] == g[:2] and pair[2] != g[2]
    client = openai_client(stack.url)
    word = engine.tokenizer.decode(g[:1]).strip()  # " h": the word "h" after a space
    response = client.completions.create(model=tiny_llama_dir.name, prompt=PROMPT, max_tokens=6,
                                         temperature=0, extra_body={"ignore_eos": True,
                                                                    "bad_words": [word]})
    assert response.choices[0].text != plain.text
    for bad in ([""], "word", [3]):
        answer = httpx.post(stack.url + "/v1/completions", timeout=30, json={
            "model": tiny_llama_dir.name, "prompt": "hi", "bad_words": bad})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "bad_words"


def test_tokenize_and_detokenize_as_vllm_serves_them(disagg_stack, engine, tiny_llama_dir):
    """vLLM's /tokenize (a prompt, or a conversation through the chat template: the prompt
    chat completions sends) and /detokenize; no worker steps for them."""
    url, model = disagg_stack.url, tiny_llama_dir.name
    before = worker_stats(disagg_stack.decode.address).steps
    ids = engine.tokenizer.encode(PROMPT, add_special_tokens=True)
    out = httpx.post(url + "/tokenize", json={"model": model, "prompt": PROMPT,
                                              "return_token_strs": True}, timeout=30).json()
    assert out["tokens"] == ids and out["count"] == len(ids) and out["max_model_len"] > 0
    from transformers import AutoTokenizer

    # The vocabulary's strings, as vLLM's convert_ids_to_tokens gives them.
    assert out["token_strs"] == AutoTokenizer.from_pretrained(
        tiny_llama_dir).convert_ids_to_tokens(ids)
    cut = httpx.post(url + "/tokenize", json={"prompt": PROMPT, "truncate_prompt_tokens": 2},
                     timeout=30).json()
    assert cut["tokens"] == ids[-2:] and cut["token_strs"] is None
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = httpx.post(url + "/tokenize", json={"model": model, "messages": messages},
                      timeout=30).json()
    assert worker_stats(disagg_stack.decode.address).steps == before
    served = openai_client(url).chat.completions.create(model=model, messages=messages,
                                                        max_tokens=1)
    assert chat["count"] == served.usage.prompt_tokens
    text = httpx.post(url + "/detokenize", json={"model": model, "tokens": ids},
                      timeout=30).json()
    assert text == {"prompt": engine.tokenizer.decode(ids, skip_special_tokens=False)}
    # Special tokens stay, as vLLM's: a rendered chat comes back with its markers.
    rendered = httpx.post(url + "/detokenize", json={"tokens": chat["tokens"]}, timeout=30).json()
    assert rendered["prompt"] == engine.tokenizer.decode(chat["tokens"], skip_special_tokens=False)
    assert rendered["prompt"] != engine.tokenizer.decode(chat["tokens"], skip_special_tokens=True)
    for path, body, param in (("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
                              ("/tokenize", {"prompt": 5}, "prompt"),
                              ("/tokenize", {"model": "nope", "prompt": "x"}, "model")):
        answer = httpx.post(url + path, json=body, timeout=30)
        assert answer.status_code in (400, 404), answer.text
        assert answer.json()["error"]["param"] == param


def test_the_responses_api_answers_as_the_chat_completion_it_amounts_to(stack, tiny_llama_dir):
    """The OpenAI SDK's client.responses (plain and streamed) gets the text chat completions
    gives for the same instructions and input, with usage in the Responses API's names; a
    field it does not implement (previous_response_id: nothing is stored) is a 400."""
    client = openai_client(stack.url)
    model = tiny_llama_dir.name
    chat = client.chat.completions.create(
        model=model, max_tokens=8, temperature=0,
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "What is the capital of France?"}])
    expected = chat.choices[0].message.content
    response = client.responses.create(model=model, instructions="Be brief.", temperature=0,
                                       input="What is the capital of France?",
                                       max_output_tokens=8)
    assert response.output_text == expected
    assert response.status == "incomplete" and response.incomplete_details.reason == (
        "max_output_tokens")
    assert [item.status for item in response.output] == ["incomplete"]  # it said completed
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    events = list(client.responses.create(
        model=model, instructions="Be brief.", temperature=0, max_output_tokens=8, stream=True,
        input=[{"role": "user", "content": [{"type": "input_text",
                                             "text": "What is the capital of France?"}]}]))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-1] == "response.incomplete"
    assert [item.status for item in events[-1].response.output] == ["incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == expected == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == chat.usage.completion_tokens
    for field, value, param in (("previous_response_id", "resp_1", "previous_response_id"),
                                ("tools", [{"type": "web_search"}], "tools.0")):
        refused = httpx.post(stack.url + "/v1/responses", timeout=30, json={
            "model": model, "input": "hi", field: value})
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == param


def test_an_assistant_refusal_part_in_the_history_is_its_text(disagg_stack, tiny_llama_dir):
    """A history replayed from OpenAI can hold an assistant message whose content is a
    `refusal` part: it renders as that text (it was a 400 "reads text only")."""
    url, model = disagg_stack.url, tiny_llama_dir.name

    def history(reply) -> list[dict]:
        return [{"role": "user", "content": "Tell me a secret."},
                {"role": "assistant", "content": reply},
                {"role": "user", "content": "Then a joke."}]

    as_part = history([{"type": "refusal", "refusal": "I can't share that."}])
    as_text = history("I can't share that.")
    tokens = [httpx.post(url + "/tokenize", json={"model": model, "messages": m},
                         timeout=30).json()["tokens"] for m in (as_part, as_text)]
    assert tokens[0] == tokens[1]
    answer = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": model, "messages": as_part, "max_tokens": 2})
    assert answer.status_code == 200, answer.text


def test_the_responses_api_takes_a_structured_text_format(stack, tiny_llama_dir):
    """`text.format` json_schema (the OpenAI SDK's client.responses.parse with a pydantic
    model) and json_object constrain the output as chat's response_format does; the response
    repeats the format; another format type is a 400 naming it."""
    from typing import Literal

    from pydantic import BaseModel

    class Capital(BaseModel):
        city: Literal["Paris", "Rome"]

    client = openai_client(stack.url)
    model = tiny_llama_dir.name
    parsed = client.responses.parse(model=model, input="The capital of France?",
                                    text_format=Capital, max_output_tokens=40, temperature=0)
    assert parsed.output_parsed.city in ("Paris", "Rome")
    assert parsed.text.format.type == "json_schema" and parsed.text.format.name == "Capital"
    loose = client.responses.create(model=model, input="Some JSON, please.", temperature=0,
                                    text={"format": {"type": "json_object"}},
                                    max_output_tokens=24)
    assert loose.output_text.lstrip().startswith("{")
    refused = httpx.post(stack.url + "/v1/responses", timeout=30, json={
        "model": model, "input": "hi", "text": {"format": {"type": "yaml"}}})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "text.format.type"
