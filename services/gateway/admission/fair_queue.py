"""Per-share request queues and the policy that picks whose request runs next.

A share is what the policy is fair between: a tenant, or, for the anonymous tenant (no API
keys), each client address (`Queued.share`, "anonymous/ADDRESS"; Admission.share_of). A
share takes its weight and priority class from its tenant.

Policies: "vtc" (the default) serves the backlogged share with the least weighted service
so far, a virtual token counter charging prompt tokens when a request is released and output
tokens as they stream (output tokens weigh more), divided by the tenant's weight; a share that
becomes backlogged has its counter lifted to the current minimum, so idling banks no credit.
"round_robin" takes one request per backlogged share in turn; "fcfs" ignores shares.
Strict priority classes sit above vtc and round_robin; each share's queue is FCFS.

The queue also knows what each share has running, for two things: ties between equal counters
go to the share with fewer requests running, and `within_share` tells whether a share holds
less than its weighted part of the in-flight limit (admission then releases its request
without waiting for the limit: see Admission._drain).

Owned by the gateway's event loop.
"""

from __future__ import annotations

import heapq
import ipaddress
import itertools
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Protocol

from services.gateway.admission.tenants import Tenant

POLICIES = ("vtc", "round_robin", "fcfs")


class Queued(Protocol):
    tenant: Tenant
    share: str  # the unit the policy is fair between: the tenant's name, or one of its clients
    prompt_tokens: int
    max_output_tokens: int  # all its choices together
    slots: int  # sequences it runs (its choices)
    seq: int  # arrival order, set by push


# Counters of shares with nothing queued or running kept at most: each client address of
# anonymous traffic is a share, and an idle share's counter is only ever lifted (_lifted), so
# the oldest idle ones are forgotten rather than kept for every address ever seen.
IDLE_COUNTERS = 4096


def client_share(tenant: str, client: str) -> str:
    """The share of `tenant`'s requests from the client at address `client`: an IPv6 client
    counts by its /64 (one host or site has one, and can use every address in it)."""
    if ":" in client:
        client = str(ipaddress.ip_network(f"{client}/64", strict=False))
    return f"{tenant}/{client}"


def tenant_of(share: str) -> str:
    """The tenant a share belongs to (tenant names hold no "/")."""
    return share.split("/", 1)[0]


def who_waits(share: str) -> str:
    """How a refusal names a share: its tenant, or its client."""
    tenant, _, client = share.partition("/")
    return f"Client {client}" if client else f"Tenant {tenant}"


@dataclass
class _ShareQueue:
    tenant: Tenant
    key: str
    entries: deque = field(default_factory=deque)
    tokens: int = 0  # prompt tokens queued
    cost: float = 0.0  # what its queued requests will add to its counter, weight aside


class FairQueue:
    def __init__(self, policy: str = "vtc", output_weight: float = 2.0) -> None:
        if policy not in POLICIES:
            raise ValueError(f"fairness policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self.output_weight = output_weight
        self.counters: dict[str, float] = {}  # share -> weighted service (vtc)
        self._queues: dict[str, _ShareQueue] = {}  # backlogged shares only
        self.running: dict[str, tuple[Tenant, int]] = {}  # released, not finished: slots
        self._idle: OrderedDict[str, None] = OrderedDict()  # counters of idle shares, oldest first
        self._last_served: dict[int, float] = {}  # priority -> counter of the last share served
        self._turn: deque[str] = deque()  # round_robin order
        self._seq = itertools.count()
        self._len = 0
        self.tokens = 0

    def __len__(self) -> int:
        return self._len

    def queued(self, share: str) -> int:
        queue = self._queues.get(share)
        return len(queue.entries) if queue else 0

    def by_tenant(self) -> dict[str, tuple[int, float]]:
        """Tenant -> (requests waiting, highest counter) over its shares: its own, or, for the
        anonymous tenant's clients, the most any one of them received."""
        found: dict[str, tuple[int, float]] = {}
        for key, counter in self.counters.items():
            tenant = tenant_of(key)
            found[tenant] = (0, max(counter, found.get(tenant, (0, counter))[1]))
        for queue in self._queues.values():
            waiting, counter = found.get(queue.tenant.name, (0, 0.0))
            found[queue.tenant.name] = (waiting + len(queue.entries), counter)
        return found

    def push(self, entry: Queued) -> None:
        tenant, key = entry.tenant, entry.share
        entry.seq = next(self._seq)
        queue = self._queues.get(key)
        if queue is None:
            self._lift(key, tenant)
            queue = self._queues[key] = _ShareQueue(tenant, key)
            self._turn.append(key)
            self._idle.pop(key, None)
        queue.entries.append(entry)
        queue.tokens += entry.prompt_tokens
        queue.cost += self._cost(entry)
        self._len += 1
        self.tokens += entry.prompt_tokens

    def peek(self) -> Queued | None:
        """The request the policy would release next."""
        if not self._queues:
            return None
        if self.policy == "fcfs":
            return min((q.entries[0] for q in self._queues.values()), key=lambda e: e.seq)
        top = max(q.tenant.priority for q in self._queues.values())
        if self.policy == "round_robin":
            key = next(k for k in self._turn if self._queues[k].tenant.priority == top)
            return self._queues[key].entries[0]
        queue = min((q for q in self._queues.values() if q.tenant.priority == top),
                    key=lambda q: (self.counters.get(q.key, 0.0), self._running(q.key),
                                   q.entries[0].seq))
        return queue.entries[0]

    def pop(self, entry: Queued) -> None:
        """Release `entry` (normally what peek returned): it leaves the queue and is charged."""
        tenant, key = entry.tenant, entry.share
        counter = self.counters.get(key, 0.0)
        self._last_served[tenant.priority] = counter
        self.counters[key] = counter + entry.prompt_tokens / tenant.weight
        self.running[key] = (tenant, self._running(key) + entry.slots)
        self.remove(entry)
        if key in self._queues:  # round robin: to the back of the line
            self._turn.remove(key)
            self._turn.append(key)

    def remove(self, entry: Queued) -> bool:
        """Take `entry` out without serving it (cancelled, expired); False if not queued."""
        key = entry.share
        queue = self._queues.get(key)
        if queue is None:
            return False
        try:
            queue.entries.remove(entry)
        except ValueError:
            return False
        queue.tokens -= entry.prompt_tokens
        queue.cost -= self._cost(entry)
        self._len -= 1
        self.tokens -= entry.prompt_tokens
        if not queue.entries:
            del self._queues[key]
            self._turn.remove(key)
            self._went_idle(key)
        return True

    def finished(self, entry: Queued) -> None:
        """A released request ended."""
        key = entry.share
        slots = self._running(key) - entry.slots
        if slots > 0:
            self.running[key] = (entry.tenant, slots)
        else:
            self.running.pop(key, None)
            self._went_idle(key)

    def within_share(self, entry: Queued, limit: int) -> bool:
        """Whether `entry`, the one request its share has waiting, keeps the share within
        its weighted part of `limit` in-flight slots (shared with the shares of its priority
        class that are waiting or running) and (vtc) the share's counter is within one such
        request of the least counter waiting in its class: the policy would serve it about now
        anyway, so it need not wait for the limit, and the counters' spread stays bounded by a
        request. A share with more waiting is backlogged: the policy's order alone decides.
        Never with fcfs, nor while a higher class waits; round robin weighs shares alike."""
        if self.policy == "fcfs" or not limit:
            return False
        if any(q.tenant.priority > entry.tenant.priority for q in self._queues.values()):
            return False
        return self._within(entry, limit, self._class_state(entry.tenant.priority, entry))

    def owed(self, limit: int) -> list[Queued]:
        """The heads within_share says yes to, in one pass over the shares: asked head by head,
        each answer was a pass of its own, and a drain with N clients waiting cost N² (an
        audit: 1.1 s a drain at 2,000 clients, a probe waiting 97 s behind 600 of them)."""
        if self.policy == "fcfs" or not limit or not self._queues:
            return []
        top = max(q.tenant.priority for q in self._queues.values())
        state = self._class_state(top)
        return [q.entries[0] for q in self._queues.values() if q.tenant.priority == top
                and len(q.entries) == 1 and self._within(q.entries[0], limit, state)]

    def _class_state(self, priority: int, joining: Queued | None = None
                     ) -> tuple[float, list[tuple[float, str]]]:
        """Of a priority class: the weight of its shares waiting or running (`joining`'s too,
        which may be neither yet) and the two least counters of its shares waiting."""
        weight = self._weight
        active = {k: t for k, (t, _) in self.running.items() if t.priority == priority}
        active.update((q.key, q.tenant) for q in self._queues.values()
                      if q.tenant.priority == priority)
        if joining is not None:
            active[joining.share] = joining.tenant
        least = heapq.nsmallest(2, ((self.counters.get(q.key, 0.0), q.key)
                                    for q in self._queues.values()
                                    if q.tenant.priority == priority))
        return sum(weight(t) for t in active.values()), least

    def _within(self, entry: Queued, limit: int,
                state: tuple[float, list[tuple[float, str]]]) -> bool:
        tenant, key = entry.tenant, entry.share
        if self.queued(key) > 1:  # backlogged: the policy's order alone decides
            return False
        total, least = state
        if self.policy == "vtc":
            others = [counter for counter, other in least if other != key]
            if others and (self.counters.get(key, 0.0)
                           > others[0] + self._cost(entry) / tenant.weight):
                return False
        return self._running(key) + entry.slots <= limit * self._weight(tenant) / total

    def _weight(self, tenant: Tenant) -> float:
        return tenant.weight if self.policy == "vtc" else 1.0

    def charge_output(self, entry: Queued, num_tokens: int) -> None:
        key = entry.share
        self.counters[key] = (self.counters.get(key, 0.0)
                              + self.output_weight * num_tokens / entry.tenant.weight)

    def heads(self) -> list[Queued]:
        """The oldest request of each share (per share, also the first to expire)."""
        return [q.entries[0] for q in self._queues.values()]

    def ahead(self, entry: Queued) -> tuple[int, int]:
        """(requests, prompt tokens) the policy would release before `entry` if it joined now:
        the backlog it would wait behind. For vtc, another share is served until its counter
        passes where this one's will stand, each of its requests counted at its full eventual
        charge (prompt plus weighted max_tokens)."""
        if self.policy == "fcfs":
            return self._len, self.tokens
        tenant, key = entry.tenant, entry.share
        requests = tokens = 0
        own = self._queues.get(key)
        own_count = len(own.entries) if own else 0
        start = self.counters.get(key, 0.0) if own else self._lifted(key, tenant)
        target = start + (own.cost if own else 0.0) / tenant.weight
        for queue in self._queues.values():
            count = len(queue.entries)
            if queue.tenant.priority > tenant.priority or queue is own:
                served = count
            elif queue.tenant.priority < tenant.priority:
                continue
            elif self.policy == "round_robin":
                served = min(count, own_count + 1)
            else:
                gap = (target - self.counters.get(queue.key, 0.0)) * queue.tenant.weight
                served = min(count, max(0, math.ceil(gap * count / max(1.0, queue.cost))))
            requests += served
            tokens += queue.tokens * served // max(1, count)
        return requests, tokens

    def _cost(self, entry: Queued) -> float:
        return entry.prompt_tokens + self.output_weight * entry.max_output_tokens

    def _running(self, key: str) -> int:
        return self.running.get(key, (None, 0))[1]

    def _went_idle(self, key: str) -> None:
        """`key` may have nothing queued and nothing running now: its counter is kept among
        the idle ones, the oldest of which are forgotten past IDLE_COUNTERS."""
        if key in self._queues or key in self.running or key not in self.counters:
            return
        self._idle[key] = None
        self._idle.move_to_end(key)
        while len(self._idle) > IDLE_COUNTERS:
            oldest, _ = self._idle.popitem(last=False)
            self.counters.pop(oldest, None)

    def _lifted(self, key: str, tenant: Tenant) -> float:
        """Where a newly backlogged share's counter starts: no lower than the least counter
        of the shares already waiting in its class (or, with none, of the last one served)."""
        own = self.counters.get(key, 0.0)
        waiting = [self.counters.get(q.key, 0.0) for q in self._queues.values()
                   if q.tenant.priority == tenant.priority]
        floor = min(waiting) if waiting else self._last_served.get(tenant.priority, 0.0)
        return max(own, floor)

    def _lift(self, key: str, tenant: Tenant) -> None:
        if self.policy == "vtc":
            self.counters[key] = self._lifted(key, tenant)
