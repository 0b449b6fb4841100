"""The interface every proposer implements, and what a round of proposals carries."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from engine.request import Request


@dataclass
class Proposals:
    """Tokens proposed per request id, and for a draft model's sampled requests the draft's
    distribution for each of them ([num proposed, draft vocab] float32), which the standard
    rejection rule needs. Requests without an entry in `draft_probs` had deterministic
    proposals (n-gram, or a greedy draft)."""

    token_ids: dict[str, list[int]] = field(default_factory=dict)
    draft_probs: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids.values())


class Proposer(ABC):
    """Guesses the next tokens of decoding requests. Owned by the engine thread.

    `propose` sees each request's accepted tokens (`all_token_ids`) and nothing else of the
    target model, so whatever a proposer keeps per request must survive rejections: it may
    assume tokens are only ever appended, and must check its own guesses against them."""

    @abstractmethod
    def propose(self, requests: list[Request], num_tokens: dict[str, int]) -> Proposals:
        """Up to num_tokens[request_id] tokens for each request (fewer, or none, is fine)."""

    def release(self, request_ids: Iterable[str]) -> None:  # noqa: B027 - optional hook
        """Forget finished or aborted requests and free what is held for them."""

    def retain(self, request_ids: set[str]) -> None:  # noqa: B027 - optional hook
        """Forget every request not in `request_ids`."""
