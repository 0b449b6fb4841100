"""Structured outputs at the edge: the request fields that constrain generation (OpenAI's
`response_format`, vLLM's `structured_outputs` and its older `guided_*` fields) read into one
engine StructuredOutput, and compiled here against the model's tokenizer, so a constraint the
engine could not build is a 400 naming the problem before any worker sees the request."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from typing import Any

from engine.sampling_params import StructuredOutput
from engine.structured.grammar import GrammarCompiler, GrammarError
from engine.structured.state import GrammarState
from services.gateway.errors import APIError

log = logging.getLogger(__name__)

# vLLM's structured_outputs keys -> StructuredOutput fields. Its other keys tune how vLLM
# builds the grammar (whitespace, backend fallback) and change nothing here: ignored.
_VLLM_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice",
              "grammar": "grammar", "json_object": "json_object"}
_VLLM_IGNORED = frozenset({"disable_fallback", "disable_any_whitespace",
                           "disable_additional_properties", "whitespace_pattern", "backend"})
_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex",
           "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_output(body: Any) -> StructuredOutput | None:
    """The constraint a request body asks for, or None. Raises a 400 (APIError) for a malformed
    field or for two fields that both constrain (which one should win is not ours to guess).
    Only the shape is checked here; StructuredOutputChecker checks that it compiles."""
    found = structured_output_field(body)
    return found[1] if found else None


def structured_output_field(body: Any) -> tuple[str, StructuredOutput] | None:
    """structured_output() with the name of the field that asked for it (for error params)."""
    found: list[tuple[str, StructuredOutput]] = []
    response_format = getattr(body, "response_format", None)
    if response_format is not None:
        so = _from_response_format(response_format)
        if so is not None:
            found.append(("response_format", so))
    vllm = getattr(body, "structured_outputs", None)
    if vllm is not None:
        found += _from_vllm(vllm)
    for name, field in _GUIDED.items():
        value = getattr(body, name, None)
        if value is not None:
            found.append((name, _field(field, value, name)))
    if len(found) > 1:
        names = " and ".join(f"'{name}'" for name, _ in found)
        raise APIError.invalid(f"Only one structured output constraint per request; {names} "
                               "are both set.", param=found[1][0])
    return found[0] if found else None


def _from_response_format(value: Any) -> StructuredOutput | None:
    param = "response_format"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise APIError.invalid("response_format must be an object with a 'type'", param=param)
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise APIError.invalid("response_format.json_schema must be an object with the "
                                   "schema under 'schema'", param="response_format.json_schema")
        schema = spec.get("schema")
        if schema is None:  # OpenAI allows a named format without a schema: any JSON object
            return StructuredOutput(json_object=True)
        # The output always follows the schema. `strict` also closes its objects, as OpenAI's
        # strict mode requires of them: without it a model added keys the schema never named.
        if spec.get("strict") is True:
            schema = closed_objects(schema)
        return _field("json_schema", schema, "response_format.json_schema.schema")
    raise APIError.invalid(f"response_format type {kind!r} is not supported; use 'text', "
                           "'json_object' or 'json_schema'", param="response_format.type")


# Where a schema holds schemas: one, a list of them, or a map of names to them.
_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
        "propertyNames", "unevaluatedItems")
_LIST = ("anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_OPEN_BY = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed_objects(schema: Any, in_all_of: bool = False) -> Any:
    """`schema` with `additionalProperties: false` on every object schema that says nothing
    of other keys. Not on allOf's members, nor on a schema with an allOf: closed one by one,
    branches that each name some of the keys would refuse every object. Data (enum, const,
    default, examples) is left as it is."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    kind = out.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind) or (
        "properties" in out)
    if (is_object and not in_all_of and "allOf" not in out
            and not any(key in out for key in _OPEN_BY)):
        out["additionalProperties"] = False
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
        elif key == "items" and isinstance(out.get(key), list):  # older drafts' tuples
            out[key] = [closed_objects(item) for item in out[key]]
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(item) for item in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [closed_objects(item, in_all_of=True) for item in out["allOf"]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(item) for name, item in out[key].items()}
    return out


def _from_vllm(value: Any) -> list[tuple[str, StructuredOutput]]:
    if not isinstance(value, dict):
        raise APIError.invalid("structured_outputs must be an object", param="structured_outputs")
    found = []
    for key, item in value.items():
        param = f"structured_outputs.{key}"
        if key in _VLLM_IGNORED:
            continue
        if key not in _VLLM_KEYS:
            raise APIError.invalid(f"structured_outputs key {key!r} is not supported; use one "
                                   f"of {', '.join(_VLLM_KEYS)}", param=param)
        if item is None or item is False:
            continue
        found.append((param, _field(_VLLM_KEYS[key], item, param)))
    return found


def _field(kind: str, value: Any, param: str) -> StructuredOutput:
    if kind == "json_schema":
        if isinstance(value, str):  # vLLM takes the schema as an object or as JSON text
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise APIError.invalid(f"{param} is not valid JSON: {exc}", param=param) from None
            except RecursionError:
                raise APIError.invalid(f"{param} is nested too deeply", param=param) from None
        if not isinstance(value, dict):
            raise APIError.invalid(f"{param} must be a JSON schema object", param=param)
        return StructuredOutput(json_schema=json.dumps(value))
    if kind == "json_object":
        if value is not True:
            raise APIError.invalid(f"{param} must be true", param=param)
        return StructuredOutput(json_object=True)
    if kind == "choice":
        if (not isinstance(value, list) or not value
                or not all(isinstance(c, str) and c for c in value)):
            raise APIError.invalid(f"{param} must be a non-empty list of non-empty strings",
                                   param=param)
        return StructuredOutput(choice=tuple(value))
    if not isinstance(value, str) or not value:
        raise APIError.invalid(f"{param} must be a non-empty string", param=param)
    return StructuredOutput(**{kind: value})


class StructuredOutputChecker:
    """Compiles constraints against the gateway's tokenizer (built on first use, about 0.3 s;
    one per vocabulary size). Thread-safe: called from the gateway's tokenizer threads."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer  # a ModelTokenizer: its tokenizers backend is serialized
        self._compilers: dict[int, GrammarCompiler] = {}
        self._lock = threading.Lock()

    def warm(self, vocab_size: int) -> None:
        """Builds the tokenizer for `vocab_size` now (gateway start), through one check."""
        try:
            self.check(StructuredOutput(regex="a"), vocab_size)
        except Exception:  # noqa: BLE001 - the first real request reports whatever this hit
            log.warning("structured outputs not warmed up", exc_info=True)

    def check(self, so: StructuredOutput, vocab_size: int, param: str = "response_format") -> None:
        try:
            self._compiler(vocab_size).check(so)
        except GrammarError as exc:
            raise APIError.invalid(f"Invalid structured output: {exc}", param=param,
                                   code="invalid_structured_output") from None

    def incomplete(self, so: StructuredOutput, vocab_size: int,
                   token_ids: Sequence[int]) -> str | None:
        """Why an output that ended at EOS (`token_ids`, the EOS left out) does not complete
        its constraint, or None when it does. A constraint that compiles but can never
        complete (an empty language, a $ref cycle with no way out, a special token's text)
        leaves the worker only EOS to offer, and the output ends cut short: it must not pass
        for a finished one. 0.9 ms for a 30-key schema's 290 tokens."""
        state = GrammarState(self._compiler(vocab_size), so, token_ids)  # the workers' replay
        if state.failed is not None:
            return f"Invalid structured output: {state.failed}."
        if state.matcher.is_accepting() or state.matcher.is_stopped():
            return None
        return ("Invalid structured output: the output reached a point where the constraint "
                "allows nothing more, before it was complete (a constraint that can never be "
                "completed, e.g. a special token's text or a reference cycle with no way out).")

    def _compiler(self, vocab_size: int) -> GrammarCompiler:
        with self._lock:
            compiler = self._compilers.get(vocab_size)
            if compiler is None:
                compiler = self._compilers[vocab_size] = GrammarCompiler(
                    self._tokenizer.backend.to_str(), vocab_size, ())
            return compiler
