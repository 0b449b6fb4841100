"""Tool calling end to end: the real gateway, prefill and decode workers on SmolLM2-135M, and
the openai SDK. A forced call (tool_choice required or named) is always a well-formed call whose
arguments fit the function's schema; a streamed call assembles to the same call as the
non-streamed one; tool results are accepted in the conversation; no markup leaks into content."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from gateway_processes import Stack, disaggregated_stack, openai_client

from services.gateway.api.protocol import ChatCompletionRequest
from services.gateway.api.tokenizer import ModelTokenizer
from services.gateway.api.tool_parsers.hermes import HermesFormat
from services.gateway.api.tools import template_messages, tool_plan

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 16},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                   "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 1000},
                                  "b": {"type": "integer", "minimum": 0, "maximum": 1000}}}}}
TOOLS = [WEATHER, ADD]
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]
MAX_TOKENS = 72  # the longest call these schemas allow is about 55 tokens


@pytest.fixture(scope="module")
def smollm2_stack(smollm2_dir) -> Iterator[Stack]:
    with disaggregated_stack(smollm2_dir) as stack:
        yield stack


@pytest.fixture(scope="module")
def client(smollm2_stack):
    return openai_client(smollm2_stack.url)


def _valid_arguments(name: str, arguments: str) -> bool:
    args = json.loads(arguments)
    if name == "get_weather":
        return (set(args) == {"city", "unit"} and isinstance(args["city"], str)
                and len(args["city"]) <= 16 and args["unit"] in ("celsius", "fahrenheit"))
    return (set(args) == {"a", "b"} and all(
        type(args[k]) is int and 0 <= args[k] <= 1000 for k in "ab"))


def _streamed(client, model: str, **kwargs) -> dict[int, tuple[str | None, list[dict], str]]:
    """Per choice: content, calls and finish_reason of a stream, assembled as the SDK does,
    checking that every call starts with index, id, type and name and goes on with argument
    fragments only."""
    content: dict[int, str | None] = {}
    calls: dict[int, dict[int, dict]] = {}
    finish: dict[int, str] = {}
    for chunk in client.chat.completions.create(model=model, stream=True, **kwargs):
        for choice in chunk.choices:
            delta, i = choice.delta, choice.index
            content.setdefault(i, None)
            if delta.content:
                assert "<tool_call" not in delta.content and "</tool" not in delta.content
                content[i] = (content[i] or "") + delta.content
            for tc in delta.tool_calls or []:
                mine = calls.setdefault(i, {})
                if tc.index not in mine:
                    assert tc.id and tc.type == "function" and tc.function.name, tc
                    mine[tc.index] = {"id": tc.id, "name": tc.function.name,
                                      "arguments": tc.function.arguments or "", "fragments": 0}
                else:
                    assert tc.id is None and tc.function.name is None, tc
                    mine[tc.index]["arguments"] += tc.function.arguments or ""
                    mine[tc.index]["fragments"] += 1
            finish[i] = choice.finish_reason or finish.get(i)
    return {i: (content[i], [calls.get(i, {})[k] for k in sorted(calls.get(i, {}))], finish[i])
            for i in content}


def _calls(message) -> list[dict]:
    return [{"name": c.function.name, "arguments": c.function.arguments}
            for c in message.tool_calls or []]


@pytest.mark.parametrize("sampling", [{"temperature": 0},
                                      {"temperature": 1.0, "seed": 11, "n": 3}],
                         ids=["greedy", "seeded-n3"])
def test_a_streamed_tool_call_assembles_to_the_non_streamed_call(client, smollm2_dir,
                                                                 sampling):
    request = dict(messages=QUESTION, tools=TOOLS, tool_choice="required",
                   max_tokens=MAX_TOKENS, **sampling)
    whole = client.chat.completions.create(model=smollm2_dir.name, **request).choices
    streamed = _streamed(client, smollm2_dir.name, **request)
    assert sorted(streamed) == [c.index for c in whole] == list(range(sampling.get("n", 1)))
    for choice in whole:
        content, calls, finish = streamed[choice.index]
        assert choice.finish_reason == finish == "tool_calls"
        assert choice.message.content is None and content is None
        assert [{"name": c["name"], "arguments": c["arguments"]} for c in calls] == _calls(
            choice.message)
        assert len(calls) == 1 and _valid_arguments(calls[0]["name"], calls[0]["arguments"])
        assert calls[0]["fragments"] > 1, "a forced call's arguments stream as generated"
        assert calls[0]["id"].startswith("call_")
        assert choice.message.tool_calls[0].id != calls[0]["id"]


@pytest.mark.parametrize(("choice", "n"), [("required", 6), ("add", 3), ("get_weather", 3)])
def test_required_and_named_tool_choices_always_yield_a_valid_call(client, smollm2_dir, choice,
                                                                   n):
    tool_choice = choice if choice == "required" else {"type": "function",
                                                       "function": {"name": choice}}
    # n choices sample with seeds 5, 6, ... (one batch on the decode worker)
    result = client.chat.completions.create(
        model=smollm2_dir.name, messages=QUESTION, tools=TOOLS, tool_choice=tool_choice,
        max_tokens=MAX_TOKENS, temperature=1.0, seed=5, n=n)
    assert len(result.choices) == n
    for choice_result in result.choices:
        # OpenAI's and vLLM's: a call the request named ends "stop", a required one
        # "tool_calls"
        expected = "tool_calls" if choice == "required" else "stop"
        assert choice_result.finish_reason == expected, choice_result
        (call,) = _calls(choice_result.message)
        assert choice == "required" or call["name"] == choice
        assert _valid_arguments(call["name"], call["arguments"]), call
    if choice == "required":  # sampling reaches both tools, or at least different arguments
        assert len({json.dumps(_calls(c.message)) for c in result.choices}) > 1


def test_the_sdk_reply_and_a_tool_result_go_back_into_the_conversation(client, smollm2_dir):
    reply = client.chat.completions.create(
        model=smollm2_dir.name, messages=QUESTION, tools=TOOLS, max_tokens=MAX_TOKENS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0).choices[0].message
    call = reply.tool_calls[0]
    result = {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 22}'}
    answer = client.chat.completions.create(  # the SDK's own message object, sent back as is
        model=smollm2_dir.name, messages=[*QUESTION, reply, result], tools=TOOLS,
        max_tokens=8, temperature=0)
    assert "<tool_call" not in (answer.choices[0].message.content or "")
    # The prompt is that conversation, with the call and its result, as the template renders it.
    conversation = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [{
        "id": call.id, "type": "function", "function": {
            "name": "get_weather", "arguments": call.function.arguments}}]}, result]
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": conversation,
                                                "tools": TOOLS})
    plan = tool_plan(req.tools, req.tool_choice, HermesFormat())
    prompt = ModelTokenizer(smollm2_dir).encode_chat(
        template_messages(req.messages, HermesFormat(), plan, False))
    assert answer.usage.prompt_tokens == len(prompt)


def test_auto_answers_in_text_the_same_streamed_and_not(client, smollm2_dir):
    request = dict(messages=[{"role": "user", "content": "Say hello in French."}], tools=TOOLS,
                   tool_choice="auto", max_tokens=16, temperature=0)
    whole = client.chat.completions.create(model=smollm2_dir.name, **request).choices[0]
    assert _streamed(client, smollm2_dir.name, **request) == {
        0: (whole.message.content, _calls(whole.message), whole.finish_reason)}


def _responses_tools() -> list[dict]:
    """TOOLS in the Responses API's shape (no "function" wrapper)."""
    return [{"type": "function", **tool["function"]} for tool in TOOLS]


def test_the_responses_api_calls_functions_as_chat_does(client, smollm2_dir):
    """client.responses with function tools: a required call comes back as a function_call
    item (the chat completion's call, arguments valid), streamed as whole items at the end
    with the same call; the call and its output go back as input items."""
    model = smollm2_dir.name
    chat = client.chat.completions.create(model=model, messages=QUESTION, tools=TOOLS,
                                          tool_choice="required", temperature=0,
                                          max_tokens=MAX_TOKENS)
    [expected] = _calls(chat.choices[0].message)
    kwargs = dict(model=model, input=QUESTION[0]["content"], tools=_responses_tools(),
                  tool_choice="required", temperature=0, max_output_tokens=MAX_TOKENS)
    response = client.responses.create(**kwargs)
    calls = [item for item in response.output if item.type == "function_call"]
    assert [(c.name, c.arguments) for c in calls] == [(expected["name"], expected["arguments"])]
    assert _valid_arguments(calls[0].name, calls[0].arguments) and calls[0].call_id
    single = client.responses.create(parallel_tool_calls=False, **kwargs)
    assert response.parallel_tool_calls and not single.parallel_tool_calls
    assert [(c.name, c.arguments) for c in single.output if c.type == "function_call"] == [
        (expected["name"], expected["arguments"])]
    events = list(client.responses.create(stream=True, **kwargs))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.name, i.arguments) for i in done if i.type == "function_call"] == [
        (expected["name"], expected["arguments"])]
    assert events[-1].type == "response.completed"
    follow_up = client.responses.create(model=model, tools=_responses_tools(), max_output_tokens=8,
                                        temperature=0, input=[
        {"role": "user", "content": QUESTION[0]["content"]},
        {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name,
         "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "22 C, sunny"}])
    assert follow_up.status in ("completed", "incomplete") and follow_up.output


def test_parallel_tool_calls_false_returns_only_the_first_call(client, smollm2_dir):
    """The output is forced (a guided choice) to two calls; `parallel_tool_calls: false`
    returns the first only, streamed and not, as OpenAI promises."""
    two = ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
           '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>')
    for parallel, expected in ((None, ['{"a": 1, "b": 2}', '{"a": 3, "b": 4}']),
                               (False, ['{"a": 1, "b": 2}'])):
        request = dict(messages=QUESTION, tools=TOOLS, max_tokens=2 * MAX_TOKENS,
                       temperature=0, extra_body={"guided_choice": [two]},
                       **({} if parallel is None else {"parallel_tool_calls": parallel}))
        whole = client.chat.completions.create(model=smollm2_dir.name, **request).choices[0]
        assert [c["arguments"] for c in _calls(whole.message)] == expected
        assert whole.finish_reason == "tool_calls"
        _, calls, finish = _streamed(client, smollm2_dir.name, **request)[0]
        assert [c["arguments"] for c in calls] == expected and finish == "tool_calls"
