"""Fields that would change what is generated and that splitserve does not implement are
refused by name (400, code unsupported_parameter) on both endpoints, never answered with a 200
of unconstrained output; their no-op values and the fields that change nothing stay accepted.
Against a real gateway and real workers (the tiny model)."""

from __future__ import annotations

import httpx
import pytest
from gateway_processes import worker_stats

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

# (endpoint, field, a value that would change the output)
REFUSED = [
    (CHAT, "functions", [{"name": "f", "parameters": {}}]),
    (CHAT, "function_call", {"name": "f"}),
    (COMPLETIONS, "best_of", 3),
    (COMPLETIONS, "suffix", " and the end."),
    (CHAT, "reasoning_effort", "high"),
    (CHAT, "modalities", ["text", "audio"]),
    (COMPLETIONS, "use_beam_search", True),
    (CHAT, "chat_template", "{{ messages }}"),
    (CHAT, "documents", [{"title": "a", "text": "b"}]),
    (CHAT, "echo", True),
    (COMPLETIONS, "prompt_embeds", "AAAA"),
    (CHAT, "logits_processors", ["my.module:Processor"]),
]
# Values that change nothing, and fields that never change what is generated.
ACCEPTED = [
    (CHAT, {"tools": [], "tool_choice": "none", "parallel_tool_calls": False}),
    (CHAT, {"tool_choice": "auto", "response_format": {"type": "text"}, "modalities": ["text"]}),
    (CHAT, {"logit_bias": {}, "user": "u-1", "metadata": {"k": "v"}, "store": False,
            "service_tier": "auto"}),
    (CHAT, {"logit_bias": {"50": 0}, "min_tokens": 0, "skip_special_tokens": True}),
    (COMPLETIONS, {"logit_bias": {"50": 3}, "min_tokens": 1, "allowed_token_ids": [5, 6, 7],
                   "include_stop_str_in_output": True, "skip_special_tokens": False}),
    (COMPLETIONS, {"best_of": 1, "suffix": "", "user": "u-2", "use_beam_search": False}),
    (CHAT, {"echo": False, "logits_processors": []}),
    (CHAT, {"spaces_between_special_tokens": False, "skip_special_tokens": False}),
    (COMPLETIONS, {"stream": True, "stream_options": {"include_usage": True}}),
]


def _name(endpoint: str) -> str:
    return "chat" if endpoint == CHAT else "completions"


def _body(endpoint: str, model: str, extra: dict) -> dict:
    base = {"model": model, "max_tokens": 2}
    if endpoint == CHAT:
        base["messages"] = [{"role": "user", "content": "hi"}]
    else:
        base["prompt"] = "hi"
    return {**base, **extra}


@pytest.mark.parametrize(("endpoint", "field", "value"), REFUSED,
                         ids=[f"{_name(e)}-{f}-{i}" for i, (e, f, _) in enumerate(REFUSED)])
def test_a_field_that_would_change_the_output_is_refused_by_name(disagg_stack, tiny_llama_dir,
                                                                 endpoint, field, value):
    before = worker_stats(disagg_stack.decode.address).steps
    response = httpx.post(disagg_stack.url + endpoint,
                          json=_body(endpoint, tiny_llama_dir.name, {field: value}), timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and error["code"] == "unsupported_parameter"
    assert f"'{field}'" in error["message"]
    assert worker_stats(disagg_stack.decode.address).steps == before, "it reached a worker"


def test_a_function_call_in_a_chat_message_is_refused_with_its_path(disagg_stack, tiny_llama_dir):
    # (tool_calls in messages are served: tests/gateway/test_tool_requests.py)
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None,
                 "function_call": {"name": "f", "arguments": "{}"}}]
    response = httpx.post(disagg_stack.url + CHAT, timeout=30, json={
        "model": tiny_llama_dir.name, "messages": messages, "max_tokens": 2})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages.1.function_call"


@pytest.mark.parametrize(("endpoint", "extra"), ACCEPTED,
                         ids=[f"{_name(e)}-{i}" for i, (e, _) in enumerate(ACCEPTED)])
def test_no_op_values_and_fields_that_change_nothing_are_served(disagg_stack, tiny_llama_dir,
                                                                endpoint, extra):
    response = httpx.post(disagg_stack.url + endpoint,
                          json=_body(endpoint, tiny_llama_dir.name, extra), timeout=30)
    assert response.status_code == 200, response.text
    if extra.get("stream"):
        assert response.text.rstrip().endswith("data: [DONE]")
    else:
        assert response.json()["usage"]["completion_tokens"] == 2
