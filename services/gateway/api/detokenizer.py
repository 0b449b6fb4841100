"""Incremental, UTF-8-safe detokenization with the prefix-offset / read-offset technique.

Decoding one token at a time breaks multi-byte characters split across tokens and drops the
leading space some decoders strip from a sequence's first token. Instead each step decodes a
short window twice, ending before and after the new tokens, and emits the difference once it
no longer ends in U+FFFD (an incomplete character).
"""

from __future__ import annotations

from collections.abc import Sequence

from services.gateway.api.tokenizer import ModelTokenizer

# Prompt tokens kept as left context so the first output token decodes as it would mid-text.
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Text of one request's output, a delta per token. Owned by the task that streams it."""

    def __init__(
        self, tokenizer: ModelTokenizer, prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        # A prompt (token ids) may end inside a character: as context its bytes would join the
        # output's first ones into a character neither text has, and those output bytes would
        # never be emitted. Context that ends in whole characters keeps the output's own text.
        while context and tokenizer.decode(context, skip_special_tokens).endswith(
                REPLACEMENT_CHAR):
            context.pop()
        self._token_ids: list[int] = context
        # [prefix_offset, read_offset): tokens whose text was emitted, kept as context.
        # [read_offset, end): tokens whose text is not emitted yet.
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)

    def push(self, token_id: int) -> str:
        """Add one token; return the text that is now complete (possibly "")."""
        self._token_ids.append(token_id)
        prefix_text, full_text = self._window_texts()
        if len(full_text) > len(prefix_text) and not full_text.endswith(REPLACEMENT_CHAR):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._token_ids)
            return full_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """At the end of the output: whatever is held back, incomplete characters included."""
        if self._read_offset == len(self._token_ids):
            return ""
        prefix_text, full_text = self._window_texts()
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        return full_text[len(prefix_text):]

    def _window_texts(self) -> tuple[str, str]:
        decode = self._tokenizer.decode
        window = self._token_ids[self._prefix_offset:]
        read = self._read_offset - self._prefix_offset
        return (decode(window[:read], self._skip_special), decode(window, self._skip_special))
