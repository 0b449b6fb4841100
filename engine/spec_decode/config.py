"""Typed settings of speculative decoding for one engine (off unless `method` is set)."""

from __future__ import annotations

import os
from dataclasses import dataclass

METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """`num_speculative_tokens` is the most tokens proposed per request per step; the policy
    lowers it per request by measured acceptance. Speculation stops while more than
    `max_batch_size` requests decode (0: no fixed limit) and, with `adaptive_batch`, in any
    batch-size range where measured throughput says it does not pay."""

    method: str | None = None  # None | "ngram" | "draft"
    num_speculative_tokens: int = 4
    draft_model: str | None = None
    # n-gram: match the longest suffix of ngram_max..ngram_min tokens seen before.
    ngram_min: int = 2
    ngram_max: int = 4
    adaptive_k: bool = True
    max_batch_size: int = 0
    adaptive_batch: bool = True

    @property
    def enabled(self) -> bool:
        return self.method is not None

    def validate(self) -> None:
        """Raise ValueError with a message an operator can act on."""
        if self.method is None:
            return
        if self.method not in METHODS:
            raise ValueError(
                f"unknown speculative method {self.method!r} (choose {', '.join(METHODS)})"
            )
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(
                f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}"
            )
        if self.method == "draft":
            if not self.draft_model:
                raise ValueError("speculative method 'draft' needs a draft model folder")
            if not os.path.isfile(os.path.join(self.draft_model, "config.json")):
                raise ValueError(f"draft model {self.draft_model!r} is not a model folder "
                                 "(no config.json)")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}"
            )
        if self.max_batch_size < 0:
            raise ValueError(f"max_batch_size must be >= 0, got {self.max_batch_size}")
