"""The scheduler's remote KV (decode role: blocks reserved for a prompt whose KV comes from a
prefill worker, then arrival, local recompute or abort) and held KV (prefill role: a request
that stops after its first token and keeps its blocks until released), against the fake
runner of scheduler_harness."""

from __future__ import annotations

import pytest

from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
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
