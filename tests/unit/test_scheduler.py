"""Scheduler against a fake model runner: token budget, chunked prefill, priority order,
preemption (newest / lowest priority first, resumed with identical output), aborts, remote KV,
and that every block is free once every request has finished."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest

from engine.kv_cache_manager import KVCacheManager
from engine.outputs import ModelRunnerOutput, RequestOutput, SchedulerOutput
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import MIN_SHARED_TOKENS_TO_WAIT, Scheduler, SchedulerConfig

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


def make_request(rid: str, prompt: list[int], max_tokens: int = 4, priority: int = 0, **kw) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
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


# -- budget and chunking ------------------------------------------------------------------


def test_token_budget_and_chunk_limit_hold_every_step_and_output_is_unchanged():
    scheduler = make_scheduler(max_num_batched_tokens=10, long_prefill_token_threshold=6)
    prompts = {"a": prompt_of(23, 1), "b": prompt_of(3, 2), "c": prompt_of(9, 3), "d": prompt_of(1, 4)}
    for rid, prompt in prompts.items():
        scheduler.add_request(make_request(rid, prompt, max_tokens=5))
    trace = run_to_completion(scheduler)
    for sched in trace.steps:
        assert 0 < sched.total_num_scheduled_tokens <= 10
        assert max(sched.num_scheduled_tokens.values()) <= 6
    assert trace.outputs == {rid: expected_output(p, 5) for rid, p in prompts.items()}
    assert set(trace.finish_reasons.values()) == {"length"}
    assert_no_blocks_held(scheduler)


def test_a_long_prompt_is_prefilled_in_chunks_and_samples_only_after_the_last_chunk():
    scheduler = make_scheduler(max_num_batched_tokens=100, long_prefill_token_threshold=8)
    scheduler.add_request(make_request("a", prompt_of(20), max_tokens=2))
    trace = run_to_completion(scheduler)
    assert [s.num_scheduled_tokens["a"] for s in trace.steps] == [8, 8, 4, 1]
    assert [len(o) for o in trace.request_outputs] == [0, 0, 1, 1]
    # The runner hears about the request once, then gets diffs.
    assert [len(s.new_requests) for s in trace.steps] == [1, 0, 0, 0]
    assert [c.num_computed_tokens for s in trace.steps for c in s.cached_requests] == [8, 16, 20]


def test_prompts_alone_are_taken_whole_and_chunked_only_beside_decoding_requests():
    # The shipped rule (chunk_prompts_alone off): a chunk delays the decoding requests of its
    # step, so only such a step cuts prompts at the threshold; prompts alone go whole, up to
    # the token budget, and in arrival order.
    config = dict(max_num_batched_tokens=30, long_prefill_token_threshold=8,
                  chunk_prompts_alone=False)
    scheduler = make_scheduler(**config)
    scheduler.add_request(make_request("a", prompt_of(20), max_tokens=3))
    scheduler.add_request(make_request("b", prompt_of(25, 3), max_tokens=3))
    trace = run_to_completion(scheduler)
    steps = [s.num_scheduled_tokens for s in trace.steps]
    # Step 1: "a" whole (20) and 10 of "b"; then "a" decodes, so "b"'s rest comes 8 at a time.
    assert steps[:3] == [{"a": 20, "b": 10}, {"a": 1, "b": 8}, {"a": 1, "b": 7}]
    assert trace.outputs == {"a": expected_output(prompt_of(20), 3),
                             "b": expected_output(prompt_of(25, 3), 3)}
    assert_no_blocks_held(scheduler)
    # A prompt longer than the budget is cut by the budget alone.
    scheduler = make_scheduler(**config)
    scheduler.add_request(make_request("long", prompt_of(70), max_tokens=1))
    trace = run_to_completion(scheduler)
    assert [s.num_scheduled_tokens["long"] for s in trace.steps] == [30, 30, 10]
    # With chunk_prompts_alone the threshold cuts every step.
    scheduler = make_scheduler(**{**config, "chunk_prompts_alone": True})
    scheduler.add_request(make_request("a", prompt_of(20), max_tokens=1))
    trace = run_to_completion(scheduler)
    assert [s.num_scheduled_tokens["a"] for s in trace.steps] == [8, 8, 4]


def test_running_requests_are_scheduled_before_waiting_ones():
    scheduler = make_scheduler(max_num_batched_tokens=6, long_prefill_token_threshold=6)
    scheduler.add_request(make_request("old", prompt_of(6), max_tokens=3))
    runner = FakeRunner(64)
    first = scheduler.schedule()
    scheduler.update(first, runner.execute(first))
    scheduler.add_request(make_request("new", prompt_of(12, 5), max_tokens=3))
    second = scheduler.schedule()
    # The decode token of "old" comes first and the new prompt gets what is left of the budget.
    assert list(second.num_scheduled_tokens.items()) == [("old", 1), ("new", 5)]


def test_chunked_prefill_disabled_admits_a_prompt_only_when_it_fits_the_budget():
    scheduler = make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False)
    scheduler.add_request(make_request("short", prompt_of(5), max_tokens=2))
    scheduler.add_request(make_request("long", prompt_of(8, 3), max_tokens=2))
    trace = run_to_completion(scheduler)
    assert trace.steps[0].num_scheduled_tokens == {"short": 5}
    assert trace.steps[1].num_scheduled_tokens == {"short": 1}  # 1 + 8 would break the budget
    assert trace.steps[2].num_scheduled_tokens == {"long": 8}
    assert_no_blocks_held(scheduler)


def test_max_num_seqs_caps_the_running_batch():
    scheduler = make_scheduler(max_num_seqs=2)
    for i in range(4):
        scheduler.add_request(make_request(f"r{i}", prompt_of(3, i), max_tokens=3))
    trace = run_to_completion(scheduler)
    assert all(len(s.num_scheduled_tokens) <= 2 for s in trace.steps)
    assert list(trace.steps[0].num_scheduled_tokens) == ["r0", "r1"]
    assert len(trace.outputs) == 4


# -- order --------------------------------------------------------------------------------


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    scheduler = make_scheduler(max_num_batched_tokens=4, long_prefill_token_threshold=4)
    for rid, priority in [("low", 2), ("high-1", 0), ("mid", 1), ("high-2", 0)]:
        scheduler.add_request(make_request(rid, prompt_of(4), max_tokens=1, priority=priority))
    trace = run_to_completion(scheduler)
    admitted = [rid for s in trace.steps for rid in (n.request_id for n in s.new_requests)]
    assert admitted == ["high-1", "high-2", "mid", "low"]


# -- preemption ---------------------------------------------------------------------------


def test_preemption_evicts_the_newest_request_and_it_resumes_with_identical_output():
    # 6 blocks of 4 tokens; three requests of 5 prompt + 8 output tokens need 4 blocks each.
    scheduler = make_scheduler(num_blocks=6, prefix_caching=False)
    prompts = {rid: prompt_of(5, i) for i, rid in enumerate(["first", "second", "third"])}
    for rid, prompt in prompts.items():
        scheduler.add_request(make_request(rid, prompt, max_tokens=8))
    trace = run_to_completion(scheduler)
    preempted = [rid for s in trace.steps for rid in sorted(s.preempted_request_ids)]
    assert preempted, "the cache was sized to force preemption"
    assert preempted[0] == "third"
    assert "first" not in preempted
    assert scheduler.num_preemptions == len(preempted)
    assert trace.outputs == {rid: expected_output(p, 8) for rid, p in prompts.items()}
    assert_no_blocks_held(scheduler)


def test_preemption_evicts_the_lowest_priority_before_the_newest():
    scheduler = make_scheduler(num_blocks=6, prefix_caching=False)
    scheduler.add_request(make_request("background", prompt_of(5, 1), max_tokens=8, priority=5))
    scheduler.add_request(make_request("urgent-a", prompt_of(5, 2), max_tokens=8))
    scheduler.add_request(make_request("urgent-b", prompt_of(5, 3), max_tokens=8))
    trace = run_to_completion(scheduler)
    preempted = [rid for s in trace.steps for rid in sorted(s.preempted_request_ids)]
    assert preempted[0] == "background"
    assert len(trace.outputs) == 3
    assert_no_blocks_held(scheduler)


def test_preempted_request_is_not_rescheduled_in_the_same_step():
    scheduler = make_scheduler(num_blocks=6, prefix_caching=False)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", prompt_of(5, i), max_tokens=8))
    trace = run_to_completion(scheduler)
    for sched in trace.steps:
        assert not sched.preempted_request_ids & set(sched.num_scheduled_tokens)
        assert not sched.preempted_request_ids & {n.request_id for n in sched.new_requests}


def test_preemption_with_prefix_caching_resumes_from_its_own_cached_blocks():
    scheduler = make_scheduler(num_blocks=7)
    prompts = {rid: prompt_of(9, i) for i, rid in enumerate(["a", "b", "c"])}
    for rid, prompt in prompts.items():
        scheduler.add_request(make_request(rid, prompt, max_tokens=10))
    trace = run_to_completion(scheduler)
    assert scheduler.num_preemptions > 0
    assert trace.outputs == {rid: expected_output(p, 10) for rid, p in prompts.items()}
    assert_no_blocks_held(scheduler)


def test_cached_prompt_tokens_never_exceed_the_prompt_after_preemption():
    # Five blocks; two requests of 4 prompt tokens grow in lockstep until the older one takes
    # the last block at token 9 and the newer one is preempted with two full, cached blocks
    # (4 prompt + 4 output tokens) that nobody evicts before it comes back.
    scheduler = make_scheduler(num_blocks=5)
    older = make_request("older", prompt_of(4, 1), max_tokens=12)
    newer = make_request("newer", prompt_of(4, 2), max_tokens=12)
    scheduler.add_request(older)
    scheduler.add_request(newer)
    trace = run_to_completion(scheduler)
    assert newer.num_preemptions == 1
    assert trace.outputs["newer"] == expected_output(prompt_of(4, 2), 12)
    # Resuming reused the cached blocks of its own output: good, but those are not cached
    # *prompt* tokens, which is what usage (and the prefix-cache statistics) report.
    resumed = [n for s in trace.steps for n in s.new_requests if n.request_id == "newer"][1]
    assert resumed.num_computed_tokens > 0
    assert scheduler.kv.prefix_hits == 0
    assert newer.num_cached_tokens == 0
    for outputs in trace.request_outputs:
        for out in outputs:
            assert out.num_cached_tokens <= out.num_prompt_tokens


# -- prefix cache -------------------------------------------------------------------------


def test_second_request_with_a_shared_prefix_skips_the_cached_blocks():
    scheduler = make_scheduler()
    shared = prompt_of(12)
    scheduler.add_request(make_request("a", shared + [1, 2], max_tokens=3))
    run_to_completion(scheduler)
    b = make_request("b", shared + [3], max_tokens=3)
    scheduler.add_request(b)
    sched = scheduler.schedule()
    assert sched.num_scheduled_tokens == {"b": 1}
    assert sched.new_requests[0].num_computed_tokens == 12
    assert sched.new_requests[0].block_ids[:3] == [0, 1, 2]
    assert b.num_cached_tokens == 12


def test_prefix_hit_reads_the_right_kv_end_to_end():
    scheduler = make_scheduler(num_blocks=16)
    runner = FakeRunner(16)
    shared = prompt_of(12)
    scheduler.add_request(make_request("a", shared + [1, 2], max_tokens=3))
    run_to_completion(scheduler, runner)
    # Fill the cache with another request so eviction order matters, then hit the prefix.
    scheduler.add_request(make_request("filler", prompt_of(20, 40), max_tokens=2))
    run_to_completion(scheduler, runner)
    scheduler.add_request(make_request("b", shared + [3, 4, 5], max_tokens=4))
    trace = run_to_completion(scheduler, runner)
    assert trace.outputs["b"] == expected_output(shared + [3, 4, 5], 4)
    assert scheduler.kv.prefix_hits >= 12
    assert_no_blocks_held(scheduler)


def test_prompts_sent_together_behind_a_new_prefix_compute_it_once():
    """Prompts that arrive together behind a prefix no block holds yet: the first computes
    it, the others wait one step and read it from the cache (before, the token budget took
    several of them whole, each computing the prefix); a prompt queued behind them that
    shares nothing is not held up; every output is unchanged."""
    scheduler = make_scheduler(num_blocks=256, max_num_batched_tokens=400)
    shared = prompt_of(MIN_SHARED_TOKENS_TO_WAIT)
    prompts = {f"p{i}": shared + [i + 1, i + 2] for i in range(3)}
    prompts["other"] = prompt_of(6, start=50)
    for rid, prompt in prompts.items():
        scheduler.add_request(make_request(rid, prompt, max_tokens=3))
    trace = run_to_completion(scheduler)
    first, second = trace.steps[0].num_scheduled_tokens, trace.steps[1].num_scheduled_tokens
    assert first == {"p0": len(shared) + 2, "other": 6}
    assert second["p1"] == second["p2"] == 2  # the shared tokens come from the cache
    for rid, prompt in prompts.items():
        assert trace.outputs[rid] == expected_output(prompt, 3)
    assert_no_blocks_held(scheduler)


def test_a_short_shared_prefix_is_taken_in_the_same_step():
    """Waiting costs a step (~30 ms on SmolLM2 here): below MIN_SHARED_TOKENS_TO_WAIT shared
    tokens the second prompt goes in the same step, and takes the first one's blocks as they
    are computed (every layer stores the step's K/V before attention reads the cache), so it
    computes only its own last token."""
    scheduler = make_scheduler(num_blocks=256, max_num_batched_tokens=400)
    shared = prompt_of(MIN_SHARED_TOKENS_TO_WAIT - BLOCK)
    scheduler.add_request(make_request("a", shared + [1], max_tokens=2))
    scheduler.add_request(make_request("b", shared + [2], max_tokens=2))
    assert scheduler.schedule().num_scheduled_tokens == {"a": len(shared) + 1, "b": 1}


def test_identical_prompts_share_every_full_block_but_compute_their_last_one():
    """n choices of one prompt (the gateway sends each as a request): the blocks before the
    last token's are computed once; each request computes its own last block, which it will
    write its output into."""
    scheduler = make_scheduler(num_blocks=256, max_num_batched_tokens=400)
    prompt = prompt_of(3 * BLOCK - 1)  # two full blocks, then the last token's block
    for i in range(4):
        scheduler.add_request(make_request(f"c{i}", prompt, max_tokens=3))
    trace = run_to_completion(scheduler)
    own = len(prompt) - 2 * BLOCK
    assert trace.steps[0].num_scheduled_tokens == {"c0": len(prompt), "c1": own, "c2": own,
                                                   "c3": own}
    assert all(trace.outputs[f"c{i}"] == expected_output(prompt, 3) for i in range(4))
    assert_no_blocks_held(scheduler)


def test_a_prompt_taking_blocks_in_flight_keeps_them_when_their_owner_is_aborted():
    """The owner of the blocks computed this step is aborted while the step runs (it never
    registers them in the prefix cache): the prompt that took them still reads its prefix
    through them, and every block is freed in the end."""
    scheduler = make_scheduler(num_blocks=64, max_num_batched_tokens=400)
    runner = FakeRunner(64)
    shared = prompt_of(3 * BLOCK)
    scheduler.add_request(make_request("owner", shared + [1], max_tokens=4))
    scheduler.add_request(make_request("taker", shared + [2], max_tokens=4))
    sched = scheduler.schedule()
    assert sched.num_scheduled_tokens == {"owner": len(shared) + 1, "taker": 1}
    result = runner.execute(sched)
    scheduler.abort("owner")
    scheduler.update(sched, result)
    trace = run_to_completion(scheduler, runner)
    assert trace.outputs["taker"] == expected_output(shared + [2], 4)[1:]
    assert_no_blocks_held(scheduler)


def test_a_prompt_waits_for_a_shared_prefix_chunked_over_several_steps():
    """The first prompt's prefill is cut into chunks: the one sharing its prefix waits while
    the chunk being computed holds its next blocks, and computes only what is its own."""
    chunk = MIN_SHARED_TOKENS_TO_WAIT
    scheduler = make_scheduler(num_blocks=512, max_num_batched_tokens=4 * chunk,
                               long_prefill_token_threshold=chunk)
    shared = prompt_of(3 * chunk)
    scheduler.add_request(make_request("a", shared + [1], max_tokens=2))
    scheduler.add_request(make_request("b", shared + [2, 3], max_tokens=2))
    trace = run_to_completion(scheduler)
    b_tokens = [step.num_scheduled_tokens.get("b") for step in trace.steps]
    assert [n for n in b_tokens if n] == [2, 1]  # its own two tokens, then its decode
    assert trace.outputs["b"] == expected_output(shared + [2, 3], 2)
    assert scheduler.kv.prefix_hits >= len(shared)


def test_prompt_logprobs_requests_do_not_use_the_prefix_cache():
    scheduler = make_scheduler()
    shared = prompt_of(12)
    scheduler.add_request(make_request("a", shared + [1], max_tokens=1))
    run_to_completion(scheduler)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    scheduler.add_request(Request("b", shared + [2], params, arrival_time=next(_arrival)))
    sched = scheduler.schedule()
    assert sched.num_scheduled_tokens == {"b": 13}


# -- aborts -------------------------------------------------------------------------------


def test_abort_of_an_unknown_or_finished_request_is_a_no_op():
    scheduler = make_scheduler()
    assert scheduler.abort("nobody") is None
    scheduler.add_request(make_request("done", prompt_of(3), max_tokens=1))
    run_to_completion(scheduler)
    free = scheduler.kv.num_free_blocks
    assert scheduler.abort("done") is None
    assert scheduler.abort("done") is None
    assert scheduler.kv.num_free_blocks == free
    assert_no_blocks_held(scheduler)


@pytest.mark.parametrize("when", ["waiting", "mid-prefill", "decoding", "preempted"])
def test_abort_frees_all_blocks_and_tells_the_runner(when):
    scheduler = make_scheduler(num_blocks=6, prefix_caching=False, long_prefill_token_threshold=4)
    runner = FakeRunner(6)
    if when == "preempted":
        # Older, so the victim (newest) is the one preempted when the six blocks run out.
        scheduler.add_request(make_request("other", prompt_of(3, 9), max_tokens=20))
    victim = make_request("victim", prompt_of(10), max_tokens=20)
    scheduler.add_request(victim)

    def step() -> None:
        sched = scheduler.schedule()
        scheduler.update(sched, runner.execute(sched))

    if when != "waiting":
        step()
    if when == "decoding":
        while victim.num_output_tokens == 0:
            step()
    if when == "preempted":
        while victim.status != RequestStatus.PREEMPTED:
            step()
    expected_status = {"waiting": RequestStatus.WAITING, "preempted": RequestStatus.PREEMPTED}
    assert victim.status == expected_status.get(when, RequestStatus.RUNNING)
    assert scheduler.abort("victim") is victim
    assert victim.status == RequestStatus.FINISHED_ABORTED and victim.finish_reason == "abort"
    sched = scheduler.schedule()
    assert "victim" in sched.finished_request_ids
    assert "victim" not in sched.num_scheduled_tokens
    scheduler.update(sched, runner.execute(sched))
    assert "victim" not in runner.states
    assert scheduler.abort("victim") is None
    scheduler.abort("other")
    assert_no_blocks_held(scheduler)
    assert scheduler.num_unfinished == 0


def test_a_request_aborted_while_its_step_runs_gets_no_output():
    scheduler = make_scheduler()
    runner = FakeRunner(64)
    scheduler.add_request(make_request("a", prompt_of(5), max_tokens=5))
    sched = scheduler.schedule()
    result = runner.execute(sched)
    scheduler.abort("a")
    assert scheduler.update(sched, result) == []
    assert_no_blocks_held(scheduler)


# -- remote KV (decode role) and held KV (prefill role) -------------------------------------


def test_reserve_for_remote_kv_allocates_the_prompt_blocks_up_front():
    scheduler = make_scheduler(num_blocks=8)
    request = make_request("r", prompt_of(9), max_tokens=3)
    assert scheduler.reserve_for_remote_kv(request) == [0, 1, 2]
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KV
    assert scheduler.num_unfinished == 1
    assert scheduler.schedule().is_empty  # nothing to run until the KV arrives


def test_reserve_for_remote_kv_refuses_without_changing_anything_when_full():
    scheduler = make_scheduler(num_blocks=4)
    assert scheduler.reserve_for_remote_kv(make_request("a", prompt_of(9), max_tokens=3)) is not None
    big = make_request("b", prompt_of(9, 3), max_tokens=3)
    assert scheduler.reserve_for_remote_kv(big) is None
    assert big.status == RequestStatus.WAITING
    assert "b" not in scheduler.requests and "b" not in scheduler.waiting_for_kv
    assert scheduler.kv.num_free_blocks == 1


def test_remote_kv_arrival_starts_decoding_after_the_first_token():
    scheduler = make_scheduler(num_blocks=8)
    runner = FakeRunner(8)
    prompt = prompt_of(9)
    expected = expected_output(prompt, 4)
    request = make_request("r", prompt, max_tokens=4)
    block_ids = scheduler.reserve_for_remote_kv(request)
    # The prefill worker would have written the prompt's KV into these blocks.
    for pos, token in enumerate(prompt):
        runner.kv[block_ids[pos // BLOCK] * BLOCK + pos % BLOCK] = token
    assert scheduler.remote_kv_arrived("r", expected[0]) is request
    assert request.status == RequestStatus.RUNNING
    trace = run_to_completion(scheduler, runner)
    assert trace.steps[0].num_scheduled_tokens == {"r": 1}
    assert trace.steps[0].new_requests[0].num_computed_tokens == 9
    assert [expected[0]] + trace.outputs["r"] == expected
    assert_no_blocks_held(scheduler)


def test_remote_first_token_that_ends_the_request_frees_the_reservation():
    scheduler = make_scheduler(num_blocks=8)
    request = make_request("r", prompt_of(9), max_tokens=1)
    scheduler.reserve_for_remote_kv(request)
    scheduler.remote_kv_arrived("r", 42)
    assert request.status == RequestStatus.FINISHED_LENGTH
    assert scheduler.num_unfinished == 0
    assert_no_blocks_held(scheduler)


def test_remote_kv_for_an_unknown_request_is_ignored():
    scheduler = make_scheduler()
    assert scheduler.remote_kv_arrived("ghost", 5) is None
    assert scheduler.recompute_locally("ghost") is False


def test_abort_while_waiting_for_remote_kv_frees_the_reservation():
    scheduler = make_scheduler(num_blocks=8)
    scheduler.reserve_for_remote_kv(make_request("r", prompt_of(9), max_tokens=3))
    assert scheduler.abort("r") is not None
    assert scheduler.remote_kv_arrived("r", 5) is None  # late KV is dropped
    assert scheduler.num_unfinished == 0
    assert_no_blocks_held(scheduler)


def test_recompute_locally_drops_the_reservation_and_prefills_here():
    scheduler = make_scheduler(num_blocks=8)
    prompt = prompt_of(9)
    request = make_request("r", prompt, max_tokens=4)
    scheduler.reserve_for_remote_kv(request)
    assert scheduler.recompute_locally("r") is True
    assert request.status == RequestStatus.WAITING
    assert scheduler.kv.num_free_blocks == 8
    trace = run_to_completion(scheduler)
    assert trace.outputs["r"] == expected_output(prompt, 4)
    assert_no_blocks_held(scheduler)


def test_held_kv_request_stops_after_its_first_token_and_keeps_its_blocks_until_released():
    scheduler = make_scheduler(num_blocks=8)
    request = make_request("p", prompt_of(9), max_tokens=5, hold_kv=True)
    scheduler.add_request(request)
    trace = run_to_completion(scheduler)
    assert trace.outputs == {"p": expected_output(prompt_of(9), 1)}
    assert request.status == RequestStatus.FINISHED_HANDED_OFF
    assert trace.finish_reasons == {"p": None}  # not finished: it continues on a decode worker
    assert scheduler.kv.block_ids("p") == [0, 1, 2]
    scheduler.release_held_kv(request)
    assert_no_blocks_held(scheduler)


@pytest.mark.parametrize(("max_tokens", "first", "reason"), [(1, None, "length"), (5, 0, "stop")])
def test_held_kv_request_keeps_a_real_finish_reason(max_tokens, first, reason):
    scheduler = make_scheduler(num_blocks=8)
    prompt = prompt_of(9)
    eos = expected_output(prompt, 1)[0] if first is not None else 1
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    request = Request("p", prompt, params, eos_token_ids=(eos,), hold_kv=True)
    scheduler.add_request(request)
    assert run_to_completion(scheduler).finish_reasons == {"p": reason}
    scheduler.release_held_kv(request)
    assert_no_blocks_held(scheduler)


def test_eos_stops_a_request_unless_ignore_eos_and_stop_ids_always_do():
    prompt = prompt_of(6)
    expected = expected_output(prompt, 8)
    eos = expected[2]
    cases = {
        "eos": (SamplingParams(max_tokens=8), "stop", expected[: expected.index(eos) + 1]),
        "ignore": (SamplingParams(max_tokens=8, ignore_eos=True), "length", expected),
        "stop-id": (
            SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=(expected[4],)),
            "stop", expected[: expected.index(expected[4]) + 1],
        ),
    }
    scheduler = make_scheduler()
    for rid, (params, _, _) in cases.items():
        scheduler.add_request(Request(rid, prompt, params, eos_token_ids=(eos,)))
    trace = run_to_completion(scheduler)
    for rid, (_, reason, tokens) in cases.items():
        assert trace.outputs[rid] == tokens
        assert trace.finish_reasons[rid] == reason
    assert_no_blocks_held(scheduler)


def test_max_model_len_ends_a_request_with_length():
    scheduler = make_scheduler()
    request = make_request("r", prompt_of(6), max_tokens=50, max_model_len=10)
    scheduler.add_request(request)
    trace = run_to_completion(scheduler)
    assert len(trace.outputs["r"]) == 4 and trace.finish_reasons["r"] == "length"
