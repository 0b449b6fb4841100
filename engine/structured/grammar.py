"""A StructuredOutput as an llguidance grammar, and the check that it compiles against a model's
tokenizer: the same code on the gateway (a 400 before dispatch) and on every worker (the
matcher). Imports no torch."""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from functools import lru_cache

import llguidance

from engine.sampling_params import StructuredOutput

# Separators as json.dumps writes them, and no other whitespace: a small model left free to
# choose whitespace can spend every token on newlines; these are what it writes unconstrained.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT_SCHEMA = '{"type": "object"}'
# Compiling the grammar of a hostile schema or Lark text must stay bounded (llguidance's own
# defaults, made explicit so a reader sees that there are limits).
LIMITS = llguidance.LLParserLimits()


class GrammarError(ValueError):
    """The constraint cannot be compiled; the message names the problem."""


@lru_cache(maxsize=256)
def grammar_for(so: StructuredOutput) -> str:
    """llguidance's grammar text for `so` (cached: a StructuredOutput is frozen and hashable).
    Raises GrammarError for a JSON schema that is not a JSON object."""
    kind = so.kind
    if kind == "json_schema":
        try:
            schema = json.loads(so.json_schema)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise GrammarError("the JSON schema must be a JSON object")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        except ValueError as exc:
            raise GrammarError(f"the JSON schema cannot be read: {exc}") from None
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(ANY_OBJECT_SCHEMA,
                                                             overrides=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(so.regex)
    if kind == "choice":
        # Lark string literals take JSON's escapes, so any choice text is quoted exactly.
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in so.choice))
    if kind == "grammar":
        return llguidance.LLMatcher.grammar_from_lark(so.grammar)
    raise GrammarError("the structured output sets no constraint")


class GrammarCompiler:
    """The model's tokenizer as llguidance sees it (built once per process: about 0.3 s for a
    49k vocabulary) and the grammars compiled against it. Thread-safe: the gateway checks from
    its tokenizer threads, a worker builds matchers on its engine thread."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._args = (tokenizer_json, vocab_size, list(eos_token_ids))
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                text, vocab_size, eos = self._args
                self._tokenizer = llguidance.LLTokenizer(text, n_vocab=vocab_size,
                                                         eos_token=eos or None)
            return self._tokenizer

    def check(self, so: StructuredOutput) -> None:
        """Raise GrammarError naming the problem unless `so` compiles for this tokenizer."""
        try:
            so.validate()
        except ValueError as exc:
            raise GrammarError(str(exc)) from None
        grammar = grammar_for(so)
        try:
            is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
                grammar, self.tokenizer, limits=LIMITS)
        except (ValueError, RuntimeError) as exc:  # API-level refusals (e.g. a malformed spec)
            is_error, messages = True, [str(exc)]
        if is_error:
            raise GrammarError(f"the {_NAMES[so.kind]} cannot be compiled: {messages[0]}")

    def matcher(self, so: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher at the start of the output. Check is_error(): llguidance reports a
        bad grammar there rather than raising."""
        return llguidance.LLMatcher(self.tokenizer, grammar_for(so), log_level=0, limits=LIMITS)


_NAMES = {"json_schema": "JSON schema", "json_object": "JSON object grammar",
          "regex": "regex", "choice": "choice list", "grammar": "grammar"}
