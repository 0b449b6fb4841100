"""Iteration-level scheduling: which requests run this step and how many tokens each.

Running requests first (decode tokens and unfinished prefill chunks), then waiting ones in
(priority, arrival) order, all under one token budget. When blocks run out, the lowest
priority, newest running request is preempted by recompute. Imports no torch.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

from engine.kv_cache_manager import KVCacheManager
from engine.outputs import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    RequestOutput,
    SchedulerOutput,
)
from engine.remote_kv import RemoteKVReservations, Settled
from engine.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    # Longest prefill chunk one request may take in a step that also carries decoding
    # requests (chunked prefill): their tokens wait for the whole step. A step of prompts
    # alone takes each whole, up to the token budget: chunks there delay nobody and cost time.
    long_prefill_token_threshold: int = 512
    # The threshold cuts prompts in steps where nothing decodes too (tests of chunked prefill).
    chunk_prompts_alone: bool = False
    enable_chunked_prefill: bool = True
    # A waiting prompt whose next blocks a prompt scheduled this step computes waits a step
    # and reads them from the prefix cache, or takes them in this step when they are fewer
    # than MIN_SHARED_TOKENS_TO_WAIT tokens. False: it computes them too (as before; kept as
    # bench/prefill.py's baseline).
    wait_for_shared_blocks: bool = True
    # Step-time target for steps that carry decoding requests: they take only the prompt
    # tokens measured to fit (engine/step_budget.py). 0: off.
    itl_target_s: float = 0.0


# A waiting prompt waits a step for shared blocks only to skip at least this many tokens: a
# step costs ~30 ms of its own on SmolLM2 here, what about 100 prompt tokens cost to compute
# (two prompts sharing 64 tokens: the later first token came 11 ms later for waiting). Fewer
# are taken in the same step. Waiting for more keeps the first prompt's step small: 12 chats
# behind a new 1,100-token system prompt taken in one step all got their first tokens later
# than the first one's had come when the others waited (README, the scheduler).
MIN_SHARED_TOKENS_TO_WAIT = 128


def _order_key(request: Request) -> tuple[int, float]:
    return (request.priority, request.arrival_time)


def _fit_proposals(request: Request, spec_token_ids: dict[str, list[int]] | None,
                   room: int) -> list[int]:
    """The proposals to verify for a request: only one that is decoding (one token without
    KV), cut to the budget left after its own token."""
    if not spec_token_ids or request.num_tokens - request.num_computed_tokens != 1:
        return []
    return list(spec_token_ids.get(request.request_id, ())[: max(room, 0)])


def _prefill_left(request: Request) -> int:
    """Tokens of a running request's prefill not yet computed (0 once it decodes). A request
    resumed after preemption recomputes its outputs too, except the newest, which it decodes."""
    left = request.num_tokens - request.num_computed_tokens
    return left if left > 1 or request.num_output_tokens == 0 else 0


class Scheduler:
    """Owned by the engine thread."""

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # sorted by _order_key
        self.running: list[Request] = []
        self.remote = RemoteKVReservations(kv_cache_manager)  # decode role
        self._finished_ids: set[str] = set()
        # Runner-side knowledge: which requests it holds state for.
        self._known_to_runner: set[str] = set()
        self.num_preemptions = 0

    # -- admission -----------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        bisect.insort(self.waiting, request, key=_order_key)

    # -- remote KV (decode role: engine/remote_kv.py) -----------------------------------------

    @property
    def waiting_for_kv(self) -> dict[str, Request]:
        """Requests with blocks reserved for KV a prefill worker sends, by id."""
        return self.remote.requests

    def reserve_for_remote_kv(self, request: Request, reuse_cached_prefix: bool = False
                              ) -> list[int] | None:
        """Allocate blocks for the prompt now; the KV arrives later. Returns the ids of the
        blocks to receive it, or None (nothing changed) when the cache cannot hold the
        prompt. `reuse_cached_prefix`: the prompt's cached prefix blocks are adopted, not
        received (request.kv_reused_tokens), and only the blocks after them are reserved."""
        block_ids = self.remote.reserve(request, reuse_cached_prefix)
        if block_ids is not None:
            self.requests[request.request_id] = request
        return block_ids

    def remote_kv_arrived(self, request_id: str, first_token: int) -> Request | None:
        """The prompt's KV is in the reserved blocks: the request joins the running batch
        with its first token (sampled by the prefill worker) already appended, as do those
        that waited for its blocks."""
        request = self.remote.requests.get(request_id)
        if request is not None:
            self._apply(self.remote.arrived(request_id, first_token))
        return request

    def remote_kv_overdue(self, reserved_before: float) -> list[str]:
        """Requests still waiting for remote KV that were reserved before `reserved_before`
        (time.monotonic())."""
        return self.remote.overdue(reserved_before)

    def recompute_locally(self, request_id: str) -> bool:
        """KV transfer failed: drop the reservation and prefill the prompt here instead (a
        first token already received is kept: the prompt and it are recomputed, as after a
        preemption, and the next token is sampled here)."""
        settled = self.remote.lost(request_id)
        if settled is None:
            return False
        self._apply(settled)
        return True

    def _apply(self, settled: Settled) -> None:
        for request in settled.run:
            request.status = RequestStatus.RUNNING
            self.running.append(request)
        for request in settled.recompute:
            request.status = RequestStatus.WAITING
            bisect.insort(self.waiting, request, key=_order_key)
        for request in settled.finished:
            self._finish(request)  # its stream ends at the gateway, with that token

    def abort(self, request_id: str) -> Request | None:
        """No-op (None) for unknown or finished requests."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
            self._apply(self.remote.abort(request_id))
        else:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED_ABORTED
        self._finish(request)
        return request

    # -- one step ------------------------------------------------------------------------

    def num_decoding(self) -> int:
        """Running requests past their prefill: the rows a step's prompt tokens delay."""
        return sum(1 for r in self.running if not _prefill_left(r))

    def schedule(self, spec_token_ids: dict[str, list[int]] | None = None,
                 prompt_budget: int | None = None) -> SchedulerOutput:
        """`spec_token_ids`: proposals per decoding request (speculative decoding). Each is
        verified in this step if its slots fit the budget and the cache, shortened or
        dropped otherwise; a proposal never causes a preemption. `prompt_budget`: the most
        prompt tokens (prefill chunks, recomputes) this step takes; None: the token budget
        alone decides."""
        budget = self.config.max_num_batched_tokens
        chunked = self.config.enable_chunked_prefill
        # The longest prefill chunk this step: the threshold where it delays decoding
        # requests (or always, with chunk_prompts_alone); otherwise the budget alone.
        cut = chunked and (self.config.chunk_prompts_alone or self.num_decoding() > 0)
        chunk_limit = self.config.long_prefill_token_threshold if cut else budget
        prompt_left = budget if prompt_budget is None or not chunked else prompt_budget
        num_scheduled: dict[str, int] = {}
        scheduled_spec: dict[str, list[int]] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted: set[str] = set()

        # Full blocks this step computes that the prefix cache will hold after it, by hash: a
        # waiting prompt whose next blocks are among them waits a step and reads them from the
        # cache instead of computing them again (16 prompts sent together behind a new
        # 680-token system prompt: three of them computed it in one step), or, when they are
        # too few to be worth a step, takes them and reads them in this same step (the 8
        # choices of a chat computed their two shared blocks 8 times).
        computing: dict[int, tuple] = {}
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, chunk_limit, budget)
            prompt = _prefill_left(request) > 0
            if prompt:
                num_new = min(num_new, prompt_left)
            if num_new <= 0:
                i += 1
                continue
            spec = _fit_proposals(request, spec_token_ids, budget - num_new)
            num_new += len(spec)
            while True:
                new_block_ids = self.kv.allocate_slots(request, num_new)
                if new_block_ids is not None:
                    break
                if spec:  # no room to verify: decode one token rather than preempt for it
                    num_new -= len(spec)
                    spec = []
                    continue
                # Only requests not yet scheduled this step are candidates, so nothing
                # already emitted has to be taken back.
                victim = max(self.running[i:], key=_order_key)
                self._preempt(victim)
                preempted.add(victim.request_id)
                if victim is request:
                    break
            if new_block_ids is None:
                continue  # this request was the victim; running[i] is now the next one
            num_scheduled[request.request_id] = num_new
            if spec:
                scheduled_spec[request.request_id] = spec
            budget -= num_new
            if prompt:
                prompt_left -= num_new
                self._note_computing(request, num_new, computing)
            self._emit(request, new_block_ids, new_reqs, cached_reqs)
            i += 1

        # Requests preempted this step must not be rescheduled in the same step.
        w = 0  # waiting requests before it wait for a block this step computes
        while (w < len(self.waiting) and min(budget, prompt_left) > 0
               and len(self.running) < self.config.max_num_seqs):
            if preempted:
                break
            request = self.waiting[w]
            hit_blocks: list = []
            num_hit = 0
            # Prompt logprobs need every prompt position computed, so no prefix reuse.
            looked_up = (request.num_computed_tokens == 0
                         and request.sampling_params.prompt_logprobs is None)
            if looked_up:
                hit_blocks, num_hit = self.kv.get_computed_blocks(request)
                if computing:  # empty unless wait_for_shared_blocks
                    run = self.kv.computing_run(request, num_hit, computing)
                    if len(run) * self.kv.block_size >= MIN_SHARED_TOKENS_TO_WAIT:
                        w += 1
                        continue
                    hit_blocks += run
                    num_hit += len(run) * self.kv.block_size
            num_new = request.num_tokens - request.num_computed_tokens - num_hit
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, chunk_limit, budget, prompt_left)
            new_block_ids = self.kv.allocate_slots(request, num_new, hit_blocks)
            if new_block_ids is None:
                break
            self.waiting.pop(w)
            # Usage and the prefix-cache statistics count the prompt tokens served from the
            # cache at first admission, once: not each step the request waited at the head of
            # the queue, nor on resumption, where the hits are mostly its own output blocks.
            if request.status == RequestStatus.WAITING:
                # A resumed (migrated) request's hits past its prompt are its own outputs.
                request.num_cached_tokens = min(num_hit, request.num_prompt_tokens)
                if looked_up:
                    self.kv.record_prefix_lookup(request.num_tokens, num_hit)
            if request.first_scheduled_ns is None:
                request.first_scheduled_ns = time.time_ns()
            request.num_computed_tokens += num_hit
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            prompt_left -= num_new
            self._note_computing(request, num_new, computing)
            self._emit(request, new_block_ids, new_reqs, cached_reqs)

        finished, self._finished_ids = self._finished_ids, set()
        ordered = {r.request_id: num_scheduled[r.request_id] for r in self.running
                   if r.request_id in num_scheduled}
        return SchedulerOutput(
            new_requests=new_reqs,
            cached_requests=cached_reqs,
            num_scheduled_tokens=ordered,
            total_num_scheduled_tokens=sum(ordered.values()),
            finished_request_ids=finished,
            spec_token_ids=scheduled_spec,
            preempted_request_ids=preempted,
        )

    def _note_computing(self, request: Request, num_new: int, computing: dict[int, tuple]) -> None:
        """A prompt's `num_new` tokens are scheduled: the full blocks they complete, which a
        prompt waiting behind it waits for or takes in this step."""
        if self.config.wait_for_shared_blocks:
            computing.update(self.kv.computing_blocks(request, num_new))

    def _emit(self, request: Request, new_block_ids: list[int], new_reqs, cached_reqs) -> None:
        rid = request.request_id
        if rid in self._known_to_runner:
            num_kept = len(self.kv.block_ids(rid)) - len(new_block_ids)
            cached_reqs.append(CachedRequestData(rid, new_block_ids, request.num_computed_tokens,
                                                 num_kept))
            return
        self._known_to_runner.add(rid)
        new_reqs.append(
            NewRequestData(
                request_id=rid,
                token_ids=list(request.all_token_ids),
                sampling_params=request.sampling_params,
                block_ids=self.kv.block_ids(rid),
                num_computed_tokens=request.num_computed_tokens,
                num_prompt_tokens=request.num_prompt_tokens,
            )
        )

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        self._known_to_runner.discard(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, request, key=_order_key)

    def _finish(self, request: Request, keep_kv: bool = False) -> None:
        if not keep_kv:
            self.kv.free(request)
        self._known_to_runner.discard(request.request_id)
        self._finished_ids.add(request.request_id)
        self.requests.pop(request.request_id, None)

    def release_held_kv(self, request: Request) -> None:
        """Prefill role: the KV has been copied out; its blocks may be reused (and stay in
        the prefix cache until evicted)."""
        self.kv.free(request)

    # -- after the forward pass ----------------------------------------------------------

    def update(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for rid, num_tokens in sched.num_scheduled_tokens.items():
            request = self.requests.get(rid)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            spec = sched.spec_token_ids.get(rid) if sched.spec_token_ids else None
            if not spec:
                request.num_computed_tokens += num_tokens
            sampled = result.sampled_token_ids.get(rid, ())
            logprobs = result.logprobs.get(rid, [])
            new_tokens: list[int] = []
            for token in sampled:
                request.append_output_token(token)
                new_tokens.append(token)
                if request.check_stop():
                    break
            request.output_logprobs.extend(
                (lp.logprob, lp.top) for lp in logprobs[: len(new_tokens)]
            )
            if spec:
                # Verified: KV stands for every token but the newest (the accepted run), not
                # for the rejected proposals, whose slots are released here. This is the only
                # trim: the runner's copy of the table follows from the next CachedRequestData.
                request.num_computed_tokens = request.num_tokens - 1
                if not request.is_finished:
                    self.kv.trim(request, request.num_computed_tokens)
            self.kv.cache_blocks(request)
            prompt_lps = result.prompt_logprobs.get(rid)
            if not new_tokens and prompt_lps is None:
                continue
            if request.is_finished:
                self.running.remove(request)
                self._finish(request, keep_kv=request.hold_kv)
            outputs.append(
                RequestOutput(
                    request_id=rid,
                    new_token_ids=new_tokens,
                    finished=request.is_finished,
                    finish_reason=request.finish_reason,
                    new_logprobs=list(logprobs[: len(new_tokens)]),
                    prompt_logprobs=prompt_lps,
                    num_prompt_tokens=request.num_prompt_tokens,
                    num_cached_tokens=request.num_cached_tokens,
                    kv_reused_tokens=request.kv_reused_tokens,
                    num_output_tokens=request.num_output_tokens,
                    first_scheduled_ns=request.first_scheduled_ns,
                    kv_arrived_ns=request.kv_arrived_ns,
                )
            )
        return outputs

    # -- introspection -------------------------------------------------------------------

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.waiting_for_kv)

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens still to be computed: all of a waiting request's, and the rest of a
        running one's prompt while it is in (chunked) prefill. A decoding request's one
        uncomputed token is decode work, not queued prefill."""
        return (sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)
                + sum(_prefill_left(r) for r in self.running))
