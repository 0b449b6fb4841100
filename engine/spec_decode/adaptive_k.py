"""How many tokens each request speculates: k follows the request's measured acceptance.

Owned by the engine thread. Like the batch gate, it changes how fast a request is generated,
never what (verification keeps the target's distribution, and its exact text where proposals
are deterministic).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# A k-th proposed token is worth scoring while the chance that it is accepted (acceptance
# rate to the k-th power, for independent acceptances) stays above this.
MIN_ACCEPT_CHANCE = 0.2
# Requests whose acceptance earns them k = 0 still try one token every this many steps,
# so a request that turns copy-like later is noticed. They all probe on the same steps: a
# draft model's forward costs about the same for one request as for the whole batch (its
# weights are read either way), so staggered probes would run the draft on most steps.
PROBE_EVERY = 8
_DECAY = 0.8  # weight of the past in the acceptance estimate, per verification


@dataclass
class _Acceptance:
    accepted: float = 4.0  # prior: four of five accepted, so a new request starts at k = 7
    rejected: float = 1.0  # (capped to k_max) and needs a few rejections to come down

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)


class AdaptiveK:
    """k per request from an exponentially weighted estimate of its per-token acceptance
    rate: proposals stop at the first rejection, so a verification of k tokens that kept a
    counts a accepted and (a < k) one rejected."""

    def __init__(self, k_max: int, adaptive: bool = True) -> None:
        self.k_max = k_max
        self.adaptive = adaptive
        self._stats: dict[str, _Acceptance] = {}
        self._step = 0

    def start_step(self) -> None:
        """Called once per speculating step, before num_tokens for its requests."""
        self._step += 1

    def num_tokens(self, request_id: str) -> int:
        if not self.adaptive:
            return self.k_max
        stats = self._stats.get(request_id)
        if stats is None:
            return self.k_max
        rate = stats.rate
        k = self.k_max if rate >= 1.0 else int(math.log(MIN_ACCEPT_CHANCE) / math.log(rate))
        k = max(0, min(k, self.k_max))
        if k == 0 and self._step > 0 and self._step % PROBE_EVERY == 0:
            return 1
        return k

    def record(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        stats = self._stats.setdefault(request_id, _Acceptance())
        stats.accepted = _DECAY * stats.accepted + num_accepted
        stats.rejected = _DECAY * stats.rejected + (1 if num_accepted < num_proposed else 0)

    def retain(self, request_ids: set[str]) -> None:
        for rid in [r for r in self._stats if r not in request_ids]:
            del self._stats[rid]
