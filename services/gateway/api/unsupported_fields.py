"""Request fields of the OpenAI API (and vLLM's extensions to it) that would change what is
generated and that splitserve does not implement: refused by name with a 400, so a client never
gets a 200 with unconstrained output it did not ask for. A value that changes nothing (`tools:
[]`, `tool_choice: "none"`, `logit_bias: {}`, `best_of` equal to `n`, ...) is accepted."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from services.gateway.errors import APIError


def _absent(value: Any, body: Any) -> bool:
    return value is None


def _empty(value: Any, body: Any) -> bool:
    return value is None or value == [] or value == {}


def _one_of(*no_ops: Any) -> Callable[[Any, Any], bool]:
    def check(value: Any, body: Any) -> bool:
        return value is None or any(value == v and type(value) is type(v) for v in no_ops)
    return check


def _zero_biases(value: Any, body: Any) -> bool:
    return value is None or (isinstance(value, dict) and all(
        isinstance(v, int | float) and not isinstance(v, bool) and v == 0 for v in value.values()))


def _text_format(value: Any, body: Any) -> bool:
    return value is None or value == {"type": "text"}


def _best_of_n(value: Any, body: Any) -> bool:
    # best_of == n samples n and returns n: exactly what the request does without it.
    return value is None or (type(value) is int and value == body.n)


def _text_modality(value: Any, body: Any) -> bool:
    return value is None or value == ["text"]


# name -> (what it would do, the values that change nothing). Both endpoints unless listed
# in CHAT_ONLY or COMPLETIONS_ONLY.
REFUSED: dict[str, tuple[str, Callable[[Any, Any], bool]]] = {
    "tools": ("tool calling", _empty),
    "tool_choice": ("tool calling", _one_of("none", "auto")),
    "functions": ("function calling", _empty),
    "function_call": ("function calling", _one_of("none", "auto")),
    "response_format": ("structured output", _text_format),
    "logit_bias": ("logit biases", _zero_biases),
    "best_of": ("best-of-n sampling", _best_of_n),
    "suffix": ("insertion (a suffix after the completion)", _one_of("")),
    "reasoning_effort": ("reasoning effort", _absent),
    "web_search_options": ("web search", _absent),
    "audio": ("audio output", _absent),
    "modalities": ("output modalities other than text", _text_modality),
    # vLLM's extensions
    "guided_json": ("guided decoding", _absent),
    "guided_regex": ("guided decoding", _absent),
    "guided_choice": ("guided decoding", _absent),
    "guided_grammar": ("guided decoding", _absent),
    "structured_outputs": ("structured output", _absent),
    "min_tokens": ("a minimum output length", _one_of(0)),
    "bad_words": ("banned words", _empty),
    "allowed_token_ids": ("a restricted vocabulary", _absent),
    "use_beam_search": ("beam search", _one_of(False)),
    "length_penalty": ("beam search length penalty", _one_of(1, 1.0)),
    "include_stop_str_in_output": ("stop strings kept in the output", _one_of(False)),
    "skip_special_tokens": ("special tokens in the output text", _one_of(True)),
    "spaces_between_special_tokens": ("special-token spacing", _one_of(True)),
    "truncate_prompt_tokens": ("prompt truncation", _absent),
    "add_generation_prompt": ("a chat template without the generation prompt", _one_of(True)),
    "continue_final_message": ("continuing the final message", _one_of(False)),
    "chat_template": ("a caller-supplied chat template", _absent),
    "chat_template_kwargs": ("chat template arguments", _empty),
    "documents": ("documents in the chat template", _empty),
}
CHAT_ONLY = frozenset({"tools", "tool_choice", "functions", "function_call", "reasoning_effort",
                       "web_search_options", "audio", "modalities", "add_generation_prompt",
                       "continue_final_message", "chat_template", "chat_template_kwargs",
                       "documents"})
COMPLETIONS_ONLY = frozenset({"best_of", "suffix"})
# In a chat message: what it would put into the prompt that the chat template here drops.
REFUSED_IN_MESSAGES: dict[str, tuple[str, Callable[[Any, Any], bool]]] = {
    "tool_calls": ("tool calls in the conversation", _empty),
    "function_call": ("function calls in the conversation", _absent),
    "audio": ("audio in the conversation", _absent),
}


def fields_for(chat: bool) -> list[str]:
    excluded = COMPLETIONS_ONLY if chat else CHAT_ONLY
    return [name for name in REFUSED if name not in excluded]


def refuse_unsupported(body: Any, chat: bool) -> None:
    """Raises a 400 naming the first field `body` sets to a value splitserve cannot honour."""
    for name in fields_for(chat):
        what, no_op = REFUSED[name]
        value = getattr(body, name)
        if not no_op(value, body):
            raise _unsupported(name, what)
    for i, message in enumerate(getattr(body, "messages", None) or ()):
        for name, (what, no_op) in REFUSED_IN_MESSAGES.items():
            if not no_op(getattr(message, name), message):
                raise _unsupported(f"messages.{i}.{name}", what)


def _unsupported(param: str, what: str) -> APIError:
    return APIError.invalid(
        f"Unsupported parameter: '{param}' ({what}) is not implemented by this server; "
        "remove it (an unconstrained answer would not be what was asked for).",
        param=param, code="unsupported_parameter")
