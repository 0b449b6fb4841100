"""How many prompt tokens a step may take while requests are decoding in it.

A decoding request's next token waits for the whole step, prefill chunks included: one
512-token chunk on one CPU thread is about 0.4 s, so every stream in the batch sees a 0.4 s
gap. With a step-time target, a step that carries decoding requests takes only the prompt
tokens that fit: (target - the decode rows' own time) / the measured time per prompt token,
at least `min_tokens` so prompts always move. Steps without decoding requests (an idle
worker's prefill, a prefill worker) are not limited.

Both costs are measured, per worker, as exponentially weighted averages: a step of decode rows
only gives the decode time of a batch of that size (per row: batch sizes move slowly); a step
with prompt tokens gives their cost once the decode rows' estimated share is taken out.
Owned by the engine thread.
"""

from __future__ import annotations


class MixedStepBudget:
    def __init__(self, target_s: float, max_tokens: int, min_tokens: int = 16,
                 weight: float = 0.2) -> None:
        if target_s <= 0:
            raise ValueError("the step-time target must be positive")
        self.target_s = target_s
        self.max_tokens = max_tokens
        self.min_tokens = min(min_tokens, max_tokens)
        self.weight = weight
        self.decode_row_s: float | None = None  # seconds per decode row in a decode-only step
        self.decode_base_s: float | None = None  # and the fixed part of such a step
        self.prompt_token_s: float | None = None  # seconds per prompt token

    def _ewma(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.weight * (new - old)

    def decode_seconds(self, num_decode_rows: int) -> float:
        if self.decode_row_s is None:
            return 0.0
        return (self.decode_base_s or 0.0) + self.decode_row_s * num_decode_rows

    def prompt_tokens(self, num_decode_rows: int) -> int | None:
        """The most prompt tokens for a step with this many decoding requests; None: no limit
        (nothing decodes, or no cost measured yet)."""
        if not num_decode_rows or self.prompt_token_s is None:
            return None
        room = self.target_s - self.decode_seconds(num_decode_rows)
        tokens = int(room / self.prompt_token_s) if self.prompt_token_s > 0 else self.max_tokens
        return max(self.min_tokens, min(self.max_tokens, tokens))

    def observe(self, num_decode_rows: int, num_prompt_tokens: int, seconds: float) -> None:
        if num_decode_rows and not num_prompt_tokens:
            # Half the step as a fixed part, half per row: enough to scale with the batch.
            self.decode_base_s = self._ewma(self.decode_base_s, seconds / 2)
            self.decode_row_s = self._ewma(self.decode_row_s, seconds / 2 / num_decode_rows)
        elif num_prompt_tokens:
            prompt_s = max(seconds - self.decode_seconds(num_decode_rows), 0.0)
            self.prompt_token_s = self._ewma(self.prompt_token_s, prompt_s / num_prompt_tokens)
