"""KV blocks under speculation: rejected proposals give their slots back (every step, no
request holds a block past its computed KV), the scheduler alone trims (the runner's block
tables follow from the SchedulerOutputs), nothing leaks after many rejections, preemption or
an abort that lands while a verification runs, proposals never cause a preemption, and the
prefix cache only ever learns accepted tokens."""

from __future__ import annotations

import pytest
from engine_harness import add_all, assert_no_leak, drive, make_engine, random_prompts
from spec_decode_harness import (
    draft_pool_is_free,
    drive_checked,
    spec_engine,
)

from engine.kv_cache_manager import KVCacheManager
from engine.model_runner import ModelRunner
from engine.outputs import ModelRunnerOutput
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PARAMS = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def _prompts(seed: int, lengths=(2, 5, 11, 16, 23)) -> dict[str, list[int]]:
    return {f"p{i}": p for i, p in enumerate(random_prompts(list(lengths), seed))}


def _tokens(results) -> dict[str, list[int]]:
    return {rid: c.token_ids for rid, c in results.items()}


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_many_rejected_proposals_leak_nothing_even_under_preemption(
    tiny_llama_dir, tiny_draft_dir, method
):
    prompts = _prompts(seed=40)
    reference_engine = make_engine(tiny_llama_dir)
    add_all(reference_engine, prompts, PARAMS)
    reference = _tokens(drive(reference_engine))
    # 24 blocks of 4 tokens cannot hold five requests of up to 63 tokens: preemption happens
    # while proposals (k = 4, never adapted down) are mostly rejected.
    engine = spec_engine(tiny_llama_dir, method=method, k=4, draft=tiny_draft_dir, ngram_min=1,
                         num_kv_blocks=24)
    add_all(engine, prompts, PARAMS)
    results = drive_checked(engine)
    assert _tokens(results) == reference
    stats = engine.stats()
    assert stats["preemptions"] > 0
    assert stats["spec_proposed_tokens"] - stats["spec_accepted_tokens"] > 25
    assert_no_leak(engine)
    if method == "draft":
        assert draft_pool_is_free(engine)


def test_the_schedule_alone_decides_every_block_table(tiny_llama_dir, tiny_draft_dir):
    """One owner for speculative trimming. At every forward the engine's runner holds exactly
    the scheduler's block table for each scheduled request, and so does a second runner that
    only follows the SchedulerOutputs, as another tensor-parallel rank does: a trim by a rule
    of the runner's own, or one the schedule does not carry, makes them differ."""
    engine = spec_engine(tiny_llama_dir, method="draft", k=4, draft=tiny_draft_dir,
                         num_kv_blocks=24)
    follower = ModelRunner(engine.config, engine.model_config)
    run = engine.runner.execute_model
    verified = 0

    def execute(sched, *args):
        nonlocal verified
        follower._update_states(sched)
        result = run(sched, *args)
        for rid in sched.num_scheduled_tokens:  # the scheduler has not seen the result yet
            table = engine.kv.block_ids(rid)
            assert engine.runner.requests[rid].block_ids == table, ("runner", rid)
            assert follower.requests[rid].block_ids == table, ("follower", rid)
        verified += len(sched.spec_token_ids)
        return result

    engine.runner.execute_model = execute
    add_all(engine, _prompts(seed=40), PARAMS)
    drive(engine)
    stats = engine.stats()
    assert verified > 20 and stats["preemptions"] > 0
    assert stats["spec_proposed_tokens"] - stats["spec_accepted_tokens"] > 25
    assert_no_leak(engine)


@pytest.mark.parametrize("abort_at_step", [2, 3, 6])
def test_abort_while_a_verification_runs_frees_every_block(tiny_llama_dir, abort_at_step):
    prompts = _prompts(seed=41)
    engine = spec_engine(tiny_llama_dir, method="draft", k=3, draft=tiny_llama_dir)
    run = engine.runner.execute_model
    seen = {}

    def execute_then_abort(sched, *args):
        # The abort lands after scheduling (slots for the proposals allocated) and before the
        # scheduler hears the verification's result.
        seen[len(seen)] = dict(sched.spec_token_ids)
        if len(seen) == abort_at_step:
            assert "p2" in sched.spec_token_ids, "the victim must be verifying in this step"
            assert engine.abort("p2")
        return run(sched, *args)

    engine.runner.execute_model = execute_then_abort
    add_all(engine, prompts, PARAMS)
    results = drive_checked(engine)
    assert results["p2"].finish_reason is None  # aborted: nothing after the abort
    assert all(results[r].finish_reason == "length" for r in prompts if r != "p2")
    assert_no_leak(engine)
    assert draft_pool_is_free(engine)


def test_abort_between_steps_releases_the_draft_cache(tiny_llama_dir):
    engine = spec_engine(tiny_llama_dir, method="draft", k=3, draft=tiny_llama_dir)
    add_all(engine, _prompts(seed=42), PARAMS)
    for _ in range(3):
        engine.step()
    assert engine.speculator.proposer.pool.num_free_blocks < engine.speculator.proposer.pool.num_blocks
    for rid in _prompts(seed=42):
        engine.abort(rid)
    assert draft_pool_is_free(engine)
    drive(engine)
    assert_no_leak(engine)


def test_prefix_cache_learns_only_accepted_tokens(tiny_llama_dir, tiny_draft_dir):
    """A second request that extends a first one's prompt *and output* reuses its cached
    blocks; had a rejected proposal's KV been registered, its output would differ."""
    prompt = random_prompts([13], seed=43)[0]
    engine = spec_engine(tiny_llama_dir, method="draft", k=4, draft=tiny_draft_dir)
    engine.add_request("first", prompt, PARAMS)
    first = drive_checked(engine)["first"].token_ids
    assert engine.stats()["spec_proposed_tokens"] > engine.stats()["spec_accepted_tokens"]
    follow_up = prompt + first[:30] + [7, 8, 9]
    engine.add_request("second", follow_up, PARAMS)
    second = drive_checked(engine)["second"].token_ids
    assert engine.kv.prefix_hits >= 40  # ten of the eleven full blocks came from the cache
    reference = make_engine(tiny_llama_dir, enable_prefix_caching=False)
    reference.add_request("second", follow_up, PARAMS)
    assert drive(reference)["second"].token_ids == second
    assert_no_leak(engine)


# -- the scheduler alone ----------------------------------------------------------------------


def _decoding(scheduler: Scheduler, prompt_lens: dict[str, int]) -> list[Request]:
    """Admit requests and run their prefill through the scheduler, each sampling token 1."""
    requests = []
    for i, (rid, n) in enumerate(prompt_lens.items()):
        first = 3 + 100 * i  # no shared prefix between requests
        requests.append(Request(rid, list(range(first, first + n)), SamplingParams(max_tokens=50)))
        scheduler.add_request(requests[-1])
    sched = scheduler.schedule()
    scheduler.update(sched, ModelRunnerOutput(sampled_token_ids={r: [1] for r in prompt_lens}))
    assert all(r.num_tokens - r.num_computed_tokens == 1 for r in requests)
    return requests


def test_proposals_that_do_not_fit_are_dropped_rather_than_preempting():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    scheduler = Scheduler(SchedulerConfig(), kv)
    # Two blocks each; each next token (position 7) is the last slot of its second block.
    a, b = _decoding(scheduler, {"a": 7, "b": 7})
    assert kv.num_free_blocks == 0
    sched = scheduler.schedule({"a": [5, 6, 7], "b": [5]})
    # a's token and b's token fit in their last blocks; no proposal does, and nobody is preempted.
    assert sched.spec_token_ids == {}
    assert sched.num_scheduled_tokens == {"a": 1, "b": 1}
    assert not sched.preempted_request_ids and scheduler.num_preemptions == 0
    assert a.status == b.status


def test_proposals_are_cut_to_the_token_budget_and_verified_slots_trimmed():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=6), kv)
    a, b = _decoding(scheduler, {"a": 3, "b": 3})
    sched = scheduler.schedule({"a": [10, 11, 12, 13], "b": [20, 21, 22]})
    # Running requests in order: a takes 1 + 4, leaving b its own token only.
    assert sched.spec_token_ids == {"a": [10, 11, 12, 13]}
    assert sched.num_scheduled_tokens == {"a": 5, "b": 1}
    assert len(kv.block_ids("a")) == 2  # slots for positions 3..7
    # The target kept one proposal and replaced the second: KV stands for 5 tokens.
    scheduler.update(sched, ModelRunnerOutput(sampled_token_ids={"a": [10, 99], "b": [5]}))
    assert a.all_token_ids[-3:] == [1, 10, 99]
    assert a.num_computed_tokens == 5 and len(kv.block_ids("a")) == 2
    sched = scheduler.schedule({"a": [1, 2, 3]})
    assert sched.num_scheduled_tokens["a"] == 4
    assert len(kv.block_ids("a")) == 3  # positions 5..8
    free = kv.num_free_blocks
    scheduler.update(sched, ModelRunnerOutput(sampled_token_ids={"a": [7], "b": [6]}))
    # Everything rejected: back to cdiv(6, 4) = 2 blocks, the third one is free again.
    assert a.num_computed_tokens == 6 and len(kv.block_ids("a")) == 2
    assert kv.num_free_blocks == free + 1
    assert b.num_computed_tokens == 5


def test_tokens_after_a_stop_inside_a_verified_run_are_dropped():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    scheduler = Scheduler(SchedulerConfig(), kv)
    request = Request("a", [3, 4, 5], SamplingParams(max_tokens=50, stop_token_ids=(42,)))
    scheduler.add_request(request)
    scheduler.update(scheduler.schedule(), ModelRunnerOutput(sampled_token_ids={"a": [1]}))
    sched = scheduler.schedule({"a": [8, 42, 9]})
    (out,) = scheduler.update(sched, ModelRunnerOutput(sampled_token_ids={"a": [8, 42, 9, 10]}))
    assert out.new_token_ids == [8, 42] and out.finish_reason == "stop"
    assert request.output_token_ids == [1, 8, 42]
    assert kv.num_free_blocks == 16


def test_the_next_schedule_tells_the_runner_which_blocks_the_trim_kept():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    scheduler = Scheduler(SchedulerConfig(), kv)
    (a,) = _decoding(scheduler, {"a": 3})  # block 0
    sched = scheduler.schedule({"a": [10, 11, 12, 13, 14]})  # positions 3..8: blocks 1, 2
    (diff,) = sched.cached_requests
    assert (diff.new_block_ids, diff.num_kept_blocks) == ([1, 2], 1)
    scheduler.update(sched, ModelRunnerOutput(sampled_token_ids={"a": [99]}))  # all rejected
    assert a.num_computed_tokens == 4 and kv.block_ids("a") == [0]
    # The runner still lists blocks 1 and 2 (released, tail first, to the back of the free
    # queue): it keeps block 0 and gets position 4's block from the front of the queue.
    (diff,) = scheduler.schedule().cached_requests
    assert (diff.new_block_ids, diff.num_kept_blocks) == ([3], 1)
    assert kv.block_ids("a") == [0, 3]
