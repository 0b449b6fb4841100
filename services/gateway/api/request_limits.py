"""The size limits every request meets at the gateway's edge, checked before any tokenization
or worker call, so no single request can make the gateway (or a worker) do unbounded work.
Each breach is a 400 with OpenAI's error body (INVALID_ARGUMENT over gRPC)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.gateway.errors import APIError

MAX_N = 128  # choices per prompt (`n`): OpenAI's limit (vLLM has none; RL jobs ask for 16-64)
MAX_CACHE_SALT_CHARS = 256  # vLLM's cache_salt (hashed before it goes anywhere)
# The choice index is appended to the worker's request id ("-<index>"); 5 digits keep the id
# inside the KV header's key (request_ids.WORKER_ID_SUFFIX_ROOM).
MAX_CHOICES_CEILING = 10_000


@dataclass(frozen=True)
class RequestLimits:
    """From GatewayConfig; read-only, shared by the event loop and the tokenizer threads."""

    max_prompts: int = 1024  # strings or token lists in one completions `prompt` list
    max_choices: int = 1024  # worker requests one HTTP request may open: prompts x n
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_stop_token_ids: int = 256

    @classmethod
    def from_config(cls, config) -> RequestLimits:
        return cls(config.max_prompts_per_request, config.max_choices_per_request,
                   config.max_stop_strings, config.max_stop_string_chars,
                   config.max_stop_token_ids)

    def check_batch(self, num_prompts: int, n: int) -> None:
        if num_prompts > self.max_prompts:
            raise _array_too_long("prompt", num_prompts, self.max_prompts,
                                  "--max-prompts-per-request")
        if not 1 <= n <= MAX_N:
            raise APIError.invalid(f"n must be in [1, {MAX_N}], got {n}", param="n")
        if num_prompts * n > self.max_choices:
            raise APIError.invalid(
                f"This request asks for {num_prompts} prompts x n={n} = {num_prompts * n} "
                f"completions; this gateway serves at most {self.max_choices} per request "
                "(--max-choices-per-request). Split it into several requests.",
                param="n", code="array_above_max_length")

    def check_stop(self, stop: Sequence[str], stop_token_ids: Sequence[int] = ()) -> None:
        if len(stop) > self.max_stop_strings:
            raise _array_too_long("stop", len(stop), self.max_stop_strings, "--max-stop-strings")
        if any(s == "" for s in stop):
            # vLLM's 400 too: an empty string would match before the first token.
            raise APIError.invalid("Invalid 'stop': a stop string must not be empty.",
                                   param="stop")
        longest = max((len(s) for s in stop), default=0)
        if longest > self.max_stop_string_chars:
            raise APIError.invalid(
                f"Invalid 'stop': a stop string has {longest} characters; the maximum is "
                f"{self.max_stop_string_chars} (--max-stop-string-chars).",
                param="stop", code="string_above_max_length")
        if len(stop_token_ids) > self.max_stop_token_ids:
            raise _array_too_long("stop_token_ids", len(stop_token_ids),
                                  self.max_stop_token_ids, "--max-stop-token-ids")


def validate_limits(config) -> None:
    """GatewayConfig's edge limits and timeouts; a clear ValueError for each bad value."""
    for name in ("max_prompts_per_request", "max_choices_per_request", "max_stop_strings",
                 "max_stop_string_chars", "max_stop_token_ids", "max_request_id_length",
                 "tokenizer_threads"):
        if getattr(config, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if config.max_choices_per_request > MAX_CHOICES_CEILING:
        raise ValueError(f"--max-choices-per-request must be <= {MAX_CHOICES_CEILING} (the "
                         "choice index is part of the workers' request id)")
    for name in ("request_timeout_s", "stall_timeout_s"):
        value = getattr(config, name)
        if not value >= 0 or value == float("inf"):  # `not >=` also catches NaN
            raise ValueError(f"--{name.replace('_', '-')} must be a number of seconds >= 0 "
                             "(0: no limit)")


def _array_too_long(param: str, got: int, limit: int, flag: str) -> APIError:
    # OpenAI's own wording and code for an over-long array parameter.
    return APIError.invalid(
        f"Invalid '{param}': array too long. Expected an array with maximum length {limit} "
        f"({flag}), but got an array with length {got} instead.",
        param=param, code="array_above_max_length")
