"""The logit processing a request body asks for (the OpenAI API's `logit_bias`, vLLM's
`allowed_token_ids`, `min_tokens` and `bad_words`) as SamplingParams fields, each value's shape
checked with a 400 that names its field; the engine applies them (sampler.LogitProcessing)."""

from __future__ import annotations

from engine.sampling_params import SamplingParams
from services.gateway.api.protocol import _SamplingFields
from services.gateway.api.tokenizer import ModelTokenizer
from services.gateway.errors import APIError


def logit_processing(req: _SamplingFields, tokenizer: ModelTokenizer) -> dict:
    """logit_bias, allowed_token_ids, min_tokens and bad_words as SamplingParams fields; a 400
    naming the field for a value of the wrong shape (ranges: SamplingParams.validate)."""
    out: dict = {}
    bias = req.logit_bias
    if bias is not None:
        if not isinstance(bias, dict):
            raise APIError.invalid("logit_bias must be an object mapping token ids (as strings) "
                                   "to biases in [-100, 100]", param="logit_bias")
        pairs = []
        for key, value in bias.items():
            if not key.strip().isdigit():
                raise APIError.invalid(f"logit_bias keys must be token ids, got {key!r}",
                                       param="logit_bias")
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise APIError.invalid(f"logit_bias of token {key} must be a number, got "
                                       f"{value!r}", param="logit_bias")
            pairs.append((int(key), float(value)))
        out["logit_bias"] = tuple(pairs)
    allowed = req.allowed_token_ids
    if allowed is not None:
        if not isinstance(allowed, list) or not allowed or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in allowed):
            raise APIError.invalid("allowed_token_ids must be a non-empty list of token ids",
                                   param="allowed_token_ids")
        out["allowed_token_ids"] = tuple(dict.fromkeys(allowed))
    if req.min_tokens is not None:
        if isinstance(req.min_tokens, bool) or not isinstance(req.min_tokens, int):
            raise APIError.invalid(f"min_tokens must be an integer, got {req.min_tokens!r}",
                                   param="min_tokens")
        out["min_tokens"] = req.min_tokens
    out["bad_words_token_ids"] = _bad_words(req.bad_words, tokenizer)
    return out


def _bad_words(words, tokenizer: ModelTokenizer) -> tuple[tuple[int, ...], ...]:
    """vLLM's bad_words as token sequences: each word as it reads at the start of the
    output and after a space (two spellings, most tokenizers; one where they agree)."""
    if words is None:
        return ()
    if not isinstance(words, list) or not all(isinstance(w, str) and w.strip()
                                              for w in words):
        raise APIError.invalid("bad_words must be a list of non-empty strings",
                               param="bad_words")
    sequences: dict[tuple[int, ...], None] = {}
    for word in words:
        for spelling in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tokenizer.encode(spelling, add_special_tokens=False))
            if ids:
                sequences[ids] = None
    if len(sequences) > SamplingParams.MAX_BAD_WORDS:
        raise APIError.invalid(f"bad_words come to {len(sequences)} token sequences; at most "
                               f"{SamplingParams.MAX_BAD_WORDS}", param="bad_words")
    return tuple(sequences)
