"""Plain-data messages between scheduler, model runner and engine callers.

Only lists, ints and frozen dataclasses: a SchedulerOutput can be pickled to the other ranks
of a tensor-parallel worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequestData:
    """A request the runner has not seen (or must forget and re-learn after preemption)."""

    request_id: str
    token_ids: list[int]  # prompt plus any output so far
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    num_prompt_tokens: int


@dataclass(frozen=True)
class CachedRequestData:
    """A diff for a request the runner already tracks. The scheduler alone decides a block
    table: the runner keeps the first `num_kept_blocks` of its copy (fewer than it holds when
    the scheduler released the slots of rejected proposals) and appends `new_block_ids`."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    num_kept_blocks: int


@dataclass(frozen=True)
class SchedulerOutput:
    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # per request, in batch order
    total_num_scheduled_tokens: int
    finished_request_ids: set[str]  # runner may drop their state
    # Proposed tokens to verify, per request (speculative decoding); scheduled tokens include them.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Preempted requests lose their KV; the runner forgets them until they return as new.
    preempted_request_ids: set[str] = field(default_factory=set)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(frozen=True)
class Logprobs:
    """Logprob of the chosen token and the top-n alternatives (token id -> logprob)."""

    logprob: float
    rank: int
    top: dict[int, float]


@dataclass(frozen=True)
class ModelRunnerOutput:
    # Tokens sampled per request; empty for a prefill chunk that did not reach the end.
    # More than one when speculative tokens were accepted.
    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[Logprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[Logprobs | None]] = field(default_factory=dict)


@dataclass(frozen=True)
class ComputeSeconds:
    """Worker wall time charged to one request (cost per query). `prefill` and `decode`: its
    shares of the engine steps it ran in; `transfer`: engine time spent copying its KV out of
    the cache for sending (prefill worker) or into the reserved blocks (decode worker)."""

    prefill: float = 0.0
    decode: float = 0.0
    transfer: float = 0.0

    @property
    def total(self) -> float:
        return self.prefill + self.decode + self.transfer

    def __add__(self, other: ComputeSeconds) -> ComputeSeconds:
        return ComputeSeconds(self.prefill + other.prefill, self.decode + other.decode,
                              self.transfer + other.transfer)

    def since(self, earlier: ComputeSeconds) -> ComputeSeconds:
        """What a running total charged after `earlier`, an earlier value of it (a phase that
        went down, from a confused peer, counts as nothing, never as a credit)."""
        return ComputeSeconds(max(0.0, self.prefill - earlier.prefill),
                              max(0.0, self.decode - earlier.decode),
                              max(0.0, self.transfer - earlier.transfer))


@dataclass
class RequestOutput:
    """What a step produced for one request: a delta, not the whole text."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    new_logprobs: list[Logprobs] = field(default_factory=list)
    prompt_logprobs: list[Logprobs | None] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # Decode role, KV from a prefill worker: prompt tokens whose KV this worker held already
    # (adopted from its prefix cache, not sent).
    kv_reused_tokens: int = 0
    num_output_tokens: int = 0
    # Prefill role: the request's KV ([layers, 2, blocks, block_size, kv_heads, head_dim]).
    kv: object | None = None
    error: str | None = None
    # Wall-clock milestones (ns since epoch) for tracing.
    first_scheduled_ns: int | None = None
    kv_arrived_ns: int | None = None
    # The engine time charged to the request on this worker so far (a running total).
    compute: ComputeSeconds | None = None
