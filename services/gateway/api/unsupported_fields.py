"""Request fields of the OpenAI API (and vLLM's extensions to it) that would change what is
generated and that splitserve does not implement: refused by name with a 400, so a client never
gets a 200 with unconstrained output it did not ask for. A value that changes nothing
(`functions: []`, `best_of` equal to `n`, ...) is accepted, and is what the
OpenAPI document offers. (`tools` and `tool_choice` are implemented: api/tools.py;
`logit_bias`, `allowed_token_ids` and `min_tokens`: engine/sampler.py's LogitProcessing.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from services.gateway.errors import APIError


class NoOp:
    """The values of one field that change nothing: a check, and the JSON schema the OpenAPI
    document gives the field (so a client generated from it sends only those)."""

    def __init__(self, check: Callable[[Any, Any], bool], schema: dict) -> None:
        self.check = check
        self.schema = {"anyOf": [{"type": "null"}, schema]}


_ABSENT = NoOp(lambda value, body: value is None, {"not": {}})
_EMPTY = NoOp(lambda value, body: value is None or value == [] or value == {},
              {"anyOf": [{"type": "array", "maxItems": 0},
                         {"type": "object", "maxProperties": 0}]})


def _one_of(*no_ops: Any) -> NoOp:
    def check(value: Any, body: Any) -> bool:
        return value is None or any(value == v and type(value) is type(v) for v in no_ops)
    unique: list[Any] = []  # JSON has one 1 where Python has 1 and 1.0
    for v in no_ops:
        if v not in unique:
            unique.append(v)
    return NoOp(check, {"enum": unique})


def _best_of_n(value: Any, body: Any) -> bool:
    # best_of == n samples n and returns n: exactly what the request does without it.
    return value is None or (type(value) is int and value == body.n)


_BEST_OF_N = NoOp(_best_of_n, {"type": "integer", "description": "must equal n"})
_TEXT_MODALITY = NoOp(lambda value, body: value is None or value == ["text"],
                      {"type": "array", "items": {"enum": ["text"]}, "minItems": 1,
                       "maxItems": 1})


# name -> (what it would do, the values that change nothing). Both endpoints unless listed
# in CHAT_ONLY or COMPLETIONS_ONLY.
REFUSED: dict[str, tuple[str, NoOp]] = {
    "functions": ("function calling", _EMPTY),
    "function_call": ("function calling", _one_of("none", "auto")),
    "best_of": ("best-of-n sampling", _BEST_OF_N),
    "suffix": ("insertion (a suffix after the completion)", _one_of("")),
    "reasoning_effort": ("reasoning effort", _ABSENT),
    "web_search_options": ("web search", _ABSENT),
    "audio": ("audio output", _ABSENT),
    "modalities": ("output modalities other than text", _TEXT_MODALITY),
    # vLLM's extensions (its structured_outputs and guided_* are implemented: api/structured.py)
    "use_beam_search": ("beam search", _one_of(False)),
    "length_penalty": ("beam search length penalty", _one_of(1, 1.0)),
    "chat_template": ("a caller-supplied chat template", _ABSENT),
    "documents": ("documents in the chat template", _EMPTY),
    "echo": ("the last message echoed before the answer", _one_of(False)),
    "prompt_embeds": ("prompts as embeddings", _ABSENT),
    "logits_processors": ("caller-named logits processors", _EMPTY),
}
CHAT_ONLY = frozenset({"functions", "function_call", "reasoning_effort",
                       "web_search_options", "audio", "modalities", "chat_template",
                       "documents", "echo"})
COMPLETIONS_ONLY = frozenset({"best_of", "suffix", "prompt_embeds"})
# In a chat message: what it would put into the prompt that the chat template here drops.
REFUSED_IN_MESSAGES: dict[str, tuple[str, NoOp]] = {
    "function_call": ("function calls in the conversation", _ABSENT),
    "audio": ("audio in the conversation", _ABSENT),
}


def fields_for(chat: bool) -> list[str]:
    excluded = COMPLETIONS_ONLY if chat else CHAT_ONLY
    return [name for name in REFUSED if name not in excluded]


def refuse_unsupported(body: Any, chat: bool) -> None:
    """Raises a 400 naming the first field `body` sets to a value splitserve cannot honour."""
    for name in fields_for(chat):
        what, no_op = REFUSED[name]
        if not no_op.check(getattr(body, name), body):
            raise _unsupported(name, what)
    for i, message in enumerate(getattr(body, "messages", None) or ()):
        for name, (what, no_op) in REFUSED_IN_MESSAGES.items():
            if not no_op.check(getattr(message, name), message):
                raise _unsupported(f"messages.{i}.{name}", what)


def _unsupported(param: str, what: str) -> APIError:
    return APIError.invalid(
        f"Unsupported parameter: '{param}' ({what}) is not implemented by this server; "
        "remove it (an unconstrained answer would not be what was asked for).",
        param=param, code="unsupported_parameter")


def document_accepted_values(schemas: dict) -> None:
    """In OpenAPI component `schemas` (of protocol.py's bodies), each refused field's schema
    becomes the values it is accepted with, and its description says why."""
    bodies = (("CompletionRequest", fields_for(chat=False)),
              ("ChatCompletionRequest", fields_for(chat=True)),
              ("ChatMessage", list(REFUSED_IN_MESSAGES)))
    for body, names in bodies:
        table = REFUSED_IN_MESSAGES if body == "ChatMessage" else REFUSED
        properties = schemas[body]["properties"]
        for name in names:
            what, no_op = table[name]
            properties[name] = {**no_op.schema, "default": None, "description":
                                f"Not implemented ({what}): any other value is refused (400)."}
