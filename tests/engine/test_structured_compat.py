"""Constraints read as vLLM's backends read them, compiled by llguidance against SmolLM2's
tokenizer: regex shorthand classes are ASCII, oneOf is anyOf, llama.cpp GBNF grammars are
taken, and tool schemas with keywords the engine does not implement compile (unenforced)."""

from __future__ import annotations

import json

import llguidance
import pytest
from tokenizers import Tokenizer

from engine.sampling_params import StructuredOutput
from engine.structured.grammar import GrammarCompiler, GrammarError, ascii_classes, grammar_for
from services.gateway.api.tool_parsers.hermes import HermesFormat
from services.gateway.api.tools import tool_plan


@pytest.fixture(scope="module")
def compiler(smollm2_dir) -> GrammarCompiler:
    config = json.loads((smollm2_dir / "config.json").read_text())
    return GrammarCompiler((smollm2_dir / "tokenizer.json").read_text(), config["vocab_size"],
                           [config["eos_token_id"]])


def _accepts(compiler, smollm2_dir, grammar: str, text: str) -> bool:
    ids = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json")).encode(
        text, add_special_tokens=False).ids
    matcher = llguidance.LLMatcher(compiler.tokenizer, grammar, log_level=0)
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


@pytest.mark.parametrize(("regex", "ascii"), [
    (r"\d{3}-\d{4}", "[0-9]{3}-[0-9]{4}"),
    (r"[\d-]+\s\w", r"[0-9-]+[ \t\n\r\f\v][0-9A-Za-z_]"),
    (r"\D[^\d]", "[^0-9][^0-9]"),
    (r"[]\d]\\d", r"[]0-9]\\d"),  # "]" first in a class is literal; "\\d" is "\" then "d"
    (r"[a-z&&[^aeiou]]\d", "[a-z&&[^aeiou]][0-9]"),  # nested classes
    # inside a class, a negated shorthand is a nested negated class; other escapes kept
    (r"[\D]\p{L}", r"[[^0-9]]\p{L}"),
    (r"[\s\S]", r"[ \t\n\r\f\v[^ \t\n\r\f\v]]"),
])
def test_shorthand_classes_become_ascii(regex, ascii):
    assert ascii_classes(regex) == ascii


def test_a_regex_digit_is_an_ascii_digit(compiler, smollm2_dir):
    """guided_regex `\\d{3}` let the model write three U+1FBF8 (segmented digit) characters."""
    grammar = grammar_for(StructuredOutput(regex=r"\d{3}"))
    assert _accepts(compiler, smollm2_dir, grammar, "123")
    assert not _accepts(compiler, smollm2_dir, grammar, "\U0001fbf8" * 3)
    assert not _accepts(compiler, smollm2_dir, grammar, "١٢٣")  # Arabic-Indic digits


def test_a_class_of_a_shorthand_and_its_negation_is_everything(compiler, smollm2_dir):
    r"""`[\s\S]` ("any character", a common idiom) left out U+00A0 when \S stayed Unicode in
    a class and \s became ASCII; `[^\s\S]` ("nothing") let a model write U+00A0 (a
    structured-outputs audit)."""
    anything = grammar_for(StructuredOutput(regex=r"a[\s\S]b"))
    for text in ("a b", "aXb", "a\u00a0b", "a\u2003b"):
        assert _accepts(compiler, smollm2_dir, anything, text), text
    nothing = grammar_for(StructuredOutput(regex=r"a[^\s\S]b"))
    for text in ("a b", "aXb", "a\u00a0b"):
        assert not _accepts(compiler, smollm2_dir, nothing, text), text


def test_one_of_is_read_as_any_of(compiler, smollm2_dir):
    """Branches that may overlap (disjoint ones llguidance proves so and takes anyway)."""
    schema = {"type": "object", "required": ["w"], "additionalProperties": False,
              "properties": {"w": {"oneOf": [{"type": "integer", "multipleOf": 3},
                                             {"type": "integer", "multipleOf": 5}]}}}
    so = StructuredOutput(json_schema=json.dumps(schema))
    compiler.check(so)  # was a GrammarError: "oneOf constraints are not supported"
    assert _accepts(compiler, smollm2_dir, grammar_for(so), '{"w": 9}')
    assert _accepts(compiler, smollm2_dir, grammar_for(so), '{"w": 10}')
    assert not _accepts(compiler, smollm2_dir, grammar_for(so), '{"w": 7}')


def test_a_gbnf_grammar_is_taken_as_vllm_takes_it(compiler, smollm2_dir):
    so = StructuredOutput(grammar='root ::= answer\nanswer ::= "yes" | "no"')
    compiler.check(so)
    assert _accepts(compiler, smollm2_dir, grammar_for(so), "yes")
    assert not _accepts(compiler, smollm2_dir, grammar_for(so), "maybe")
    with pytest.raises(GrammarError, match="GBNF grammar cannot be read"):
        compiler.check(StructuredOutput(grammar="root ::= (("))


def test_a_tool_schema_with_unimplemented_keywords_compiles_unenforced(compiler):
    """uniqueItems, not and unknown formats (common in MCP tool schemas) were a 400 even
    under tool_choice auto; OpenAI's non-strict functions and vLLM take them."""
    tool = {"type": "function", "function": {"name": "tag", "parameters": {
        "type": "object", "required": ["tags", "link"], "properties": {
            "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
            "link": {"type": "string", "format": "uri-reference"},
            "mode": {"not": {"const": "x"}}}}}}
    plan = tool_plan([tool], "required", HermesFormat())
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        plan.grammar(), compiler.tokenizer)
    assert not is_error, messages


def test_strict_closes_objects_the_schema_leaves_open(compiler, smollm2_dir):
    """OpenAI's strict mode requires additionalProperties false on every object; a schema
    without it, strict, let the model add `"b": "123"` beside the only key it named."""
    from types import SimpleNamespace

    from services.gateway.api.structured import structured_output

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

    def grammar(strict: bool) -> str:
        body = SimpleNamespace(response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": schema, "strict": strict}})
        return grammar_for(structured_output(body))

    assert _accepts(compiler, smollm2_dir, grammar(True), '{"a": 1}')
    assert not _accepts(compiler, smollm2_dir, grammar(True), '{"a": 1, "b": "123"}')
    assert _accepts(compiler, smollm2_dir, grammar(False), '{"a": 1, "b": "123"}')


def test_closing_objects_leaves_all_of_branches_data_and_open_objects_alone():
    from services.gateway.api.structured import closed_objects

    schema = {
        "type": "object",
        "properties": {
            "inner": {"type": "object", "properties": {"x": {"type": "string"}}},
            "open": {"type": "object", "additionalProperties": True},
            "list": {"type": "array", "items": {"properties": {"y": {}}}},
            "either": {"anyOf": [{"type": "object"}, {"type": "string"}]},
            "both": {"allOf": [{"properties": {"p": {}}}, {"properties": {"q": {}}}]},
            "choice": {"enum": [{"type": "object"}], "default": {"properties": {}}},
        },
        "$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}}},
    }
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    props = closed["properties"]
    assert props["inner"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True
    assert props["list"]["items"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert props["both"] == schema["properties"]["both"]  # closed one by one: unsatisfiable
    assert props["choice"] == schema["properties"]["choice"]  # data, not schemas
    assert closed["$defs"]["node"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the caller's schema is not changed


def test_the_grammar_cache_is_bounded_in_bytes_not_entries(monkeypatch):
    """Distinct large schemas (one client can send hundreds) must not pin their grammars: the
    cache holds at most GRAMMAR_CACHE_BYTES of grammar text, keyed by a digest, and a grammar
    over an eighth of it is not kept at all."""
    from engine.structured import grammar

    cache = grammar._GrammarCache(1 << 20)
    monkeypatch.setattr(grammar, "_cache", cache)

    def schema(i: int, padding: int) -> StructuredOutput:
        return StructuredOutput(json_schema=json.dumps({
            "type": "object", "properties": {f"k{i}": {"type": "integer",
                                                       "description": "x" * padding}}}))

    first = grammar_for(schema(0, 1000))
    assert grammar_for(schema(0, 1000)) is first  # a repeat is served from the cache
    for i in range(1, 200):
        grammar_for(schema(i, 20_000))  # ~20 KB of grammar text each
        assert cache.size <= cache.capacity
    assert len(cache._texts) < 200
    big = schema(999, 200_000)  # over an eighth of the cache: compiled each time, not kept
    size = cache.size
    grammar_for(big)
    assert cache.size == size
    assert grammar._GrammarCache.key(big) not in cache._texts
