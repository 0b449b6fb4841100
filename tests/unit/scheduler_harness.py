"""The scheduler tests' fake model runner and helpers (tests/unit/test_scheduler*.py): a fake
KV cache that stores each slot's token, a next token that is a pure function of the context read
back through the block table, and a loop that runs requests to completion."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest

from engine.kv_cache_manager import KVCacheManager
from engine.outputs import ModelRunnerOutput, RequestOutput, SchedulerOutput
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig

BLOCK = 4
_arrival = itertools.count()


@dataclass
class _RunnerState:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int


class FakeRunner:
    """Mirrors the real ModelRunner's bookkeeping from the scheduler's diffs, with a fake KV
    cache: each slot stores the token written there. A sampled token is a pure function of the
    context *read back through the block table*, so a wrong block id, a stale prefix hit or a
    lost diff changes the output (or trips an assertion) just as it would with a real model."""

    def __init__(self, num_blocks: int) -> None:
        self.kv: list[int | None] = [None] * (num_blocks * BLOCK)
        self.states: dict[str, _RunnerState] = {}

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        for rid in sched.finished_request_ids | sched.preempted_request_ids:
            self.states.pop(rid, None)
        for new in sched.new_requests:
            assert new.request_id not in self.states, "runner told twice about a new request"
            self.states[new.request_id] = _RunnerState(
                list(new.token_ids), list(new.block_ids), new.num_computed_tokens
            )
        for diff in sched.cached_requests:
            state = self.states[diff.request_id]
            assert diff.num_computed_tokens == state.num_computed_tokens
            state.block_ids.extend(diff.new_block_ids)
        assert sched.total_num_scheduled_tokens == sum(sched.num_scheduled_tokens.values())
        sampled: dict[str, list[int]] = {}
        for rid, n in sched.num_scheduled_tokens.items():
            state = self.states[rid]
            start, end = state.num_computed_tokens, state.num_computed_tokens + n
            assert 0 < n and end <= len(state.token_ids)
            assert len(state.block_ids) * BLOCK >= end, "scheduled tokens without a KV slot"
            for pos in range(start, end):
                self.kv[self._slot(state, pos)] = state.token_ids[pos]
            state.num_computed_tokens = end
            if end == len(state.token_ids):
                context = [self.kv[self._slot(state, pos)] for pos in range(end)]
                assert context == state.token_ids, f"{rid}: KV read back does not match its tokens"
                token = next_token(context)
                state.token_ids.append(token)
                sampled[rid] = [token]
        return ModelRunnerOutput(sampled_token_ids=sampled)

    @staticmethod
    def _slot(state: _RunnerState, pos: int) -> int:
        return state.block_ids[pos // BLOCK] * BLOCK + pos % BLOCK


def next_token(context: list[int]) -> int:
    """Stands in for greedy decoding: depends on every token and its position."""
    return sum((i + 1) * t for i, t in enumerate(context)) % 97 + 3


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


def make_scheduler(num_blocks: int = 64, prefix_caching: bool = True, **config) -> Scheduler:
    # A test that names the threshold gets its chunks in every step, decoding or not.
    config.setdefault("chunk_prompts_alone", "long_prefill_token_threshold" in config)
    return Scheduler(SchedulerConfig(**config), KVCacheManager(num_blocks, BLOCK, prefix_caching))


def make_request(rid: str, prompt: list[int], max_tokens: int = 4, priority: int = 0,
                 params: SamplingParams | None = None, **kw) -> Request:
    params = params or SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return Request(rid, prompt, params, priority=priority, arrival_time=next(_arrival), **kw)


def prompt_of(length: int, start: int = 10) -> list[int]:
    return [(start + 7 * i) % 90 + 5 for i in range(length)]


@dataclass
class Trace:
    outputs: dict[str, list[int]]
    finish_reasons: dict[str, str | None]
    steps: list[SchedulerOutput]
    request_outputs: list[list[RequestOutput]]


def run_to_completion(scheduler: Scheduler, runner: FakeRunner | None = None, max_steps: int = 500) -> Trace:
    runner = runner or FakeRunner(scheduler.kv.num_blocks)
    trace = Trace({}, {}, [], [])
    for _ in range(max_steps):
        if not scheduler.num_unfinished:
            break
        sched = scheduler.schedule()
        step_outputs = scheduler.update(sched, runner.execute(sched))
        trace.steps.append(sched)
        trace.request_outputs.append(step_outputs)
        for out in step_outputs:
            trace.outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                trace.finish_reasons[out.request_id] = out.finish_reason
    else:
        pytest.fail(f"requests did not finish in {max_steps} steps: {scheduler.running + scheduler.waiting}")
    return trace


def assert_no_blocks_held(scheduler: Scheduler) -> None:
    pool = scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    assert scheduler.kv._req_blocks == {}
