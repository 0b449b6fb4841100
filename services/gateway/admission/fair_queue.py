"""Per-tenant request queues and the policy that picks whose request runs next.

Policies: "vtc" (the default) serves the backlogged tenant with the least weighted service
so far, a virtual token counter charging prompt tokens when a request is released and output
tokens as they stream (output tokens weigh more), divided by the tenant's weight; a tenant that
becomes backlogged has its counter lifted to the current minimum, so idling banks no credit.
"round_robin" takes one request per backlogged tenant in turn; "fcfs" ignores tenants.
Strict priority classes sit above vtc and round_robin; each tenant's queue is FCFS.

The queue also knows what each tenant has running, for two things: ties between equal counters
go to the tenant with fewer requests running, and `within_share` tells whether a tenant holds
less than its weighted share of the in-flight limit (admission then releases its request
without waiting for the limit: see Admission._drain).

Owned by the gateway's event loop.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from services.gateway.admission.tenants import Tenant

POLICIES = ("vtc", "round_robin", "fcfs")


class Queued(Protocol):
    tenant: Tenant
    prompt_tokens: int
    max_output_tokens: int  # all its choices together
    slots: int  # sequences it runs (its choices)
    seq: int  # arrival order, set by push


@dataclass
class _TenantQueue:
    tenant: Tenant
    entries: deque = field(default_factory=deque)
    tokens: int = 0  # prompt tokens queued
    cost: float = 0.0  # what its queued requests will add to its counter, weight aside


class FairQueue:
    def __init__(self, policy: str = "vtc", output_weight: float = 2.0) -> None:
        if policy not in POLICIES:
            raise ValueError(f"fairness policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self.output_weight = output_weight
        self.counters: dict[str, float] = {}  # tenant -> weighted service (vtc)
        self._queues: dict[str, _TenantQueue] = {}  # backlogged tenants only
        self.running: dict[str, tuple[Tenant, int]] = {}  # released, not finished: slots
        self._last_served: dict[int, float] = {}  # priority -> counter of the last tenant served
        self._turn: deque[str] = deque()  # round_robin order
        self._seq = itertools.count()
        self._len = 0
        self.tokens = 0

    def __len__(self) -> int:
        return self._len

    def queued(self, tenant: str) -> int:
        queue = self._queues.get(tenant)
        return len(queue.entries) if queue else 0

    def push(self, entry: Queued) -> None:
        tenant = entry.tenant
        entry.seq = next(self._seq)
        queue = self._queues.get(tenant.name)
        if queue is None:
            self._lift(tenant)
            queue = self._queues[tenant.name] = _TenantQueue(tenant)
            self._turn.append(tenant.name)
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
            name = next(n for n in self._turn if self._queues[n].tenant.priority == top)
            return self._queues[name].entries[0]
        queue = min((q for q in self._queues.values() if q.tenant.priority == top),
                    key=lambda q: (self.counters.get(q.tenant.name, 0.0),
                                   self._running(q.tenant.name), q.entries[0].seq))
        return queue.entries[0]

    def pop(self, entry: Queued) -> None:
        """Release `entry` (normally what peek returned): it leaves the queue and is charged."""
        tenant = entry.tenant
        counter = self.counters.get(tenant.name, 0.0)
        self._last_served[tenant.priority] = counter
        self.counters[tenant.name] = counter + entry.prompt_tokens / tenant.weight
        self.running[tenant.name] = (tenant, self._running(tenant.name) + entry.slots)
        self.remove(entry)
        if tenant.name in self._queues:  # round robin: to the back of the line
            self._turn.remove(tenant.name)
            self._turn.append(tenant.name)

    def remove(self, entry: Queued) -> bool:
        """Take `entry` out without serving it (cancelled, expired); False if not queued."""
        queue = self._queues.get(entry.tenant.name)
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
            del self._queues[entry.tenant.name]
            self._turn.remove(entry.tenant.name)
        return True

    def finished(self, entry: Queued) -> None:
        """A released request ended."""
        slots = self._running(entry.tenant.name) - entry.slots
        if slots > 0:
            self.running[entry.tenant.name] = (entry.tenant, slots)
        else:
            self.running.pop(entry.tenant.name, None)

    def within_share(self, entry: Queued, limit: int) -> bool:
        """Whether `entry`, the one request its tenant has waiting, keeps the tenant within
        its weighted share of `limit` in-flight slots (shared with the tenants of its priority
        class that are waiting or running) and (vtc) the tenant's counter is within one such
        request of the least counter waiting in its class: the policy would serve it about now
        anyway, so it need not wait for the limit, and the counters' spread stays bounded by a
        request. A tenant with more waiting is backlogged: the policy's order alone decides.
        Never with fcfs, nor while a higher class waits; round robin weighs tenants alike."""
        tenant, slots = entry.tenant, entry.slots
        if self.policy == "fcfs" or not limit:
            return False
        if self.queued(tenant.name) > 1:  # backlogged: the policy's order alone decides
            return False
        if any(q.tenant.priority > tenant.priority for q in self._queues.values()):
            return False
        if self.policy == "vtc":
            others = [self.counters.get(q.tenant.name, 0.0) for q in self._queues.values()
                      if q.tenant.priority == tenant.priority and q.tenant.name != tenant.name]
            if others and (self.counters.get(tenant.name, 0.0)
                           > min(others) + self._cost(entry) / tenant.weight):
                return False
        active = {name: t for name, (t, _) in self.running.items()}
        active.update((q.tenant.name, q.tenant) for q in self._queues.values())
        active[tenant.name] = tenant
        weight = (lambda t: t.weight) if self.policy == "vtc" else (lambda t: 1.0)
        total = sum(weight(t) for t in active.values() if t.priority == tenant.priority)
        return self._running(tenant.name) + slots <= limit * weight(tenant) / total

    def charge_output(self, tenant: Tenant, num_tokens: int) -> None:
        self.counters[tenant.name] = (self.counters.get(tenant.name, 0.0)
                                      + self.output_weight * num_tokens / tenant.weight)

    def heads(self) -> list[Queued]:
        """The oldest request of each tenant (per tenant, also the first to expire)."""
        return [q.entries[0] for q in self._queues.values()]

    def ahead(self, tenant: Tenant) -> tuple[int, int]:
        """(requests, prompt tokens) the policy would release before a request of `tenant`
        that joined now: the backlog it would wait behind. For vtc, another tenant is served
        until its counter passes where ours will stand, each of its requests counted at its
        full eventual charge (prompt plus weighted max_tokens)."""
        if self.policy == "fcfs":
            return self._len, self.tokens
        requests = tokens = 0
        own = self._queues.get(tenant.name)
        own_count = len(own.entries) if own else 0
        start = self.counters.get(tenant.name, 0.0) if own else self._lifted(tenant)
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
                gap = (target - self.counters.get(queue.tenant.name, 0.0)) * queue.tenant.weight
                served = min(count, max(0, math.ceil(gap * count / max(1.0, queue.cost))))
            requests += served
            tokens += queue.tokens * served // max(1, count)
        return requests, tokens

    def _cost(self, entry: Queued) -> float:
        return entry.prompt_tokens + self.output_weight * entry.max_output_tokens

    def _running(self, name: str) -> int:
        return self.running.get(name, (None, 0))[1]

    def _lifted(self, tenant: Tenant) -> float:
        """Where a newly backlogged tenant's counter starts: no lower than the least counter
        of the tenants already waiting in its class (or, with none, of the last one served)."""
        own = self.counters.get(tenant.name, 0.0)
        waiting = [self.counters.get(q.tenant.name, 0.0) for q in self._queues.values()
                   if q.tenant.priority == tenant.priority]
        floor = min(waiting) if waiting else self._last_served.get(tenant.priority, 0.0)
        return max(own, floor)

    def _lift(self, tenant: Tenant) -> None:
        if self.policy == "vtc":
            self.counters[tenant.name] = self._lifted(tenant)
