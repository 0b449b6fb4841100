"""The Hermes tool-call parser as a specification: content and calls split out of model text,
malformed markup passed through as text, the same result however the text is split between
pushes; the stream deltas and the whole message built from it agree; the grammar that forces a
call accepts exactly well-formed calls (compiled by llguidance against SmolLM2's tokenizer)."""

from __future__ import annotations

import json

import llguidance
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.gateway.api.tool_output import ToolCallStream, finish_reason, tool_message
from services.gateway.api.tool_parsers import tool_format
from services.gateway.api.tool_parsers.base import ParsedCall
from services.gateway.api.tool_parsers.hermes import HermesFormat, HermesParser
from services.gateway.api.tools import tool_plan

NAMES = frozenset({"get_weather", "add"})
WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ADD = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
    "additionalProperties": False}}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
             "required": ["a", "b"], "additionalProperties": False}}}]


def parse(text: str, splits: list[int] | None = None) -> tuple[str, list[ParsedCall]]:
    parser = HermesParser(NAMES)
    cuts = sorted(set(splits or []))
    pieces = []
    start = 0
    for cut in [*cuts, len(text)]:
        pieces += parser.push(text[start:cut])
        start = cut
    pieces += parser.finish()
    return "".join(p.text for p in pieces), [c for p in pieces for c in p.calls]


def test_text_then_a_call_gives_the_text_as_content_and_the_call_parsed():
    content, calls = parse("Let me look that up.\n" + WEATHER)
    assert content == "Let me look that up."
    assert calls == [ParsedCall("get_weather", '{"city": "Paris"}')]


def test_several_calls_in_order_with_no_markup_or_whitespace_in_content():
    content, calls = parse(WEATHER + "\n" + ADD + "\n")
    assert content == ""
    assert [c.name for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[1].arguments) == {"a": 1, "b": 2}


def test_a_json_list_of_calls_in_one_block_is_several_calls():
    block = ('<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}, '
             '{"name": "get_weather", "arguments": {"city": "Oslo"}}]</tool_call>')
    assert [c.name for c in parse(block)[1]] == ["add", "get_weather"]


@pytest.mark.parametrize("text", [
    "<tool_call>\n{not json}\n</tool_call>",
    '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',  # no such tool
    '<tool_call>\n{"name": "add", "arguments": [1, 2]}\n</tool_call>',
    '<tool_call>\n["add"]\n</tool_call>',
    "I like <tool_call tags, and < signs.",
])
def test_malformed_markup_passes_through_as_text(text):
    assert parse(text) == (text, [])


def test_malformed_block_keeps_the_text_around_it():
    text = "Hi there\n<tool_call>oops</tool_call> and on."
    assert parse(text) == (text, [])


def test_an_unclosed_call_at_the_end_is_a_call_if_its_json_is_whole():
    content, calls = parse('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}')
    assert (content, [c.name for c in calls]) == ("", ["add"])
    cut = '<tool_call>\n{"name": "add", "argu'
    assert parse(cut) == (cut, [])


def test_arguments_written_as_a_json_string_are_read_as_the_object():
    block = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
    assert parse(block)[1] == [ParsedCall("add", '{"a": 1, "b": 2}')]


TEXTS = ["Sure.\n" + WEATHER, WEATHER + "\n" + ADD, "a <tool b\n\n" + ADD + " tail",
         "x<tool_call>bad</tool_call>\n" + WEATHER + "\n\n", "plain text  \n", "<tool_ca"]


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(TEXTS), st.lists(st.integers(min_value=0, max_value=200), max_size=12))
def test_the_result_does_not_depend_on_how_the_text_arrives(text, splits):
    assert parse(text, [s % (len(text) + 1) for s in splits]) == parse(text)


def _assemble(deltas: list[dict]) -> tuple[str, list[dict]]:
    """content and calls from stream deltas, as the openai SDK accumulates them; checks that a
    call's first delta carries index, id, type and name, and the later ones arguments only."""
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            if "id" in tc:
                assert tc["index"] not in calls and tc["type"] == "function"
                assert tc["id"].startswith("call_") and tc["function"]["arguments"] == ""
                calls[tc["index"]] = {"name": tc["function"]["name"], "arguments": ""}
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


def _stream(plan, text: str, cuts: list[int]) -> list[dict]:
    stream = ToolCallStream(plan)
    deltas, start = [], 0
    for cut in sorted(set(cuts)):
        deltas += stream.deltas(text[start:cut], final=False)
        start = cut
    return deltas + stream.deltas(text[start:], final=True)


def _message_parts(message: dict) -> tuple[str, list[dict]]:
    return message["content"] or "", [{"name": c["function"]["name"],
                                       "arguments": c["function"]["arguments"]}
                                      for c in message.get("tool_calls", [])]


FORCED_TEXTS = [WEATHER, ADD, '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": {"c": '
                '"}"}}}\n</tool_call>', '<tool_call>\n{"name": "get_weather", "arguments": '
                '{"city": "Pa', '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}']


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([("auto", t) for t in TEXTS] + [("required", t) for t in FORCED_TEXTS]),
       st.lists(st.integers(min_value=0, max_value=200), max_size=12))
def test_stream_deltas_assemble_to_the_whole_message(case, cuts):
    choice, text = case
    plan = tool_plan(TOOLS, choice, HermesFormat())
    deltas = _stream(plan, text, [c % (len(text) + 1) for c in cuts])
    assert _assemble(deltas) == _message_parts(tool_message(plan, text))


def test_a_forced_call_streams_its_arguments_as_they_are_generated():
    plan = tool_plan(TOOLS, "required", HermesFormat())
    stream = ToolCallStream(plan)
    assert stream.deltas('<tool_call>\n{"name": "add", "argu', final=False) == []
    start, first = stream.deltas('ments": {"a": 1', final=False)
    assert start["tool_calls"][0]["function"] == {"name": "add", "arguments": ""}
    assert first == {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1'}}]}
    # Whitespace and a "}" that may close the call wait for what follows them.
    (second,) = stream.deltas(", ", final=False)
    assert second["tool_calls"][0]["function"]["arguments"] == ","
    third = stream.deltas('"b": 2}', final=False)
    assert third == [{"tool_calls": [{"index": 0, "function": {"arguments": ' "b": 2'}}]}]
    rest = stream.deltas('}\n</tool_call>', final=True)
    assert _assemble([start, first, second, *third, *rest])[1] == [
        {"name": "add", "arguments": '{"a": 1, "b": 2}'}]
    assert finish_reason("stop", stream.num_calls, plan) == "tool_calls"
    assert finish_reason("length", stream.num_calls, plan) == "length"
    named = tool_plan(TOOLS, {"type": "function", "function": {"name": "add"}}, HermesFormat())
    assert finish_reason("stop", 1, named) == "stop"  # OpenAI's and vLLM's for a named call


def test_a_call_cut_by_the_requests_stop_string_or_token_does_not_ask_for_results():
    """A required call cut inside its arguments by a stop string said "tool_calls" over
    arguments that were not JSON (a tools audit): only a choice that stopped by itself does."""
    plan = tool_plan(TOOLS, "required", HermesFormat())
    stream = ToolCallStream(plan)
    deltas = stream.deltas('<tool_call>\n{"name": "add", "arguments": {"a": ', final=True)
    assert _assemble(deltas)[1] == [{"name": "add", "arguments": '{"a":'}]  # not JSON
    assert finish_reason("stop", stream.num_calls, plan, stop_reason="Paris") == "stop"
    assert finish_reason("stop", stream.num_calls, plan, stop_reason=42) == "stop"
    assert finish_reason("stop", stream.num_calls, plan, stop_reason=None) == "tool_calls"
    # Under auto a cut call is text; whole calls before a stop string still ask for results
    # (a ReAct-style stop after the call; a review caught "stop" there).
    auto = tool_plan(TOOLS, "auto", HermesFormat())
    assert finish_reason("stop", 1, auto, stop_reason="\nObservation:") == "tool_calls"


def test_a_forced_call_cut_short_keeps_what_there_is_of_its_arguments():
    plan = tool_plan(TOOLS, "required", HermesFormat())
    message = tool_message(plan, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "get_weather",
                                                    "arguments": '{"city": "Pa'}


def test_a_message_with_only_calls_has_null_content():
    message = tool_message(tool_plan(TOOLS, "required", HermesFormat()), WEATHER)
    assert message["content"] is None and len(message["tool_calls"]) == 1
    assert tool_message(tool_plan(TOOLS, "auto", HermesFormat()), "")["content"] == ""


@pytest.fixture(scope="module")
def llg_tokenizer(smollm2_dir):
    return llguidance.LLTokenizer((smollm2_dir / "tokenizer.json").read_text())


def _accepts(llg_tokenizer, smollm2_dir, grammar: str, text: str) -> bool:
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json")).encode(
        text, add_special_tokens=False).ids
    matcher = llguidance.LLMatcher(llg_tokenizer, llguidance.grammar_from("lark", grammar),
                                   log_level=0)
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


def test_the_forced_call_grammar_accepts_only_a_valid_call_of_the_named_tool(llg_tokenizer,
                                                                               smollm2_dir):
    named = tool_plan(TOOLS, {"type": "function", "function": {"name": "add"}}, HermesFormat())
    grammar = named.grammar()
    assert _accepts(llg_tokenizer, smollm2_dir, grammar, ADD)
    assert not _accepts(llg_tokenizer, smollm2_dir, grammar, WEATHER)  # another tool
    assert not _accepts(llg_tokenizer, smollm2_dir, grammar, ADD.replace("1", '"1"'))  # type
    assert not _accepts(llg_tokenizer, smollm2_dir, grammar, ADD.replace(', "b": 2', ""))
    either = tool_plan(TOOLS, "required", HermesFormat()).grammar()
    assert _accepts(llg_tokenizer, smollm2_dir, either, WEATHER)
    assert _accepts(llg_tokenizer, smollm2_dir, either, ADD)
    assert not _accepts(llg_tokenizer, smollm2_dir, either, "Sure! " + ADD)


def test_tool_call_parser_names_are_checked():
    assert isinstance(tool_format("hermes"), HermesFormat)
    assert tool_format("none") is None
    with pytest.raises(ValueError, match="--tool-call-parser must be one of hermes, none"):
        tool_format("mistral")


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(TEXTS), st.lists(st.integers(min_value=0, max_value=200), max_size=12))
def test_parallel_tool_calls_false_keeps_only_the_first_call_streamed_or_not(text, cuts):
    """What the one-call parser returns is the first of the calls the plain parser finds, the
    same content, and streaming agrees with the whole message."""
    single = tool_plan(TOOLS, "auto", HermesFormat(), parallel=False)
    content, calls = _message_parts(tool_message(single, text))
    all_content, all_calls = _message_parts(tool_message(tool_plan(TOOLS, "auto", HermesFormat()),
                                                         text))
    assert (content, calls) == (all_content, all_calls[:1])
    assert _assemble(_stream(single, text, [c % (len(text) + 1) for c in cuts])) == (content, calls)


def test_parallel_tool_calls_false_drops_the_second_call_of_a_json_list_and_later_blocks():
    single = tool_plan(TOOLS, "auto", HermesFormat(), parallel=False)
    block = ('<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}, '
             '{"name": "get_weather", "arguments": {"city": "Oslo"}}]</tool_call>')
    assert [c["function"]["name"] for c in tool_message(single, block)["tool_calls"]] == ["add"]
    message = tool_message(single, "Checking.\n" + WEATHER + "\n" + ADD)
    assert message["content"] == "Checking."
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]


@pytest.mark.parametrize("parameters", [None, {}], ids=["omitted", "empty"])
def test_a_function_without_parameters_is_forced_to_empty_arguments(llg_tokenizer, smollm2_dir,
                                                                  parameters):
    function = {"name": "now"} if parameters is None else {"name": "now",
                                                           "parameters": parameters}
    grammar = tool_plan([{"type": "function", "function": function}], "required",
                        HermesFormat()).grammar()
    call = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    assert _accepts(llg_tokenizer, smollm2_dir, grammar, call)
    assert not _accepts(llg_tokenizer, smollm2_dir, grammar,
                        call.replace("{}", '{"argument": "12:00"}'))


def test_tool_parameters_with_refs_and_defs_constrain_the_call(llg_tokenizer, smollm2_dir):
    """Parameters that use `$defs` and `$ref` (pydantic's nested models, as
    openai.pydantic_function_tool writes them) were refused: embedded in the call's schema,
    "#/$defs/X" pointed at its root. Each tool's definitions now travel with it, two tools'
    same-named definitions kept apart, and "#" is the tool's own parameters."""
    place = {"type": "object", "properties": {"where": {"$ref": "#/$defs/Place"}},
             "required": ["where"], "additionalProperties": False,
             "$defs": {"Place": {"type": "object", "additionalProperties": False,
                                 "properties": {"city": {"type": "string"},
                                                "units": {"$ref": "#/$defs/Units"}},
                                 "required": ["city", "units"]},
                       "Units": {"enum": ["C", "F"]}}}
    count = {"type": "object", "properties": {"n": {"$ref": "#/definitions/Place"},
                                              "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
             "required": ["n", "next"], "additionalProperties": False,
             "definitions": {"Place": {"type": "integer"}}}
    tools = [{"type": "function", "function": {"name": "weather", "parameters": place}},
             {"type": "function", "function": {"name": "count", "parameters": count}}]
    grammar = tool_plan(tools, "required", HermesFormat()).grammar()

    def call(name: str, arguments: dict) -> str:
        return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"

    ok = [call("weather", {"where": {"city": "Paris", "units": "C"}}),
          call("count", {"n": 1, "next": {"n": 2, "next": None}})]
    bad = [call("weather", {"where": {"city": "Paris", "units": "K"}}),
           call("weather", {"where": {"city": "Paris"}}),
           call("count", {"n": "one", "next": None}),
           call("count", {"n": 1, "next": {"n": 2}})]
    assert all(_accepts(llg_tokenizer, smollm2_dir, grammar, text) for text in ok)
    assert not any(_accepts(llg_tokenizer, smollm2_dir, grammar, text) for text in bad)


@pytest.mark.parametrize("cut", ["<tool", "<tool_call>", '<tool_call>\n{"na',
                                 '<tool_call>\n{"name": "get_'])
def test_a_forced_call_cut_before_its_arguments_leaves_no_markup_in_content(cut):
    """max_tokens 8 under tool_choice required: the markup went out as content, whole and
    streamed (a structured-outputs audit)."""
    plan = tool_plan(TOOLS, "required", HermesFormat())
    message = tool_message(plan, cut)
    assert message == {"role": "assistant", "content": ""}
    stream = ToolCallStream(plan)
    assert stream.deltas(cut, final=False) + stream.deltas("", final=True) == []
    # not forced (auto), the same text is the model's own: content, as before
    auto = tool_message(tool_plan(TOOLS, "auto", HermesFormat()), cut)
    assert auto["content"] == cut


def test_a_strict_functions_forced_arguments_name_no_other_keys():
    """strict: true closes the function's objects in the forcing grammar, as response_format's
    strict schemas (a strict get_weather(city) was called with {"city", "temperature"})."""
    strict_tools = [{"type": "function", "function": {
        "name": "get_weather", "strict": True,
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"},
            "where": {"type": "object", "properties": {"lat": {"type": "number"}}}},
            "required": ["city"]}}}]
    def arguments_schema(tools) -> dict:
        grammar = tool_plan(tools, "required", HermesFormat()).grammar()
        return json.loads(grammar.split("call: %json ", 1)[1])["$defs"]["tool0"]

    closed = arguments_schema(strict_tools)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["where"]["additionalProperties"] is False
    loose_tools = [{"type": "function", "function": {**strict_tools[0]["function"],
                                                     "strict": False}}]
    assert "additionalProperties" not in json.dumps(arguments_schema(loose_tools))
