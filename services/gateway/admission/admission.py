"""Admission at the gateway: authenticate (API key -> tenant), check the tenant's limits, predict
whether the request can still meet its TTFT target (503 now if not), charge its quota (429 if
over), then hold it in the fair queue until the cluster has room. `admit` hands back a Ticket
once the request may go to the workers; `Ticket.release` ends it (refund, slot, next request).

Everything here is owned by the gateway's event loop; a ticker task on that loop releases
queued requests when room appears and drops those whose deadline has passed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence

from services.gateway.admission.capacity import ClusterRoom
from services.gateway.admission.fair_queue import FairQueue, client_share, who_waits
from services.gateway.admission.inflight import InFlight
from services.gateway.admission.metrics import AdmissionMetrics
from services.gateway.admission.quota import QuotaRefused, Quotas
from services.gateway.admission.retry_after import RetrySchedule
from services.gateway.admission.tenants import Tenant, TenantDirectory
from services.gateway.admission.ticket import Ticket
from services.gateway.admission.ttft_estimator import TTFTEstimator
from services.gateway.errors import APIError
from services.gateway.generation_spec import GenerationSpec

log = logging.getLogger(__name__)

TICK_S = 0.02  # how often a non-empty queue is re-checked for room and deadlines
# Prompt tokens released to be prefilled before any first token was measured (Admission._blind).
BLIND_PREFILL_TOKENS = 8192


# cached_tokens(prompt token ids, cache salt): how many of the prompt's tokens a worker that
# may prefill it holds in its prefix cache (the gateway's prefix index: an estimate).
CachedTokens = Callable[[Sequence[int], str], int]
# on_admitted(prompt token ids, cache salt): a prompt was admitted, so its prefix will be
# computed (or is being computed) before the prompts admitted after it share it.
OnAdmitted = Callable[[Sequence[int], str], None]


class Admission:
    def __init__(self, directory: TenantDirectory, quotas: Quotas, queue: FairQueue,
                 room: ClusterRoom, estimator: TTFTEstimator | None = None,
                 ttft_target_s: float = 1.0, metrics: AdmissionMetrics | None = None,
                 cached_tokens: CachedTokens | None = None,
                 on_admitted: OnAdmitted | None = None, per_client: bool = True) -> None:
        self.directory = directory
        self.quotas = quotas
        self.queue = queue
        self.room = room
        self.estimator = estimator or TTFTEstimator()
        self.ttft_target_s = ttft_target_s  # 0: no early rejection, no deadline
        self.retry_schedule = RetrySchedule()  # the Retry-After of its 503s
        self.metrics = metrics or AdmissionMetrics()
        self.metrics.admission = self
        # The TTFT estimate counts the tokens a prefill computes, not the prompt's (a cached
        # system prompt or earlier turns cost a prefill almost nothing). None: whole prompts.
        self.cached_tokens = cached_tokens
        # Prompts admitted a moment ago count as cached for the ones after them: twelve chats
        # behind one new system prompt, sent at once, share one prefill of it, not twelve.
        self.on_admitted = on_admitted
        # Authentication off: each client address its own share of the fair queue (share_of).
        self.per_client = per_client
        self.inflight = 0  # choices released to the workers and not finished
        self._preparing: dict[str, int] = {}  # share -> requests being parsed and tokenized
        self.prefilling_tokens = 0  # prefill_tokens of released requests without a first token
        self.prefilling_extra = 0  # and their extra choices
        self.running = InFlight()  # the released requests, and when they will end
        self._wake = asyncio.Event()
        self._ticker: asyncio.Task | None = None

    async def start(self) -> None:
        await self.quotas.start()
        self._ticker = asyncio.create_task(self._tick(), name="admission-ticker")

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            await asyncio.gather(self._ticker, return_exceptions=True)
        await self.quotas.close()

    def authenticate(self, authorization: str | None) -> Tenant:
        return self.directory.authenticate(authorization)

    def share_of(self, tenant: Tenant, client: str) -> str:
        """The fair queue's unit a request of `tenant` from `client` (its address, or "") is
        served under: the tenant, or, with authentication off and per_client on, the client,
        so that one client's flood leaves the others their shares as tenants' would."""
        if self.per_client and client and not self.directory.auth_enabled:
            return client_share(tenant.name, client)
        return tenant.name

    @contextlib.contextmanager
    def preparing(self, tenant: Tenant, share: str = "") -> Iterator[None]:
        """Around a request's parsing, templating, tokenizing and constraint check, before
        admit(): a tenant with a queue limit has at most max_concurrency + max_queued requests
        in preparation and in the queue together, and one over it is refused (429
        queue_full) before the gateway spends CPU on it (README: "A request being parsed")."""
        name = share or tenant.name
        if tenant.max_queued:
            waiting = self._preparing.get(name, 0) + self.queue.queued(name)
            if waiting >= tenant.max_queued + tenant.max_concurrency:
                raise self._reject(tenant, "queue_full", APIError.rate_limited(
                    f"{who_waits(name)} already has {waiting} requests waiting; retry "
                    "when some finish."))
        self._preparing[name] = self._preparing.get(name, 0) + 1
        try:
            yield
        finally:
            self._preparing[name] -= 1
            if not self._preparing[name]:
                del self._preparing[name]

    async def admit(self, tenant: Tenant, specs: list[GenerationSpec],
                    prompt_tokens: int, share: str = "") -> Ticket:
        """Waits in the fair queue until released. Raises APIError: 400 (over the tenant's
        prompt limit), 429 (quota, queue full), 503 (cannot meet the TTFT target, or the
        quota service is down under fail-closed). Cancelling it leaves nothing behind."""
        specs = [dataclasses.replace(s, cache_salt=self.directory.cache_salt(tenant,
                                                                            s.client_cache_salt))
                 for s in self._within_limits(tenant, specs)]
        block_size = self.room.pool.block_size()
        now = time.monotonic()
        prefill_tokens = self._prefill_tokens(specs, prompt_tokens)
        ticket = Ticket(
            self, tenant, specs, prompt_tokens,
            reserved_tokens=prompt_tokens + sum(s.params.max_tokens for s in specs),
            blocks=sum(-(-(len(s.prompt_token_ids) + s.params.max_tokens) // block_size)
                       for s in specs),
            arrival=now,
            deadline=(now + self._ttft_budget_s(prefill_tokens, len(specs) - 1)
                      if self.ttft_target_s else math.inf),
            prefill_tokens=prefill_tokens, share=share or tenant.name)
        if tenant.max_queued and self.queue.queued(ticket.share) >= tenant.max_queued:
            raise self._reject(tenant, "queue_full", APIError.rate_limited(
                f"{who_waits(ticket.share)} already has {tenant.max_queued} requests "
                "waiting; retry when some finish."))
        self._check_on_time(ticket)
        if self.on_admitted is not None:
            # Before the first await: requests that arrive together are judged one after
            # another, each seeing the prompts judged before it.
            for prompt in {id(s.prompt_token_ids): s for s in specs}.values():
                self.on_admitted(prompt.prompt_token_ids, prompt.cache_salt or "")
        try:
            ticket.lease = await self.quotas.acquire(tenant, ticket.reserved_tokens)
        except QuotaRefused as exc:
            raise self._reject(tenant, exc.reason, exc) from None
        self.metrics.admitted.labels(tenant.name).inc()
        ticket._ready = asyncio.get_running_loop().create_future()
        self.queue.push(ticket)
        self._drain()
        try:
            await ticket._ready
        except asyncio.CancelledError:
            ticket.release()  # still queued: leaves the queue, quota refunded
            raise
        return ticket

    # -- the parts --------------------------------------------------------------------------

    def _prefill_tokens(self, specs: list[GenerationSpec], prompt_tokens: int) -> int:
        """Of `prompt_tokens` (each distinct prompt once), those not in a worker's prefix cache:
        the cached share of the specs' prompts, applied to the count (exact for one prompt,
        however many choices; n choices of several prompts each count their prompt n times in
        the share alike). At least one token: a prefill always computes its last token."""
        if not self.ttft_target_s or self.cached_tokens is None or not prompt_tokens:
            return prompt_tokens
        cached: dict[int, int] = {}  # one estimate per prompt list, however many choices
        whole = found = 0
        for s in specs:
            prompt = s.prompt_token_ids
            if id(prompt) not in cached:
                cached[id(prompt)] = min(len(prompt), self.cached_tokens(prompt, s.cache_salt or ""))
            whole += len(prompt)
            found += cached[id(prompt)]
        return max(1, prompt_tokens - round(prompt_tokens * found / max(whole, 1)))

    def _within_limits(self, tenant: Tenant, specs: list[GenerationSpec]) -> list[GenerationSpec]:
        longest = max(len(s.prompt_token_ids) for s in specs)
        if tenant.max_prompt_tokens and longest > tenant.max_prompt_tokens:
            raise self._reject(tenant, "too_long", APIError.invalid(
                f"The prompt has {longest} tokens; tenant {tenant.name} may send at most "
                f"{tenant.max_prompt_tokens}.", code="prompt_too_long"))
        cap = tenant.max_output_tokens
        if not cap or all(s.params.max_tokens <= cap for s in specs):
            return specs
        return [dataclasses.replace(s, params=dataclasses.replace(
            s.params, max_tokens=min(cap, s.params.max_tokens))) for s in specs]

    def _check_on_time(self, ticket: Ticket) -> None:
        if not self.ttft_target_s:
            return
        requests, tokens = self.queue.ahead(ticket)
        room = requests == 0 and self._blind(ticket) and (
            self.room.has_room(self.inflight, ticket.prompt_tokens, ticket.blocks)
            or (self._owed(ticket) and self.room.fits(ticket.prompt_tokens, ticket.blocks)))
        slot_in = None if room else self.running.nth_end_s(
            requests, self.estimator.service_at(self.prefilling_tokens, self.prefilling_extra))
        extra = self.prefilling_extra + ticket.extra_choices
        plain = self.estimator.estimate(requests, tokens, ticket.prefill_tokens, room,
                                        self.inflight, self.prefilling_tokens, slot_in, extra)
        if plain is None:
            return
        # Judged only where the estimator is trusted: an untrusted guess's miss, or that of a
        # line extrapolated beyond the loads it was fitted on, is no evidence of how wrong the
        # fitted line is (see TTFTEstimator.trusted, .trusted_at).
        judged = self.estimator.trusted_at(self.prefilling_tokens + ticket.prefill_tokens, extra)
        ticket.predicted_ttft_s = plain if judged else None
        predicted = plain + self.estimator.margin(self.ttft_target_s)
        budget = ticket.deadline - ticket.arrival
        if log.isEnabledFor(logging.DEBUG):
            drain = self.estimator.requests_per_s
            log.debug("judged: %d prompt tokens (%d to prefill), %d ahead, %d prefilling, "
                      "%d extra choices, %d in flight, room %s, a slot in %s, drain %s, "
                      "service %.3fs, estimate %.3fs + margin %.3fs, budget %.3fs",
                      ticket.prompt_tokens, ticket.prefill_tokens, requests,
                      self.prefilling_tokens, extra, self.inflight, room,
                      "-" if slot_in is None else f"{slot_in:.3f}s",
                      "-" if drain is None else f"{drain:.2f} req/s", self._service_s(ticket),
                      plain, predicted - plain, budget)
        if predicted > budget:
            retry = self.retry_schedule.retry_after_s(predicted - budget,
                                                      self._per_request_s(ticket))
            uncached = ("" if ticket.prefill_tokens == ticket.prompt_tokens
                        else f", {ticket.prefill_tokens} of its tokens not cached")
            allowed = (f"the {self.ttft_target_s:g}s target" if budget <= self.ttft_target_s
                       else f"the {budget:.2f}s allowed for a {ticket.prompt_tokens}-token "
                            f"prompt{uncached} (its own prefill plus half the "
                            f"{self.ttft_target_s:g}s target)")
            raise self._reject(ticket.tenant, "ttft_predicted", APIError(
                503, f"Overloaded: the predicted time to first token ({predicted:.2f}s) exceeds "
                     f"{allowed}; retry in {retry}s.",
                "server_error", None, "ttft_unattainable", retry))
        if room:  # on time, with nothing ahead: those told to come back later will be too
            self.retry_schedule.room()

    def _ttft_budget_s(self, prefill_tokens: int, extra_choices: int) -> float:
        """How long this request may take to its first token before it is refused or dropped:
        the TTFT target, or, for a prompt whose own prefill takes most of it, that prefill plus
        half the target of waiting. The target bounds the wait others' work imposes; a long
        prompt whose prefill alone exceeds it would otherwise be refused on every try, on an
        idle cluster too, however often it came back."""
        own = self.estimator.service_at(prefill_tokens, extra_choices)
        return max(self.ttft_target_s, own + self.ttft_target_s / 2)

    def _drain(self) -> None:
        """Release requests in the policy's order while the cluster has room, then those of
        tenants below their share; then drop those left waiting that can no longer be on
        time. (A request with room goes, whatever the estimate says now: it was judged when it
        was admitted, and only waiting for room can make it later than that.)"""
        now = time.monotonic()
        while (ticket := self.queue.peek()) is not None:
            if not (self._blind(ticket)
                    and self.room.has_room(self.inflight, ticket.prompt_tokens, ticket.blocks)):
                break
            self._release(ticket, now)
        while True:
            owed = [t for t in self.queue.owed(self.room.inflight_limit())
                    if self._blind(t) and self.room.fits(t.prompt_tokens, t.blocks)]
            if not owed:
                break
            self._release(min(owed, key=lambda t: t.seq), now)
        while expired := [t for t in self.queue.heads() if self._late(t, now)]:
            for ticket in expired:
                self._drop(ticket)
        self.estimator.backlog(len(self.queue) > 0)
        if len(self.queue):
            self._wake.set()

    def _late(self, ticket: Ticket, now: float) -> bool:
        """Released now, it would still miss its deadline: judged at the load it would be
        released into, for its prompt. Never in an idle cluster, which has room for anything
        (and whose first token re-teaches the estimator whatever a burst taught it)."""
        if self.inflight == 0:
            return False
        return ticket.deadline < now + self._service_s(ticket)

    def _per_request_s(self, ticket: Ticket) -> float:
        """The cluster's time per request: one over its measured drain rate, else this one's
        service time."""
        rate = self.estimator.requests_per_s
        return 1.0 / rate if rate else self._service_s(ticket)

    def _service_s(self, ticket: Ticket) -> float:
        """Its release -> first token if released now, behind the prompts still prefilling."""
        return self.estimator.service_at(self.prefilling_tokens + ticket.prefill_tokens,
                                         self.prefilling_extra + ticket.extra_choices)

    def _release(self, ticket: Ticket, now: float) -> None:
        self.queue.pop(ticket)
        self.estimator.released(ticket.prompt_tokens)
        self.prefilling_tokens += ticket.prefill_tokens
        self.prefilling_extra += ticket.extra_choices
        ticket.prefill_at_release = self.prefilling_tokens
        ticket.extra_at_release = self.prefilling_extra
        self.inflight += ticket.slots
        self.running.add(ticket)
        ticket.released_at = now
        self.room.released(ticket.prompt_tokens, ticket.blocks)
        self.metrics.queue_wait.labels(self.metrics.model, ticket.tenant.name).observe(
            now - ticket.arrival)
        if not ticket._ready.done():
            ticket._ready.set_result(None)

    def _blind(self, ticket: Ticket) -> bool:
        """Room before the estimator has measured a first token, when every estimate is 0 s:
        at most BLIND_PREFILL_TOKENS prefilling (a fresh gateway, a restarted one under
        traffic too, released whatever came: twelve 4,000-token prompts at once waited 35-81 s
        for their first tokens). The rest wait here, to be judged once there is a measure."""
        return (not self.ttft_target_s or self.estimator.service_s is not None
                or self.inflight == 0
                or self.prefilling_tokens + ticket.prefill_tokens <= BLIND_PREFILL_TOKENS)

    def _owed(self, ticket: Ticket) -> bool:
        """Below its share's weighted part of the in-flight limit: such a request need not
        wait for the limit, so a tenant (or anonymous client) crowded out while it was idle
        gets its share back at once rather than after others' requests finish. The limit is
        then exceeded briefly (by at most the limit itself), and nothing else is released
        until it is back under."""
        return self.queue.within_share(ticket, self.room.inflight_limit())

    def _drop(self, ticket: Ticket) -> None:
        self.queue.remove(ticket)
        ticket.done = True
        now = time.monotonic()
        self.estimator.missed(ticket.predicted_ttft_s,
                              now - ticket.arrival + self._service_s(ticket))
        self.quotas.release(ticket.lease, 0)
        budget = ticket.deadline - ticket.arrival
        retry = self.retry_schedule.retry_after_s(budget, self._per_request_s(ticket))
        error = self._reject(ticket.tenant, "ttft_expired", APIError(
            503, f"Overloaded: the request waited past its {budget:.3g}s time-to-first-"
                 f"token target; retry in {retry}s.", "server_error", None,
            "ttft_deadline_passed", retry))
        if not ticket._ready.done():
            ticket._ready.set_exception(error)

    # -- what a ticket reports (ticket.TicketEvents) ------------------------------------------

    def finished(self, ticket: Ticket) -> None:
        if ticket.released_at is None:
            self.queue.remove(ticket)
        else:
            self.inflight -= ticket.slots
            self.running.remove(ticket)
            if ticket.first_token_at is None:
                self.prefilling_tokens -= ticket.prefill_tokens
                self.prefilling_extra -= ticket.extra_choices
            self.queue.finished(ticket)
            self.estimator.finished(time.monotonic() - ticket.released_at)
        served_prompt = ticket.prompt_tokens if ticket.first_token_at is not None else 0
        if ticket.lease is not None:
            self.quotas.release(ticket.lease, served_prompt + ticket.output_tokens)
        tokens = self.metrics.tokens
        tokens.labels(ticket.tenant.name, "prompt").inc(served_prompt)
        tokens.labels(ticket.tenant.name, "output").inc(ticket.output_tokens)
        self._drain()

    def tokens(self, ticket: Ticket, count: int) -> None:
        self.running.tokens(ticket, count)
        self.queue.charge_output(ticket, count)

    def first_token(self, ticket: Ticket) -> None:
        self.prefilling_tokens -= ticket.prefill_tokens
        self.prefilling_extra -= ticket.extra_choices
        self.metrics.ttft.labels(self.metrics.model, ticket.tenant.name).observe(
            ticket.first_token_at - ticket.arrival)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("first token: %.3fs after release with %d tokens and %d extra choices "
                      "to prefill (fit says %.3fs), TTFT %.3fs, predicted %s",
                      ticket.first_token_at - ticket.released_at, ticket.prefill_at_release,
                      ticket.extra_at_release, self.estimator.service_at(
                          ticket.prefill_at_release, ticket.extra_at_release),
                      ticket.first_token_at - ticket.arrival, ticket.predicted_ttft_s)
        self.estimator.first_token(ticket.first_token_at - ticket.released_at,
                                   ticket.predicted_ttft_s,
                                   ticket.first_token_at - ticket.arrival,
                                   ticket.prefill_at_release, ticket.extra_at_release)

    def _reject(self, tenant: Tenant, reason: str, error: APIError) -> APIError:
        self.metrics.rejected.labels(tenant.name, reason).inc()
        error.rejected_by = reason
        return error

    async def _tick(self) -> None:
        while True:
            await self._wake.wait()
            await asyncio.sleep(TICK_S)
            self._wake.clear()
            try:
                self._drain()
            except Exception:  # a bug here must not stop releasing requests
                log.exception("admission dispatcher failed")

