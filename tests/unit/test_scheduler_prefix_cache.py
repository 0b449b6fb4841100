"""The scheduler's prefix cache against the fake runner of scheduler_harness: shared prompt
blocks reused, a request that shares a prefix with one being prefilled waits for it, eviction
and salts, and every block free at the end."""

from __future__ import annotations

from engine.sampling_params import SamplingParams
from engine.scheduler import MIN_SHARED_TOKENS_TO_WAIT
from tests.unit.scheduler_harness import (
    BLOCK,
    FakeRunner,
    assert_no_blocks_held,
    expected_output,
    make_request,
    make_scheduler,
    prompt_of,
    run_to_completion,
)


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
    scheduler.add_request(make_request("b", shared + [2], params=params))
    sched = scheduler.schedule()
    assert sched.num_scheduled_tokens == {"b": 13}
