"""Which worker holds which prompt blocks in its prefix cache, for cache-aware routing.

Two sources: the workers' own block-hash events (stored / evicted, followed from Redis),
which are exact, and this gateway's routing history (blocks of prompts it sent to a worker),
which fills in where events are missing: a worker that publishes none (no Redis), and the
second or so before a worker's events for a just-routed prompt arrive. Owned by the event loop.
"""

from __future__ import annotations

import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Sequence


class PrefixIndex:
    """Invariants: `_holders[h]` and `_blocks[w]` mirror each other (events only); history
    holds at most `history_blocks` (address, hash) entries, least recently routed dropped first,
    and per address at most the blocks its worker's KV pool holds where that is known (a
    worker cannot still cache more than that of what it was sent); `_history` (all addresses,
    in routing order) and `_routed[address]` (each address's, in routing order, with the time)
    hold the same entries."""

    def __init__(self, history_blocks: int = 200_000, history_grace_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic,
                 admitted_ttl_s: float = 5.0) -> None:
        self.history_blocks = history_blocks
        self.history_grace_s = history_grace_s
        self.clock = clock
        self._holders: dict[int, set[str]] = defaultdict(set)  # block hash -> worker ids
        self._blocks: dict[str, set[int]] = defaultdict(set)  # worker id -> block hashes
        self._followed: set[str] = set()  # worker ids whose events have been seen
        self._history: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._routed: dict[str, OrderedDict[int, float]] = {}
        # Blocks of prompts admission let in during the last admitted_ttl_s, on no worker yet
        # (admission decides before routing): see matched_admitted.
        self.admitted_ttl_s = admitted_ttl_s
        self._admitted: OrderedDict[int, float] = OrderedDict()
        self.events_applied = 0

    # -- events (exact) -------------------------------------------------------------------

    def apply_event(self, worker_id: str, kind: str, hashes: Iterable[int]) -> None:
        """A worker stored or evicted these blocks (events are applied in stream order)."""
        self._followed.add(worker_id)
        held = self._blocks[worker_id]
        if kind == "stored":
            for h in hashes:
                held.add(h)
                self._holders[h].add(worker_id)
        elif kind == "evicted":
            for h in hashes:
                held.discard(h)
                holders = self._holders.get(h)
                if holders is not None:
                    holders.discard(worker_id)
                    if not holders:
                        del self._holders[h]
        self.events_applied += 1

    def is_followed(self, worker_id: str) -> bool:
        return worker_id in self._followed

    # -- routing history (fallback) ---------------------------------------------------------

    def record_routed(self, address: str, hashes: Sequence[int], capacity_blocks: int = 0) -> None:
        """This gateway sent a prompt with these block hashes to the worker at `address`, whose
        KV pool holds `capacity_blocks` (0: not known)."""
        now = self.clock()
        routed = self._routed.setdefault(address, OrderedDict())
        for h in hashes:
            key = (address, h)
            self._history[key] = None
            self._history.move_to_end(key)
            routed[h] = now
            routed.move_to_end(h)
        if capacity_blocks > 0:
            while len(routed) > capacity_blocks:
                h, _ = routed.popitem(last=False)
                del self._history[(address, h)]
        while len(self._history) > self.history_blocks:
            (old_address, h), _ = self._history.popitem(last=False)
            del self._routed[old_address][h]

    def record_admitted(self, hashes: Sequence[int]) -> None:
        """Admission let in a prompt with these block hashes: the worker it goes to computes
        them (or finds them cached) before a prompt admitted after it that shares them."""
        now = self.clock()
        for h in hashes:
            self._admitted[h] = now
            self._admitted.move_to_end(h)
        while self._admitted and (len(self._admitted) > self.history_blocks or
                                  now - next(iter(self._admitted.values())) > self.admitted_ttl_s):
            self._admitted.popitem(last=False)

    def matched_admitted(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt were in a prompt admitted within the TTL."""
        cutoff = self.clock() - self.admitted_ttl_s
        matched = 0
        for h in hashes:
            at = self._admitted.get(h)
            if at is None or at < cutoff:
                break
            matched += 1
        return matched

    # -- queries ----------------------------------------------------------------------------

    def matched_blocks(self, worker_id: str, address: str, hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt (its chained hashes) the worker holds. For a
        worker whose events are followed, history counts only while it is fresher than the
        event lag (`history_grace_s`); otherwise it is all there is."""
        followed = worker_id in self._followed
        now = self.clock()
        matched = 0
        for h in hashes:
            if worker_id not in self._holders.get(h, ()):
                routed_at = self._routed.get(address, {}).get(h)
                if routed_at is None or (followed and now - routed_at > self.history_grace_s):
                    break
            matched += 1
        return matched

    def num_blocks(self, worker_id: str) -> int:
        """Blocks the worker's events say it holds."""
        return len(self._blocks.get(worker_id, ()))

    # -- membership -------------------------------------------------------------------------

    def forget_worker(self, worker_id: str = "", address: str = "") -> None:
        """The worker left or restarted with an empty cache: drop what is known about it."""
        if worker_id:
            self._followed.discard(worker_id)
            for h in self._blocks.pop(worker_id, ()):
                holders = self._holders.get(h)
                if holders is not None:
                    holders.discard(worker_id)
                    if not holders:
                        del self._holders[h]
        if address:
            for h in self._routed.pop(address, {}):
                del self._history[(address, h)]
