"""Per-request sampling parameters, validated before a request touches any engine state."""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

# A choice list compiles in about 18 ms at this size (SmolLM2's vocabulary); 40,000 entries
# took the gateway 6-14 s of CPU before admission could refuse the request, and llguidance
# panics past 65,535 grammar symbols.
MAX_CHOICES = 4096


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on what one request may generate; exactly one field is set.

    `json_schema` is the schema as JSON text; `json_object` asks for any JSON object; `regex`
    must match the whole output; `choice` is a list of exact strings; `grammar` is a Lark
    grammar in llguidance's dialect (it may embed `%json {...}` and `/regex/` terminals).
    Plain data (no compiled grammar), so it crosses processes and the wire unchanged; the
    engine compiles it (engine/structured)."""

    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")

    @property
    def kind(self) -> str:
        """The one field that is set (validate() checks that exactly one is)."""
        return next((k for k in self.KINDS if getattr(self, k) not in (None, False)), "")

    def validate(self) -> None:
        """Raise ValueError unless exactly one kind is set with a value of the right type.
        Whether it compiles is engine/structured's check (it needs the grammar engine)."""
        set_kinds = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError("structured_output must set exactly one of "
                             f"{', '.join(self.KINDS)} (json_object true); got "
                             f"{set_kinds or 'none'}")
        for name in ("json_schema", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_output {name} must be a non-empty string")
        if self.json_object not in (True, False):
            raise ValueError("structured_output json_object must be a boolean")
        if self.choice is not None and (
            not isinstance(self.choice, tuple) or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("structured_output choice must be a non-empty list of "
                             "non-empty strings")
        if self.choice is not None and len(self.choice) > MAX_CHOICES:
            raise ValueError(f"structured_output choice has {len(self.choice)} entries; at "
                             f"most {MAX_CHOICES} are taken")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token of one request.

    `top_k <= 0` and `top_p == 1` disable those filters. `logprobs=None` returns no logprobs;
    `logprobs=n` returns the sampled token's logprob plus the n most likely alternatives.
    `seed=None` means the engine draws a seed when the request is added, so the request's
    randomness is still a function of (seed, position) and survives moving between workers.
    `disable_speculation` opts this request out of speculative decoding on an engine that
    speculates (speculation changes the pace of generation, never its distribution).
    `structured_output` constrains every sampled token to a grammar (engine/structured).

    Logit processing (the OpenAI API's `logit_bias`, vLLM's `allowed_token_ids` and
    `min_tokens`), after penalties and before temperature: `allowed_token_ids` (empty: all)
    leaves only those tokens, `logit_bias` adds (token id, bias) to the logits, and while
    fewer than `min_tokens` tokens are out, EOS (unless `ignore_eos`) and `stop_token_ids` are
    banned; of each `bad_words_token_ids` sequence, the last token is banned where the output so
    far ends with the ones before it (a one-token sequence: always). Logprobs stay those of the
    model's distribution, as with penalties.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    disable_speculation: bool = False
    structured_output: StructuredOutput | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()

    MAX_LOGPROBS = 20
    MAX_BAD_WORDS = 256  # token sequences: each is a check per step
    MAX_LOGIT_BIAS = 100.0  # the OpenAI API's range: [-100, 100]

    # A temperature below this is greedy, as in vLLM: dividing logits by a tiny positive one
    # overflowed them to inf (from about 1e-38), and the draw then returned token 0 on the CPU
    # and an id past the vocabulary on the batched (CUDA) path, which broke the next step.
    GREEDY_BELOW_TEMPERATURE = 1e-5
    # The smallest repetition penalty: dividing a seen token's logit by a tiny one overflowed
    # it the same way.
    MIN_REPETITION_PENALTY = 0.01

    @property
    def greedy(self) -> bool:
        return self.temperature < self.GREEDY_BELOW_TEMPERATURE

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def needs_logit_processing(self) -> bool:
        """Whether logit_bias, allowed_token_ids or min_tokens change this request's logits."""
        return bool(self.logit_bias or self.allowed_token_ids or self.min_tokens
                    or self.bad_words_token_ids)

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError with a message a user can act on; never mutates anything."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _check_finite("temperature", self.temperature)
        # OpenAI's and vLLM's range: past 2 a small model's text is noise, and a client that
        # sends 100 has a bug a 400 shows (it was served until December 7).
        if not 0 <= self.temperature <= 2:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        _check_finite("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be an integer, got {self.top_k!r}")
        _check_finite("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        _check_finite("repetition_penalty", self.repetition_penalty)
        # Compared as the float32 the gateway rounds it to (and the proto carries): the
        # documented minimum itself, 0.01, arrives as 0.0099999998 and was refused.
        if _float32(self.repetition_penalty) < _float32(self.MIN_REPETITION_PENALTY):
            raise ValueError(f"repetition_penalty must be >= {self.MIN_REPETITION_PENALTY}, "
                             f"got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_finite(name, value)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        # Named as the request's field: the gateway takes the message's first word for the
        # 400's `param` ("stop token id" sent clients to `stop`).
        for token_id in self.stop_token_ids:
            _check_token_id("stop_token_ids", token_id, vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            # A non-integer count would only fail later, in torch.topk inside the engine loop.
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool)
                or not 0 <= value <= self.MAX_LOGPROBS
            ):
                raise ValueError(
                    f"{name} must be an integer in [0, {self.MAX_LOGPROBS}], got {value!r}"
                )
        self._validate_logit_processing(vocab_size)
        if self.structured_output is not None:
            if not isinstance(self.structured_output, StructuredOutput):
                raise ValueError("structured_output must be a StructuredOutput")
            self.structured_output.validate()


    def _validate_logit_processing(self, vocab_size: int) -> None:
        seen: set[int] = set()
        for pair in self.logit_bias:
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise ValueError("logit_bias must be (token id, bias) pairs")
            token_id, bias = pair
            _check_token_id("logit_bias", token_id, vocab_size)
            if token_id in seen:
                raise ValueError(f"logit_bias names token id {token_id} twice")
            seen.add(token_id)
            _check_finite(f"logit_bias of token {token_id}", bias)
            if not -self.MAX_LOGIT_BIAS <= bias <= self.MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for "
                                 f"token {token_id}")
        for token_id in self.allowed_token_ids:
            _check_token_id("allowed_token_ids", token_id, vocab_size)
        if len(self.bad_words_token_ids) > self.MAX_BAD_WORDS:
            raise ValueError(f"bad_words come to {len(self.bad_words_token_ids)} token "
                             f"sequences; at most {self.MAX_BAD_WORDS}")
        for sequence in self.bad_words_token_ids:
            if not isinstance(sequence, tuple) or not sequence:
                raise ValueError("bad_words token sequences must be non-empty tuples")
            for token_id in sequence:
                _check_token_id("bad_words", token_id, vocab_size)
        # Not held to max_tokens here: a prefill worker samples one token of a longer request
        # (the gateway checks min_tokens <= max_tokens).
        if (not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool)
                or self.min_tokens < 0):
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")


def _check_token_id(name: str, token_id, vocab_size: int) -> None:
    if (not isinstance(token_id, int) or isinstance(token_id, bool)
            or not 0 <= token_id < vocab_size):
        raise ValueError(f"{name} token id {token_id!r} is not in the vocabulary "
                         f"[0, {vocab_size})")


def _check_finite(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


def _float32(value: float) -> float:
    """`value` rounded to the nearest float32."""
    return struct.unpack("f", struct.pack("f", value))[0]
