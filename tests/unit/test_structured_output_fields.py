"""The request fields that ask for structured output (OpenAI's response_format, vLLM's
structured_outputs and guided_*) read into one StructuredOutput, every malformed or
uncompilable one a 400 naming its field, and the constraint crossing protobuf unchanged.
Real llguidance, the real SmolLM2 tokenizer; the body is a plain namespace (what the pydantic
body offers is attribute access only)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine.sampling_params import SamplingParams, StructuredOutput
from services.common import convert
from services.gateway.api.preprocess import ModelLimits, Preprocessor
from services.gateway.api.request_limits import RequestLimits
from services.gateway.api.structured import (
    StructuredOutputChecker,
    structured_output,
    structured_output_field,
)
from services.gateway.api.tokenizer import ModelTokenizer
from services.gateway.errors import APIError

SMOLLM2 = Path(__file__).resolve().parents[2] / "models" / "smollm2-135m-instruct"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def body(**fields):
    names = ("response_format", "structured_outputs", "guided_json", "guided_regex",
             "guided_choice", "guided_grammar")
    return SimpleNamespace(**{n: fields.get(n) for n in names})


@pytest.mark.parametrize(("fields", "expected"), [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutput(json_object=True)),
    # strict closes the object, as OpenAI's strict mode requires of it
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     StructuredOutput(json_schema=json.dumps({**SCHEMA, "additionalProperties": False}))),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
     StructuredOutput(json_schema=json.dumps(SCHEMA))),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     StructuredOutput(json_object=True)),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput(json_schema=json.dumps(SCHEMA))),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}},
     StructuredOutput(json_schema=json.dumps(SCHEMA))),
    ({"structured_outputs": {"regex": "[0-9]+", "disable_any_whitespace": True}},
     StructuredOutput(regex="[0-9]+")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutput(choice=("yes", "no"))),
    ({"structured_outputs": {"grammar": 'start: "a"'}}, StructuredOutput(grammar='start: "a"')),
    ({"guided_json": SCHEMA}, StructuredOutput(json_schema=json.dumps(SCHEMA))),
    ({"guided_regex": "a+"}, StructuredOutput(regex="a+")),
    ({"guided_choice": ["x"]}, StructuredOutput(choice=("x",))),
    ({"guided_grammar": 'start: "b"'}, StructuredOutput(grammar='start: "b"')),
])
def test_each_field_reads_into_one_structured_output(fields, expected):
    assert structured_output(body(**fields)) == expected


@pytest.mark.parametrize(("fields", "param"), [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"guided_choice": ["a", 3]}, "guided_choice"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
])
def test_a_malformed_or_doubled_constraint_is_a_400_naming_the_field(fields, param):
    with pytest.raises(APIError) as caught:
        structured_output(body(**fields))
    assert caught.value.status == 400 and caught.value.param == param


@pytest.fixture(scope="module")
def checker():
    return StructuredOutputChecker(ModelTokenizer(SMOLLM2))


@pytest.mark.parametrize(("so", "problem"), [
    (StructuredOutput(json_schema='{"type": "foo"}'), "Invalid type: foo"),
    (StructuredOutput(json_schema='{"properties": {"a": {"$ref": "#/$defs/x"}}}'), "/$defs/x"),
    (StructuredOutput(regex="[a-"), "unclosed character class"),
    (StructuredOutput(grammar="start: undefined_rule"), "undefined_rule"),
])
def test_a_constraint_that_does_not_compile_is_a_400_naming_the_problem(checker, so, problem):
    with pytest.raises(APIError) as caught:
        checker.check(so, 49152, param="guided_json")
    error = caught.value
    assert error.status == 400 and error.param == "guided_json"
    assert error.code == "invalid_structured_output" and problem in error.message


def test_compilable_constraints_pass_the_check(checker):
    for fields in ({"guided_json": SCHEMA}, {"guided_choice": ['say "hi"', "a\\b\n"]},
                   {"guided_grammar": 'start: "x" | %json {"type": "object"}'},
                   {"response_format": {"type": "json_object"}}):
        param, so = structured_output_field(body(**fields))
        checker.check(so, 49152, param=param)


@pytest.mark.parametrize("so", [
    StructuredOutput(json_schema=json.dumps(SCHEMA)), StructuredOutput(json_object=True),
    StructuredOutput(regex="[0-9]{3}"), StructuredOutput(choice=("yes", "no")),
    StructuredOutput(grammar='start: "a"'),
])
def test_the_constraint_crosses_protobuf_unchanged(so):
    params = SamplingParams(max_tokens=4, seed=1, structured_output=so)
    assert convert.sampling_from_pb(convert.sampling_to_pb(params)) == params


def test_no_constraint_stays_none_across_protobuf():
    params = SamplingParams(max_tokens=4, seed=1)
    pb = convert.sampling_to_pb(params)
    assert not pb.HasField("structured_output")
    assert convert.sampling_from_pb(pb).structured_output is None


@pytest.mark.parametrize("so", [
    StructuredOutput(), StructuredOutput(regex="a", choice=("b",)), StructuredOutput(regex=""),
    StructuredOutput(choice=("",)),
])
def test_sampling_params_refuse_a_structured_output_without_exactly_one_kind(so):
    with pytest.raises(ValueError, match="structured_output"):
        SamplingParams(structured_output=so).validate(100)


def test_the_grpc_front_door_checks_the_constraint_it_is_given(checker):
    """Preprocessor.token_prompt (the gateway's gRPC Generate) compiles a SamplingParams'
    constraint too; a good one passes through untouched."""
    preprocessor = Preprocessor(ModelTokenizer(SMOLLM2), RequestLimits())
    limits = ModelLimits(vocab_size=49152, max_model_len=2048)
    bad = SamplingParams(max_tokens=4, structured_output=StructuredOutput(regex="(a"))
    with pytest.raises(APIError) as caught:
        preprocessor.token_prompt("r", [1, 2, 3], bad, (), limits)
    assert caught.value.param == "sampling.structured_output"
    good = SamplingParams(max_tokens=4, structured_output=StructuredOutput(choice=("a", "b")))
    spec = preprocessor.token_prompt("r", [1, 2, 3], good, (), limits)
    assert spec.params.structured_output == good.structured_output


def test_the_grpc_front_door_takes_allowed_token_ids_once_each_as_http_does():
    preprocessor = Preprocessor(ModelTokenizer(SMOLLM2), RequestLimits())
    limits = ModelLimits(vocab_size=49152, max_model_len=2048)
    params = SamplingParams(max_tokens=4, allowed_token_ids=(7, 3, 7, 3, 9) * 1000)
    spec = preprocessor.token_prompt("r", [1, 2, 3], params, (), limits)
    assert spec.params.allowed_token_ids == (7, 3, 9)  # first-seen order


def test_warming_the_checker_builds_its_tokenizer_before_any_request():
    """The gateway's start (structured_outputs_warmup): the tokenizer a first constrained
    request would build (about 0.3 s of its first token) exists before that request comes."""
    fresh = StructuredOutputChecker(ModelTokenizer(SMOLLM2))
    fresh.warm(49152)
    assert fresh._compilers[49152]._tokenizer is not None


def test_the_gateway_warms_its_checker_at_start_unless_told_not_to(monkeypatch):
    """Gateway.start submits the warm-up to a tokenizer thread; false leaves it to the first
    request. (No worker answers: the pool keeps polling, which start does not wait for.)"""
    import asyncio

    from services.gateway.config import GatewayConfig
    from services.gateway.gateway import Gateway

    async def started(warm: bool) -> tuple[list[int], int]:
        gateway = Gateway(GatewayConfig(model=str(SMOLLM2), prefill=("127.0.0.1:9",),
                                        decode=("127.0.0.1:9",), structured_outputs_warmup=warm))
        warmed: list[int] = []
        monkeypatch.setattr(gateway.preprocessor.structured, "warm", warmed.append)
        await gateway.start()
        await gateway.close()
        gateway.tokenizer_pool.shutdown(wait=True)
        return warmed, gateway.limits().vocab_size

    warmed, vocab = asyncio.run(started(True))
    assert warmed == [vocab]
    assert asyncio.run(started(False))[0] == []
