"""Scheduler against a fake model runner: token budget, chunked prefill, priority order,
preemption (newest / lowest priority first, resumed with identical output), aborts, and that
every block is free once every request has finished (prefix cache and remote KV: the
test_scheduler_* files beside it, on the same runner)."""

from __future__ import annotations

import pytest

from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from tests.unit.scheduler_harness import (
    FakeRunner,
    assert_no_blocks_held,
    expected_output,
    make_request,
    make_scheduler,
    prompt_of,
    run_to_completion,
)

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
