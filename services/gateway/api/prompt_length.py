"""A prompt's length against the model's context: the limits, vLLM's truncation, and the
error for a text too long by its length alone (refused before it is tokenized)."""

from __future__ import annotations

from dataclasses import dataclass

from services.gateway.api.tokenizer import TextTooLong
from services.gateway.errors import APIError


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    max_model_len: int


def text_too_long(exc: TextTooLong, limits: ModelLimits, param: str) -> APIError:
    return APIError.invalid(
        f"This model's maximum context length is {limits.max_model_len} tokens; the prompt "
        f"has {exc.chars} characters, at least {exc.min_tokens} tokens, and at least one must "
        "be generated.", param=param, code="context_length_exceeded")


def truncated(prompt_ids: list[int], keep: int | None, limits: ModelLimits) -> list[int]:
    """vLLM's truncate_prompt_tokens: the last `keep` tokens of the prompt (-1: as many as the
    context holds with one token generated)."""
    if keep is None:
        return prompt_ids
    if keep == -1:
        keep = limits.max_model_len - 1
    if keep < 1:
        raise APIError.invalid(f"truncate_prompt_tokens must be -1 or at least 1, got {keep}",
                               param="truncate_prompt_tokens")
    return prompt_ids[-keep:] if len(prompt_ids) > keep else prompt_ids
