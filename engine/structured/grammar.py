"""A StructuredOutput as an llguidance grammar, and the check that it compiles against a model's
tokenizer: the same code on the gateway (a 400 before dispatch) and on every worker (the
matcher). Imports no torch."""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence

import llguidance
from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark, is_lark_syntax

from engine.sampling_params import StructuredOutput

# Separators as json.dumps writes them, and no other whitespace: a small model left free to
# choose whitespace can spend every token on newlines; these are what it writes unconstrained.
# oneOf is read as anyOf, as vLLM's backends do (a value both branches accept is rare, and
# refusing the keyword refused pydantic unions and common tool schemas).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
                "coerce_one_of": True}
ANY_OBJECT_SCHEMA = '{"type": "object"}'
# Compiling the grammar of a hostile schema or Lark text must stay bounded (llguidance's own
# defaults, made explicit so a reader sees that there are limits).
LIMITS = llguidance.LLParserLimits()


class GrammarError(ValueError):
    """The constraint cannot be compiled; the message names the problem."""


# Grammar texts kept for the constraints seen last, in bytes all together: a cache bounded by
# count alone let one client pin gigabytes in the gateway and every worker with a few hundred
# distinct multi-megabyte schemas (as vLLM's xgrammar cache did: GHSA-hf3c-wxg2-49q9). A grammar
# over an eighth of it is compiled each time instead.
GRAMMAR_CACHE_BYTES = 64 << 20


class _GrammarCache:
    """Least recently used grammar texts, keyed by a digest of their constraint (the key does
    not hold the constraint's text), at most `capacity` bytes of grammar text."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.size = 0
        self._texts: OrderedDict[bytes, str] = OrderedDict()
        self._lock = threading.Lock()  # tokenizer threads, mask helper threads, the engine's

    @staticmethod
    def key(so: StructuredOutput) -> bytes:
        return hashlib.sha256(repr(so).encode("utf-8", "surrogatepass")).digest()

    def get(self, key: bytes) -> str | None:
        with self._lock:
            text = self._texts.get(key)
            if text is not None:
                self._texts.move_to_end(key)
            return text

    def put(self, key: bytes, text: str) -> None:
        if len(text) > self.capacity // 8:
            return
        with self._lock:
            if key in self._texts:
                return
            self._texts[key] = text
            self.size += len(text)
            while self.size > self.capacity:
                _, dropped = self._texts.popitem(last=False)
                self.size -= len(dropped)


_cache = _GrammarCache(GRAMMAR_CACHE_BYTES)


def grammar_for(so: StructuredOutput) -> str:
    """llguidance's grammar text for `so`, from the cache when it was compiled lately.
    Raises GrammarError for a JSON schema that is not a JSON object."""
    key = _cache.key(so)
    text = _cache.get(key)
    if text is None:
        text = _compile(so)
        _cache.put(key, text)
    return text


def _compile(so: StructuredOutput) -> str:
    """Every failure is a GrammarError: llguidance's GBNF reader raises bare Exceptions for
    an undefined or repeated rule, and deep nesting a RecursionError. One that escaped on a
    worker's engine thread stopped the worker (a bad constraint fails its request only)."""
    try:
        return _compile_unchecked(so)
    except GrammarError:
        raise
    except RecursionError:
        raise GrammarError(f"the {_NAMES.get(so.kind, 'constraint')} is nested too deeply") from None
    except Exception as exc:  # noqa: BLE001 - whatever a converter raises for bad input
        first_line = (str(exc) or type(exc).__name__).split("\n", 1)[0]
        raise GrammarError(f"the {_NAMES.get(so.kind, 'constraint')} cannot be read: "
                           f"{first_line}") from None


def _compile_unchecked(so: StructuredOutput) -> str:
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
        return llguidance.LLMatcher.grammar_from_regex(ascii_classes(so.regex))
    if kind == "choice":
        # Lark string literals take JSON's escapes, so any choice text is quoted exactly.
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in so.choice))
    if kind == "grammar":
        text = so.grammar
        if "::=" in text and not is_lark_syntax(text):  # llama.cpp's GBNF, as vLLM takes
            try:
                text = gbnf_to_lark(text)
            except GbnfToLarkError as exc:
                raise GrammarError(f"the GBNF grammar cannot be read: {exc}") from None
        return llguidance.LLMatcher.grammar_from_lark(text)
    raise GrammarError("the structured output sets no constraint")


# Shorthand classes as ASCII, as vLLM's backends and JSON schema patterns read them: the
# regex engine reads them as Unicode, and `\d{3}` let a model write three U+1FBF8 digits.
_ASCII = {"d": "0-9", "w": "0-9A-Za-z_", "s": " \\t\\n\\r\\f\\v"}


def ascii_classes(regex: str) -> str:
    """`regex` with \\d, \\w, \\s (and \\D, \\W, \\S) as ASCII classes, inside a bracket class or
    out of one; every other escape is left as it is."""
    out, i, depth, opened = [], 0, 0, 0  # opened: where the innermost class's members begin
    while i < len(regex):
        c = regex[i]
        if c == "\\" and i + 1 < len(regex):
            letter = regex[i + 1]
            members = _ASCII.get(letter.lower())
            if members is None:
                out.append(regex[i:i + 2])
            elif letter.islower():
                out.append(members if depth else f"[{members}]")
            else:  # negated: a class of its own, nested in the class it is in (the regex
                # crate's syntax). Kept Unicode there until December 7, `[\s\S]` ("anything")
                # left out U+00A0 and `[^\s\S]` ("nothing") let a model write it.
                out.append(f"[^{members}]")
            i += 2
            continue
        out.append(c)
        i += 1
        if c == "[":  # a class, or one nested in a class (the regex crate's syntax)
            depth += 1
            if regex.startswith("^", i):
                out.append("^")
                i += 1
            opened = len(out)
        elif c == "]" and depth and len(out) - 1 > opened:  # "]" first in a class is literal
            depth -= 1
    return "".join(out)


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
