"""Tool definitions, tool calls and tool results going into the prompt: rendered through the
template's own tool support when it has one, else as Hermes markup in plain turns (SmolLM2's
template); malformed tools and tool messages are a 400 naming the field, before any worker is
touched (the real gateway and workers, on the tiny model)."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from gateway_processes import worker_stats
from hypothesis import given, settings
from hypothesis import strategies as st

from services.gateway.api.protocol import ChatCompletionRequest
from services.gateway.api.tokenizer import ModelTokenizer
from services.gateway.api.tool_parsers.hermes import HermesFormat
from services.gateway.api.tools import template_messages, tool_plan
from services.gateway.errors import APIError

CHAT = "/v1/chat/completions"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "3 C, snow"},
]


def _request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", **fields})


def test_smollm2_prompt_carries_tools_calls_and_results_as_hermes_markup(smollm2_dir):
    tokenizer = ModelTokenizer(smollm2_dir)
    assert not tokenizer.template_renders_tools
    req = _request(messages=CONVERSATION, tools=[WEATHER])
    plan = tool_plan(req.tools, req.tool_choice, HermesFormat())
    prompt = tokenizer.render_chat(template_messages(req.messages, HermesFormat(), plan, False))
    assert prompt.startswith("<|im_start|>system\n# Tools\n")
    assert json.dumps(WEATHER) in prompt
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
            '"Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Oslo"}}\n</tool_call><|im_end|>') in prompt
    # Consecutive results: one user turn, in order.
    assert ("<|im_start|>user\n<tool_response>\n22 C, sunny\n</tool_response>\n<tool_response>"
            "\n3 C, snow\n</tool_response><|im_end|>\n<|im_start|>assistant\n") in prompt


def test_tool_choice_none_leaves_the_tools_out_of_the_prompt(smollm2_dir):
    tokenizer = ModelTokenizer(smollm2_dir)
    req = _request(messages=CONVERSATION[:1], tools=[WEATHER], tool_choice="none")
    assert tool_plan(req.tools, req.tool_choice, HermesFormat()) is None
    prompt = tokenizer.render_chat(template_messages(req.messages, HermesFormat(), None, False))
    assert "get_weather" not in prompt and "You are a helpful AI assistant" in prompt


NATIVE_TEMPLATE = (
    "{% if tools %}TOOLS:{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}[{{ m.role }}]"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }} "
    "{{ c.function.arguments | tojson }};{% endfor %}{% endif %}"
    "{% if m.tool_call_id %}RESULT {{ m.tool_call_id }}: {% endif %}{{ m.content }}\n"
    "{% endfor %}")


def test_a_template_with_tool_support_gets_tools_and_calls_natively(smollm2_dir, tmp_path):
    shutil.copy(smollm2_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {**config, "chat_template": NATIVE_TEMPLATE}))
    tokenizer = ModelTokenizer(tmp_path)
    assert tokenizer.template_renders_tools
    req = _request(messages=CONVERSATION[:3], tools=[WEATHER])
    plan = tool_plan(req.tools, req.tool_choice, HermesFormat())
    messages = template_messages(req.messages, HermesFormat(), plan, native=True)
    prompt = tokenizer.render_chat(messages, tools=plan.openai_tools())
    assert prompt == (f"TOOLS:{json.dumps([WEATHER])}\n[user]Weather in Paris and Oslo?\n"
                      '[assistant]CALL get_weather {"city": "Paris"};'
                      'CALL get_weather {"city": "Oslo"};\n'
                      "[tool]RESULT call_1: 22 C, sunny\n")


BAD = [
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]},
     "tools.0.function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "object"}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "array"}}}]}, "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "str"}}}}}]},
     "tools.0.function.parameters.properties.x.type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "required": "x"}}}]}, "tools.0.function.parameters.required"),
    # A schema the grammar engine cannot compile, even where no call is forced (auto).
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "(unclosed"}}}}}]},
     "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "tool", "content": "22 C"}]}, "messages.0.tool_call_id"),
    ({"messages": [{"role": "user", "content": "hi", "tool_call_id": "c"}]},
     "messages.0.tool_call_id"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": [
        CONVERSATION[1]["tool_calls"][0]]}]}, "messages.0.tool_calls"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                         "function": {"name": "f"}}]}]},
     "messages.0.tool_calls.0"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
        "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages.0.tool_calls.0.function.arguments"),
]


@pytest.mark.parametrize(("extra", "param"), BAD, ids=[p for _, p in BAD])
def test_malformed_tools_and_tool_messages_are_a_400_naming_the_field(disagg_stack,
                                                                     tiny_llama_dir, extra,
                                                                     param):
    before = worker_stats(disagg_stack.decode.address).steps
    body = {"model": tiny_llama_dir.name, "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}], **extra}
    response = httpx.post(disagg_stack.url + CHAT, json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text
    assert worker_stats(disagg_stack.decode.address).steps == before, "it reached a worker"


def test_a_conversation_with_tool_calls_and_results_is_served(disagg_stack, tiny_llama_dir):
    # Without `tools` (the tiny model's 512-token context): the history alone is rendered.
    response = httpx.post(disagg_stack.url + CHAT, timeout=30, json={
        "model": tiny_llama_dir.name, "messages": CONVERSATION, "max_tokens": 3})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["role"] == "assistant"


def test_a_gateway_with_tool_calling_off_refuses_tools(gateway_factory, disagg_workers,
                                                       tiny_llama_dir):
    prefill, decode = disagg_workers
    gateway = gateway_factory("--prefill", prefill.address, "--decode", decode.address,
                              "--tool-call-parser", "none")
    body = {"model": tiny_llama_dir.name, "max_tokens": 2, "tools": [WEATHER],
            "messages": [{"role": "user", "content": "hi"}]}
    response = httpx.post(f"http://{gateway.address}{CHAT}", json=body, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "unsupported_parameter"
    body["tool_choice"] = "none"  # asks for no tool calling: served
    assert httpx.post(f"http://{gateway.address}{CHAT}", json=body, timeout=30).status_code == 200


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.sampled_from(["type", "function", "name", "parameters",
                                                        "properties", "required", "id",
                                                        "arguments", "x"]), inner, max_size=4),
                     max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(tools=_JSON, tool_choice=_JSON, calls=_JSON)
def test_any_json_in_the_tool_fields_is_a_plan_or_a_400(tools, tool_choice, calls):
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "c", "content": "r"}]
    req = _request(messages=messages)
    try:
        plan = tool_plan(tools, tool_choice, HermesFormat())
        template_messages(req.messages, HermesFormat(), plan, native=False)
    except APIError as exc:
        assert exc.status == 400 and exc.body()["error"]["param"]
