"""The step-time target for steps that carry decoding requests (--itl-target-ms): the scheduler
takes at most the prompt budget it is given, for running chunks and waiting prompts alike;
the budget model gives one only while something decodes, and turns measured step times into that many
tokens; an engine with a target keeps its decode steps near it while a long prompt prefills,
where one without takes whole chunks. Scheduler tests drive the scheduler and KV manager
directly with scripted tokens; the engine test runs the tiny model."""

from __future__ import annotations

import pytest
from engine_harness import make_engine, random_prompts

from engine.kv_cache_manager import KVCacheManager
from engine.outputs import ModelRunnerOutput
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.step_budget import MixedStepBudget
from services.common.worker_config import WorkerConfig


def _step(scheduler: Scheduler, prompt_budget: int | None = None):
    sched = scheduler.schedule(prompt_budget=prompt_budget)
    sampled = {rid: [1] for rid, n in sched.num_scheduled_tokens.items()
               if scheduler.requests[rid].num_computed_tokens + n >= scheduler.requests[rid].num_tokens}
    scheduler.update(sched, ModelRunnerOutput(sampled_token_ids=sampled))
    return sched


def _request(rid: str, num_tokens: int, first: int = 10) -> Request:
    return Request(rid, list(range(first, first + num_tokens)),
                   SamplingParams(max_tokens=50, ignore_eos=True))


def test_a_step_with_decoding_requests_takes_only_the_prompt_budget():
    scheduler = Scheduler(SchedulerConfig(long_prefill_token_threshold=64),
                          KVCacheManager(num_blocks=64, block_size=4))
    scheduler.add_request(_request("a", 8))
    assert scheduler.num_decoding() == 0
    assert _step(scheduler).num_scheduled_tokens == {"a": 8}
    assert scheduler.num_decoding() == 1
    scheduler.add_request(_request("long", 100, first=200))
    scheduler.add_request(_request("next", 20, first=400))
    sched = _step(scheduler, prompt_budget=30)
    assert sched.num_scheduled_tokens == {"a": 1, "long": 30}
    sched = _step(scheduler, prompt_budget=40)  # the running chunk first, then the queue
    assert sched.num_scheduled_tokens == {"a": 1, "long": 40}
    sched = _step(scheduler, prompt_budget=50)
    assert sched.num_scheduled_tokens == {"a": 1, "long": 30, "next": 20}
    assert _step(scheduler).num_scheduled_tokens == {"a": 1, "long": 1, "next": 1}


def test_without_chunked_prefill_the_prompt_budget_is_ignored():
    scheduler = Scheduler(SchedulerConfig(enable_chunked_prefill=False),
                          KVCacheManager(num_blocks=64, block_size=4))
    scheduler.add_request(_request("a", 8))
    _step(scheduler)
    scheduler.add_request(_request("b", 40, first=100))
    assert _step(scheduler, prompt_budget=5).num_scheduled_tokens == {"a": 1, "b": 40}


def test_the_budget_is_the_room_left_by_the_decode_rows_over_the_prompt_token_cost():
    budget = MixedStepBudget(0.1, max_tokens=512, min_tokens=16)
    assert budget.prompt_tokens(8) is None, "no prompt cost measured yet: no limit"
    budget.observe(0, 500, 0.5)  # a prefill step alone: 1 ms a prompt token
    budget.observe(8, 0, 0.04)  # decode rows alone: 40 ms for 8
    assert budget.prompt_tokens(8) == 60  # (100 - 40) ms / 1 ms
    assert budget.prompt_tokens(0) is None, "nothing decodes: no limit"
    for _ in range(30):  # decode alone now takes longer than the target (averages follow)
        budget.observe(8, 0, 0.12)
    assert budget.prompt_tokens(8) == 16, "prompts still move, by min_tokens"
    fast = MixedStepBudget(1.0, max_tokens=256)
    fast.observe(0, 100, 0.01)
    fast.observe(4, 0, 0.01)
    assert fast.prompt_tokens(4) == 256, "never above the longest chunk"
    with pytest.raises(ValueError):
        MixedStepBudget(0, max_tokens=256)


def test_an_engine_with_a_target_keeps_decode_steps_short_while_a_long_prompt_prefills(
        tiny_llama_dir):
    """Prompt tokens per step while one request decodes and a 400-token prompt prefills:
    with a target far below a whole chunk's time the chunks shrink; without one, whole
    128-token chunks."""
    def prompt_tokens_per_step(itl_target_s: float) -> list[int]:
        engine = make_engine(tiny_llama_dir, long_prefill_token_threshold=128,
                             itl_target_s=itl_target_s)
        decode_prompt, long_prompt = random_prompts([16, 400], seed=3)
        engine.add_request("d", decode_prompt, SamplingParams(max_tokens=200, ignore_eos=True))
        engine.step()
        engine.add_request("long", long_prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        chunks = []
        while "long" in engine.scheduler.requests:  # it leaves with its one token
            engine.step()
            chunks.append(engine.last_step_size[1] - 1)  # less the decode row
        engine.abort("d")
        return chunks

    whole = prompt_tokens_per_step(0.0)
    assert whole == [128, 128, 128, 16]
    # Whatever this machine's speed, a 0.1 ms target leaves room for no more than the
    # minimum (the first request's own prefill step measured the cost of a prompt token).
    budgeted = prompt_tokens_per_step(1e-4)
    assert budgeted == [16] * 25


def test_the_worker_default_target_is_per_role(tiny_llama_dir):
    def target(role: str, **kw) -> float:
        config = WorkerConfig(role=role, model=str(tiny_llama_dir), **kw)
        return config.engine_config().scheduler.itl_target_s

    assert target("decode") == 0.15
    assert target("both") == 0.0 and target("prefill") == 0.0
    assert target("both", itl_target_ms=300) == 0.3
    with pytest.raises(ValueError, match="itl-target-ms"):
        WorkerConfig(role="decode", model=str(tiny_llama_dir), itl_target_ms=-5)
