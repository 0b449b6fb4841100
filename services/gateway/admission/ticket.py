"""One admitted request's ticket: what admission charged and reserved for it, when it was
queued, released and first answered, and what its streams report back to the admission that
issued it (its first token, every token after, its end)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Protocol

from services.gateway.admission.metered import MeteredDispatcher
from services.gateway.admission.quota import Lease
from services.gateway.admission.tenants import Tenant
from services.gateway.generation_spec import GenerationSpec


class TicketEvents(Protocol):
    """What a ticket tells the admission that issued it."""

    def first_token(self, ticket: Ticket) -> None: ...

    def tokens(self, ticket: Ticket, count: int) -> None: ...

    def finished(self, ticket: Ticket) -> None: ...


@dataclass(eq=False)
class Ticket:
    """One admitted request, from the quota charge to its end; `release` it exactly once."""

    events: TicketEvents  # the admission that issued it
    tenant: Tenant
    specs: list[GenerationSpec]  # max_tokens capped to the tenant's limit
    prompt_tokens: int
    reserved_tokens: int  # charged at admission: prompt + every choice's max_tokens
    blocks: int  # decode KV blocks it may need
    arrival: float
    deadline: float
    lease: Lease | None = None
    # The fair queue's unit it is served under: its tenant's name, or for anonymous traffic
    # its client's (Admission.share_of).
    share: str = ""
    seq: int = 0
    released_at: float | None = None  # left the queue for the workers
    # Its prompt tokens not already in a worker's prefix cache (estimated at admission): what
    # its prefill computes, and what the TTFT estimate counts.
    prefill_tokens: int = 0
    prefill_at_release: int = 0  # tokens to prefill before its first token, its own too
    extra_at_release: int = 0  # and choices beyond each request's first
    first_token_at: float | None = None
    predicted_ttft_s: float | None = None  # the plain estimate it was admitted on
    output_tokens: int = 0
    finished_choices: int = 0
    done: bool = False
    _ready: asyncio.Future | None = field(default=None, repr=False)

    @property
    def slots(self) -> int:
        return len(self.specs)

    @property
    def extra_choices(self) -> int:
        return len(self.specs) - 1

    @property
    def max_output_tokens(self) -> int:
        return self.reserved_tokens - self.prompt_tokens

    def metered(self, dispatcher) -> MeteredDispatcher:
        """`dispatcher`, counting this request's tokens (first token, fair-queue service,
        the refund) and releasing it when every choice has its last token."""
        return MeteredDispatcher(dispatcher, self._tokens, self._choice_done)

    def release(self) -> None:
        if not self.done:
            self.done = True
            self.events.finished(self)

    def _choice_done(self) -> None:
        self.finished_choices += 1
        if self.finished_choices == self.slots:
            self.release()

    def _tokens(self, count: int) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
            self.events.first_token(self)
        self.output_tokens += count
        self.events.tokens(self, count)
