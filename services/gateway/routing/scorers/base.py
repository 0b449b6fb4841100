"""What a scorer sees of a request, and the interface every scorer implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

from engine.block_pool import hash_prompt_blocks
from services.gateway.routing.worker_pool import WorkerEndpoint


@dataclass(frozen=True)
class RoutingRequest:
    """A request as routing sees it: its prompt, output budget and the chained hashes of the
    prompt's full blocks, salted per tenant (the same hashes the workers' prefix caches use)."""

    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    block_size: int
    block_hashes: tuple[int, ...]

    @classmethod
    def build(cls, prompt_token_ids, max_tokens: int, block_size: int,
              cache_salt: str = "") -> RoutingRequest:
        prompt = tuple(prompt_token_ids)
        return cls(prompt, max_tokens, block_size,
                   tuple(hash_prompt_blocks(prompt, block_size, cache_salt)))

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def blocks_needed(self) -> int:
        """KV blocks the whole request can occupy on a decode worker."""
        return -(-(self.num_tokens + self.max_tokens) // self.block_size)


class Scorer(Protocol):
    """Scores one candidate worker for one request; higher is better. Scores of a pool are
    summed with per-scorer weights from config, so each scorer documents its unit."""

    name: ClassVar[str]

    def score(self, request: RoutingRequest, worker: WorkerEndpoint) -> float: ...
