"""The scheduler's load statistics that routing and the autoscaler read: prefix-cache lookups
counted once per request (not every step it waits at the head of the queue, nor again when it
resumes after preemption), and queued prefill tokens that include the rest of a prompt in
chunked prefill. The scheduler and KV manager are driven directly, with exact numbers; the
model's sampled tokens are scripted (token 1 for every row that samples)."""

from __future__ import annotations

from engine_harness import make_engine, random_prompts

from engine.kv_cache_manager import KVCacheManager
from engine.outputs import ModelRunnerOutput
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig

BLOCK = 4


def _step(scheduler: Scheduler):
    """One schedule and update, every request whose scheduled tokens reach its end sampling 1."""
    sched = scheduler.schedule()
    sampled = {rid: [1] for rid, n in sched.num_scheduled_tokens.items()
               if scheduler.requests[rid].num_computed_tokens + n >= scheduler.requests[rid].num_tokens}
    scheduler.update(sched, ModelRunnerOutput(sampled_token_ids=sampled))
    return sched


def _request(rid: str, tokens: list[int], max_tokens: int) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_a_request_blocked_at_the_head_of_the_queue_is_counted_once():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK)
    scheduler = Scheduler(SchedulerConfig(), kv)
    a = _request("a", list(range(10, 22)), max_tokens=4)  # 12 tokens, three full blocks
    scheduler.add_request(a)
    _step(scheduler)
    assert (kv.prefix_queries, kv.prefix_hits) == (12, 0)
    # b shares a's first two blocks but needs a block of its own, and a takes the last free one
    # for its next token: b waits at the head of the queue while a decodes.
    b = _request("b", list(range(10, 18)) + [90, 91, 92, 93], max_tokens=1)
    scheduler.add_request(b)
    blocked = 0
    while a.status == RequestStatus.RUNNING:
        sched = _step(scheduler)
        assert "b" not in sched.num_scheduled_tokens
        blocked += 1
    assert blocked == 3 and scheduler.waiting == [b]
    assert (kv.prefix_queries, kv.prefix_hits) == (12, 0), "a blocked lookup was counted"
    sched = _step(scheduler)  # a finished: b is admitted, hitting a's two (now free) blocks
    assert sched.num_scheduled_tokens == {"b": 4} and b.num_cached_tokens == 8
    assert (kv.prefix_queries, kv.prefix_hits) == (12 + 12, 8)


def test_a_request_resumed_after_preemption_is_not_counted_again():
    kv = KVCacheManager(num_blocks=5, block_size=BLOCK)
    scheduler = Scheduler(SchedulerConfig(), kv)
    prompts = {"a": list(range(10, 16)), "b": list(range(30, 36))}  # no shared block
    for rid, tokens in prompts.items():
        scheduler.add_request(_request(rid, tokens, max_tokens=10))
    for _ in range(100):
        if not scheduler.num_unfinished:
            break
        _step(scheduler)
    assert scheduler.num_unfinished == 0
    assert scheduler.num_preemptions > 0, "the test needs a preemption"
    # Both prompts looked up once each; a resumed request's hits on its own blocks are not
    # prefix-cache hits of the workload.
    assert (kv.prefix_queries, kv.prefix_hits) == (6 + 6, 0)


def test_a_request_that_prompt_logprobs_keep_from_the_cache_is_not_counted():
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK)
    scheduler = Scheduler(SchedulerConfig(), kv)
    scheduler.add_request(Request("a", list(range(10, 20)),
                                  SamplingParams(max_tokens=1, prompt_logprobs=0)))
    _step(scheduler)
    assert (kv.prefix_queries, kv.prefix_hits) == (0, 0)


def test_queued_prefill_tokens_include_the_rest_of_a_chunked_prompt():
    config = SchedulerConfig(max_num_batched_tokens=4, long_prefill_token_threshold=4)
    scheduler = Scheduler(config, KVCacheManager(num_blocks=16, block_size=BLOCK))
    scheduler.add_request(_request("a", list(range(10, 20)), max_tokens=8))  # 10 tokens
    scheduler.add_request(_request("b", list(range(40, 45)), max_tokens=8))  # 5 tokens
    assert scheduler.queued_prefill_tokens() == 15
    expected = [
        ({"a": 4}, 6 + 5),  # a in chunked prefill, 6 left; b waits behind it
        ({"a": 4}, 2 + 5),
        ({"a": 2, "b": 2}, 3),  # a's last chunk samples its first token: a decodes now
        ({"a": 1, "b": 3}, 0),  # b's last chunk: nothing left to prefill
        ({"a": 1, "b": 1}, 0),
    ]
    for scheduled, queued in expected:
        assert _step(scheduler).num_scheduled_tokens == scheduled
        assert scheduler.queued_prefill_tokens() == queued


def test_queued_prefill_tokens_of_a_resumed_request_leave_out_its_decode_token():
    # No prefix cache: the resumed request recomputes everything, in chunks of 4.
    scheduler = Scheduler(SchedulerConfig(long_prefill_token_threshold=4, chunk_prompts_alone=True),
                          KVCacheManager(num_blocks=16, block_size=BLOCK, enable_prefix_caching=False))
    request = _request("a", list(range(10, 16)), max_tokens=8)
    scheduler.add_request(request)
    _step(scheduler)  # 4 of 6
    _step(scheduler)  # the last 2, sampling token 1
    _step(scheduler)  # decodes, sampling another: 8 tokens, 7 computed
    scheduler._preempt(request)  # as when blocks run out; it waits with nothing computed
    assert scheduler.queued_prefill_tokens() == 8
    _step(scheduler)  # resumes: a chunk of 4, 4 left
    assert request.num_computed_tokens == 4 and scheduler.queued_prefill_tokens() == 4
    _step(scheduler)  # the other 4 recomputed, sampling: only the new decode token is left
    assert (request.num_tokens, request.num_computed_tokens) == (9, 8)
    assert scheduler.queued_prefill_tokens() == 0


def test_engine_stats_report_a_chunked_prompt_as_queued_prefill(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, long_prefill_token_threshold=8)
    (prompt,) = random_prompts([20], seed=12)
    engine.add_request("r", prompt, SamplingParams(max_tokens=2, temperature=0.0))
    assert engine.stats()["queued_prefill_tokens"] == 20
    engine.step()
    assert engine.stats()["queued_prefill_tokens"] == 12
    engine.step()
    assert engine.stats()["queued_prefill_tokens"] == 4
    engine.step()
    assert engine.stats()["queued_prefill_tokens"] == 0
    assert (engine.stats()["prefix_queries"], engine.stats()["prefix_hits"]) == (20, 0)
