"""A request as the engine sees it: tokens, how many have KV computed, and why it stopped."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine.block_pool import root_hash
from engine.outputs import ComputeSeconds
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # the scheduling modules import no torch; the proposer makes it
    from engine.token_counts import TokenCounts


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KV = enum.auto()  # decode role: blocks reserved, KV comes from a prefill worker
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    # Prefill role: the first token is sampled and the KV goes to a decode worker. Done here,
    # but the request itself goes on, so there is no finish reason.
    FINISHED_HANDED_OFF = enum.auto()

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """Owned by the engine thread. There are no phases: `num_computed_tokens` catches up with
    `num_tokens`, which covers chunked prefill, prefix hits, preemption and remote KV alike."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        priority: int = 0,
        arrival_time: float | None = None,
        hold_kv: bool = False,
        max_model_len: int | None = None,
        cache_salt: str = "",
        output_token_ids: Sequence[int] = (),
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        # Prefill role: keep the blocks after the first token so the KV can be shipped.
        self.hold_kv = hold_kv
        # Both roles, disaggregated: prompt tokens (whole blocks from the start) whose KV the
        # decode worker already held, so it is not shipped. Prefill role: the held KV sent
        # starts after them. Decode role: the reserved blocks start after them. Not usage's
        # cached tokens: the prefill worker computed them.
        self.kv_reused_tokens = 0
        # Decode role: requests whose reserved blocks this one adopted before their KV landed
        # (Scheduler.reserve_for_remote_kv); it starts only once theirs has. Its own KV, if it
        # lands first, waits with its first token (parked_first_token). `kv_lost`: one of
        # them never will; this one is recomputed here once its own first token is in.
        self.kv_awaits: set[str] = set()
        self.parked_first_token: int | None = None
        self.kv_lost = False
        self.max_model_len = max_model_len
        # Seeds the chain of block hashes: requests with different salts (tenants) never share
        # a cached block. Raises ValueError for a salt block_pool would not hash.
        self.cache_salt = cache_salt
        self.block_hash_root = root_hash(cache_salt)

        # `output_token_ids`: what this request already generated elsewhere (a migrated
        # request): outputs to penalties, max_tokens and stop checks, as after a preemption.
        self.all_token_ids: list[int] = [*prompt_token_ids, *output_token_ids]
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache
        self.status = RequestStatus.WAITING
        # Hashes of the full blocks of all_token_ids, chained from block_hash_root.
        self.block_hashes: list[int] = []
        self.output_logprobs: list[tuple[float, dict[int, float]]] = []
        # Penalty counts over all_token_ids for the draft proposer's own sampling (the model
        # runner keeps its own beside its copy of the tokens); made by the proposer on first use.
        self.draft_token_counts: TokenCounts | None = None
        self.num_preemptions = 0
        # Wall-clock (ns) milestones for traces: first scheduled, remote KV written.
        self.first_scheduled_ns: int | None = None
        self.kv_arrived_ns: int | None = None
        # Seconds of engine time charged to this request (engine/step_cost.py): its share of
        # each step it ran in, by phase, and the copies of its KV for a transfer.
        self.prefill_seconds = 0.0
        self.decode_seconds = 0.0
        self.transfer_seconds = 0.0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    @property
    def compute_seconds(self) -> ComputeSeconds:
        return ComputeSeconds(self.prefill_seconds, self.decode_seconds, self.transfer_seconds)

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def check_stop(self) -> bool:
        """Set a finished status if the last token or the length ends the request."""
        params = self.sampling_params
        last = self.all_token_ids[-1]
        if (not params.ignore_eos and last in self.eos_token_ids) or last in params.stop_token_ids:
            self.status = RequestStatus.FINISHED_STOPPED
            return True
        if self.num_output_tokens >= params.max_tokens or (
            self.max_model_len is not None and self.num_tokens >= self.max_model_len
        ):
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        if self.hold_kv:
            # Whatever max_tokens says, a prefill worker stops after the first token.
            self.status = RequestStatus.FINISHED_HANDED_OFF
            return True
        return False

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )
