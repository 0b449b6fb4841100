"""Prompts of exact token counts, built from the served model's own tokenizer.

Text is made of random whole-word vocabulary entries (" word"), each of which encodes back to
itself, so text of n such words is n tokens; the count is then checked with the tokenizer the way
a server counts it and trimmed or extended until it is exact. For the chat endpoint the count
includes the chat template's tokens. Shared-prefix groups get one fixed prefix each.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from bench.loadgen.workload import RequestSpec

_WORD = re.compile(r" [a-z]{2,}")
MAX_ADJUSTMENTS = 16

# A prompt is what goes in the request body: a completion prompt (text or token ids) or chat
# messages.
Prompt = str | list[int] | list[dict]


@dataclass(frozen=True)
class BuiltPrompt:
    prompt: Prompt
    num_tokens: int  # as the tokenizer counts it (template included for chat)


class PromptBuilder:
    """Builds the prompt for each RequestSpec. Not thread-safe: used by one event loop (or before
    the run starts)."""

    def __init__(self, tokenizer, *, endpoint: str = "completions", prompt_format: str = "text",
                 seed: int = 0) -> None:
        if endpoint not in ("completions", "chat"):
            raise ValueError("endpoint must be 'completions' or 'chat'")
        if prompt_format not in ("text", "token_ids"):
            raise ValueError("prompt_format must be 'text' or 'token_ids'")
        if endpoint == "chat" and prompt_format == "token_ids":
            raise ValueError("the chat endpoint takes text messages, not token ids")
        self.tokenizer = tokenizer
        self.endpoint = endpoint
        self.prompt_format = prompt_format
        self.words = self._word_tokens()
        self.seed = seed
        self._prefixes: dict[int, list[int]] = {}
        self.template_tokens = self._count([]) if endpoint == "chat" else 0

    # -- public --------------------------------------------------------------------------------

    def build(self, spec: RequestSpec, rng: np.random.Generator, prefix_len: int = 0) -> BuiltPrompt:
        """A prompt of exactly spec.prompt_len tokens (for chat: at least the template's own
        tokens plus one word). The first prefix_len tokens are shared by the spec's group."""
        prefix = self._prefix(spec.prefix_group, prefix_len) if spec.prefix_group >= 0 else []
        target = max(spec.prompt_len, self.template_tokens + len(prefix) + 1)
        body = list(prefix) + self._draw(rng, target - self.template_tokens - len(prefix))
        if self.prompt_format == "token_ids":
            return BuiltPrompt(body, len(body))
        for _ in range(MAX_ADJUSTMENTS):
            count = self._count(body)
            if count == target:
                return BuiltPrompt(self._as_prompt(body), count)
            if count > target:
                keep = max(len(prefix) + 1, len(body) - (count - target))
                body = body[:keep]
            else:
                body = body + self._draw(rng, target - count)
        raise RuntimeError(f"could not build a prompt of exactly {target} tokens "
                           f"(last attempt: {self._count(body)})")

    # -- pieces --------------------------------------------------------------------------------

    def _word_tokens(self) -> np.ndarray:
        """Ids of vocabulary entries that are a space and a lower-case word, and that encode back
        to exactly themselves."""
        size = len(self.tokenizer)
        texts = self.tokenizer.batch_decode([[i] for i in range(size)])
        candidates = [i for i, t in enumerate(texts) if _WORD.fullmatch(t)]
        encoded = self.tokenizer([texts[i] for i in candidates], add_special_tokens=False)
        words = [i for i, ids in zip(candidates, encoded["input_ids"], strict=True) if ids == [i]]
        if len(words) < 8:
            raise ValueError(f"the tokenizer has only {len(words)} plain word tokens; "
                             "cannot build prompts from it")
        return np.array(words, dtype=np.int64)

    def _prefix(self, group: int, length: int) -> list[int]:
        if group not in self._prefixes:
            # Keyed by group alone, so every request of a group shares it whatever the order.
            rng = np.random.default_rng([self.seed, 7919, group])
            self._prefixes[group] = self._draw(rng, length)
        return self._prefixes[group]

    def _draw(self, rng: np.random.Generator, n: int) -> list[int]:
        return [int(i) for i in rng.choice(self.words, max(n, 0))]

    def _as_prompt(self, ids: list[int]) -> Prompt:
        text = self.tokenizer.decode(ids)
        if self.endpoint == "chat":
            return [{"role": "user", "content": text}]
        return text

    def _count(self, ids: list[int]) -> int:
        prompt = self._as_prompt(ids)
        if self.endpoint == "chat":
            encoded = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True,
                                                         tokenize=True)
            if hasattr(encoded, "keys"):  # a BatchEncoding in recent transformers
                encoded = encoded["input_ids"]
            return len(encoded)
        return len(self.tokenizer(prompt)["input_ids"])


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
