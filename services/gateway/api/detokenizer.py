"""Incremental, UTF-8-safe detokenization with the prefix-offset / read-offset technique.

Decoding one token at a time breaks multi-byte characters split across tokens and drops the
leading space some decoders strip from a sequence's first token. Instead each step decodes a
short window twice, ending before and after the new tokens, and emits the difference once it
no longer ends in U+FFFD (an incomplete character).

A trailing U+FFFD is held only while the new tokens' bytes end with the start of a character
that more bytes could complete. Bytes no continuation makes valid (a model sampling stray byte
tokens) decode to U+FFFD for good, and go out at once: held, they held the whole rest of the
output, which then came in one event at its end.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from services.gateway.api.tokenizer import ModelTokenizer

# Prompt tokens kept as left context so the first output token decodes as it would mid-text.
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"
_UTF8 = codecs.getincrementaldecoder("utf-8")


class IncrementalDetokenizer:
    """Text of one request's output, a delta per token. Owned by the task that streams it."""

    def __init__(
        self, tokenizer: ModelTokenizer, prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        # vLLM's spaces_between_special_tokens=False with special tokens kept: an added token
        # right after another is written as its own text, without the space some decoders
        # (WordPiece) put between them. Byte-level and SentencePiece decoders put none.
        self._join_added = not skip_special_tokens and not spaces_between_special_tokens
        self._last_added = False
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
        if self._join_added:
            added = self._tokenizer.added_token_text(token_id)
            after_added, self._last_added = self._last_added, added is not None
            if added is not None and after_added:
                held = self.flush()
                self._token_ids.append(token_id)
                # The added token is the context the next token's text is decoded after.
                self._prefix_offset, self._read_offset = (len(self._token_ids) - 1,
                                                          len(self._token_ids))
                return held + added
        self._token_ids.append(token_id)
        prefix_text, full_text = self._window_texts()
        if len(full_text) > len(prefix_text) and (not full_text.endswith(REPLACEMENT_CHAR)
                                                  or not self._ends_inside_a_character()):
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

    def _ends_inside_a_character(self) -> bool:
        """Whether the bytes of the tokens not yet emitted end with a character's first bytes,
        which the next tokens may complete (at most 3 of the up to 4 a character has)."""
        tail = b""
        for token_id in reversed(self._token_ids[self._read_offset:]):
            if not (self._skip_special and self._tokenizer.is_special(token_id)):
                tail = self._tokenizer.token_bytes(token_id) + tail
                if len(tail) >= 3:
                    break
        decoder = _UTF8("replace")
        decoder.decode(tail[-3:], final=False)  # keeps back an incomplete character's bytes
        return bool(decoder.getstate()[0])

    def _window_texts(self) -> tuple[str, str]:
        decode = self._tokenizer.decode
        window = self._token_ids[self._prefix_offset:]
        read = self._read_offset - self._prefix_offset
        return (decode(window[:read], self._skip_special), decode(window, self._skip_special))
