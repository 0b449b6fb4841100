"""The engine: one model runner, one scheduler, and the step API the services drive.

Owned by a single thread (a service's engine loop, or the caller of `generate`); no method
is thread-safe. Services hand work to that thread instead of calling in from elsewhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.config import EngineConfig, ModelConfig
from engine.executor import TensorParallelExecutor, create_model_runner
from engine.kv_cache_manager import KVCacheManager, cdiv
from engine.kv_prefault import KVPrefault
from engine.outputs import Logprobs, RequestOutput, SchedulerOutput
from engine.remote_prefill import RemotePrefill
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.spec_decode.speculator import Speculator, build_proposer
from engine.step_budget import MixedStepBudget
from engine.step_cost import charge_step, step_rows
from engine.step_threads import StepThreads, default_small_threads, set_team_threads

log = logging.getLogger(__name__)


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[Logprobs]
    text: str | None = None
    prompt_logprobs: list[Logprobs | None] | None = None  # with params.prompt_logprobs


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model)
        self.runner = create_model_runner(config, self.model_config)
        limit = self.model_config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or limit, limit)
        self.kv = KVCacheManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler, self.kv)
        # Decode role: prompts whose KV a prefill worker sends (reserve, receive, fallbacks).
        self.remote = RemotePrefill(config.block_size, self.scheduler, self.kv, self.runner,
                                    self._make_request)
        self.kv_prefault = self._build_kv_prefault()
        self._structured_warm_done = False
        self.speculator: Speculator | None = None
        if config.speculative.enabled:
            config.speculative.validate()
            self.speculator = Speculator(config.speculative, build_proposer(
                config.speculative, config, self.model_config, self.runner, self.kv.num_blocks),
                grammar_prefix=self.runner.grammar_prefix)
        self._held: dict[str, Request] = {}  # prefill role: finished, KV not yet copied out
        self._rng = random.Random(config.seed)
        self._tokenizer = None
        self.num_steps = 0
        self.num_computed_tokens = 0  # tokens run through the model, all requests
        self.last_step_size = (0, 0)  # (requests, tokens) of the latest step
        # Its wall time as charged to its requests (copies of held KV included): the worker's
        # step-seconds metric, so that what requests are charged adds up to it exactly.
        self.last_step_seconds = 0.0
        # The batch of the step in progress, None between steps. Only swapped as a reference,
        # so a watchdog on another thread may read it to say what a slow step holds.
        self.scheduled: SchedulerOutput | None = None
        sc = config.scheduler
        self.step_budget = (MixedStepBudget(sc.itl_target_s, sc.long_prefill_token_threshold)
                            if sc.itl_target_s > 0 and sc.enable_chunked_prefill else None)
        # Entered around each step's model run (EngineLoop.forward_window: other threads may
        # then reserve remote KV; nothing else of the engine's is read or written inside it).
        self.forward_window = contextlib.nullcontext
        self.step_threads: StepThreads | None = None
        if (config.num_threads and config.tensor_parallel_size == 1
                and config.resolve_device().type == "cpu"):
            small = config.small_step_threads or default_small_threads(config.num_threads)
            self.step_threads = StepThreads(config.num_threads, small)
            if not self.step_threads.active:
                self.step_threads = None

    def _build_kv_prefault(self) -> KVPrefault | None:
        """The idle-time prefault of a one-rank CPU pool (engine/kv_prefault.py), or None."""
        tokens = self.config.cpu_kv_prefault_tokens
        if tokens < -1:
            raise ValueError("cpu_kv_prefault_tokens must be >= -1 (-1: auto, 0: off)")
        if tokens == -1:
            tokens = 4 * self.config.scheduler.max_num_batched_tokens
        if (tokens == 0 or isinstance(self.runner, TensorParallelExecutor)
                or self.runner.device.type != "cpu"):
            return None
        return KVPrefault(self.runner.kv_cache, cdiv(tokens, self.config.block_size))

    def warm_structured_outputs(self) -> bool:
        """The first time, if configured: ModelRunner.warm_structured_outputs (for the engine
        loop while nothing is runnable); False after, or when there is nothing to warm (a
        tensor-parallel executor, a model without tokenizer.json)."""
        if self._structured_warm_done:
            return False
        self._structured_warm_done = True
        warm = getattr(self.runner, "warm_structured_outputs", None)
        if not self.config.structured_outputs_warmup or warm is None:
            return False
        started = time.perf_counter()
        try:
            warm()
        except ValueError as exc:  # no tokenizer.json: structured output is refused anyway
            log.info("structured outputs not warmed up: %s", exc)
            return False
        log.info("structured outputs warmed up in %.2f s (grammar tokenizer, matcher, masks)",
                 time.perf_counter() - started)
        return True

    def prefault_kv(self) -> bool:
        """Fault in the next slice of the KV pool ahead of the blocks handed out so far; for
        the engine loop while nothing is runnable. False when there is nothing to do."""
        if self.kv_prefault is None:
            return False
        return self.kv_prefault.advance(self.kv.pool.high_water)

    # -- admission -----------------------------------------------------------------------

    @property
    def servable_len(self) -> int:
        """The longest request (prompt + output) it can hold: max_model_len, or less where an
        explicit --num-kv-blocks pool is smaller (the sized pools refuse to start then). What
        a worker advertises, so the gateway refuses longer requests up front."""
        return min(self.max_model_len, self.kv.num_blocks * self.config.block_size)

    def validate(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                 resumed_output_token_ids: Sequence[int] = ()) -> None:
        """Raise ValueError before any state changes."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty; send at least one token")
        vocab = self.model_config.vocab_size
        for token in prompt_token_ids:
            if not isinstance(token, int) or not 0 <= token < vocab:
                raise ValueError(f"prompt token id {token!r} is outside the vocabulary [0, {vocab})")
        for token in resumed_output_token_ids:
            if not isinstance(token, int) or not 0 <= token < vocab:
                raise ValueError(
                    f"resumed output token id {token!r} is outside the vocabulary [0, {vocab})")
        if resumed_output_token_ids and len(resumed_output_token_ids) >= params.max_tokens:
            raise ValueError(
                f"{len(resumed_output_token_ids)} resumed output tokens leave nothing to "
                f"generate under max_tokens={params.max_tokens}")
        # A resumed request recomputes its outputs like its prompt: both must fit.
        n = len(prompt_token_ids) + len(resumed_output_token_ids)
        if n >= self.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens but the model's context is {self.max_model_len} "
                "tokens (prompt plus at least one generated token); shorten the prompt"
            )
        if cdiv(n + 1, self.config.block_size) > self.kv.num_blocks:
            raise ValueError(
                f"the prompt has {n} tokens but this worker's KV cache holds only "
                f"{self.kv.num_blocks * self.config.block_size}"
            )
        params.validate(vocab)
        if params.max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens={params.max_tokens} exceeds the model's context of "
                f"{self.max_model_len} tokens"
            )
        if request_id in self.scheduler.requests or request_id in self._held:
            raise ValueError(f"request id {request_id!r} is already in use")

    def _make_request(self, request_id, prompt_token_ids, params, priority, hold_kv, arrival_time,
                      cache_salt="", resumed_output_token_ids=()):
        self.validate(request_id, prompt_token_ids, params, resumed_output_token_ids)
        if params.seed is None:
            params = dataclasses.replace(params, seed=self._rng.getrandbits(62))
        # No request may outgrow the whole KV cache: one that did would preempt itself and
        # then wait forever for room, so it ends with "length" there instead.
        max_len = self.servable_len
        return Request(
            request_id, list(prompt_token_ids), params,
            eos_token_ids=self.model_config.eos_token_ids, priority=priority,
            arrival_time=arrival_time, hold_kv=hold_kv, max_model_len=max_len,
            cache_salt=cache_salt, output_token_ids=list(resumed_output_token_ids),
        )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        priority: int = 0,
        hold_kv: bool = False,
        arrival_time: float | None = None,
        cache_salt: str = "",
        resumed_output_token_ids: Sequence[int] = (),
        kv_reused_tokens: int = 0,
    ) -> Request:
        """Queue a request. `hold_kv` (prefill role) keeps its KV after the first token and
        returns it in that token's RequestOutput.kv: the prompt's blocks after the first
        `kv_reused_tokens` (whole blocks the decode worker holds already). `cache_salt` (the
        gateway's, per tenant or cache group) seeds its block hashes, so it hits only blocks
        cached with the same.
        `resumed_output_token_ids`: tokens it already generated elsewhere (migration); it
        starts as a preempted request resumes, recomputing them and counting them as outputs
        (penalties, max_tokens, output indexes), so it goes on as it would have there."""
        if hold_kv and resumed_output_token_ids:
            raise ValueError("a resumed request is recomputed on its decode worker, not held")
        if kv_reused_tokens:
            self._check_kv_reused(kv_reused_tokens, len(prompt_token_ids), hold_kv)
        request = self._make_request(request_id, prompt_token_ids, params, priority, hold_kv,
                                     arrival_time, cache_salt, resumed_output_token_ids)
        request.kv_reused_tokens = kv_reused_tokens
        if hold_kv:
            self._held[request_id] = request
        self.scheduler.add_request(request)
        return request

    def _check_kv_reused(self, kv_reused_tokens: int, num_prompt_tokens: int,
                         hold_kv: bool) -> None:
        bs = self.config.block_size
        if not hold_kv:
            raise ValueError("kv_reused_tokens applies to held KV only (hold_kv)")
        if kv_reused_tokens < 0 or kv_reused_tokens % bs or kv_reused_tokens >= num_prompt_tokens:
            raise ValueError(
                f"{kv_reused_tokens} prompt tokens held by the decode worker "
                f"(decode_cached_tokens) must be a multiple of the block size "
                f"({bs}) and fewer than the prompt's {num_prompt_tokens} tokens")

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks; a no-op for unknown or finished requests."""
        held = self._held.pop(request_id, None)
        request = self.scheduler.abort(request_id)
        if self.speculator is not None:
            self.speculator.release([request_id])
        if request is None and held is not None and held.is_finished:
            self.scheduler.release_held_kv(held)
            return True
        return request is not None

    # -- stepping ------------------------------------------------------------------------

    def set_num_threads(self, num_threads: int) -> None:
        """Runs the next step on `num_threads` torch threads (CPU; a core share lends this
        worker idle peers' cores, services/common/core_share.py). Call it on the thread that
        steps the engine, before each step: OpenMP's thread count belongs to the calling
        thread, and a library's first parallel op on it resets the count."""
        if num_threads < 1:
            raise ValueError("num_threads must be >= 1")
        if self.step_threads is not None:
            self.step_threads.set_num_threads(num_threads)
        else:
            set_team_threads(num_threads)  # not torch.set_num_threads: see set_team_threads

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        spec = self.speculator
        proposals = spec.propose(self.scheduler) if spec is not None else None
        budget = self.step_budget
        prompt_budget = (budget.prompt_tokens(self.scheduler.num_decoding())
                         if budget is not None else None)
        sched = self.scheduler.schedule(proposals.token_ids if proposals else None,
                                        prompt_budget)
        self.scheduled = sched
        rows, row_tokens = step_rows(self.scheduler.requests, sched)
        if self.step_threads is not None:
            self.step_threads.before_step(sched.total_num_scheduled_tokens)
        try:
            with self.forward_window():
                if proposals is not None and proposals.draft_probs:
                    result = self.runner.execute_model(sched, proposals.draft_probs)
                else:
                    result = self.runner.execute_model(sched)
        finally:
            self.scheduled = None
        outputs = self.scheduler.update(sched, result)
        if budget is not None and rows:
            prompt_tokens = sum(n for _, n, prompt in rows if prompt)
            budget.observe(sum(1 for _, _, prompt in rows if not prompt), prompt_tokens,
                           time.perf_counter() - started)
        if spec is not None:
            spec.observe(sched, result, outputs, time.perf_counter() - started)
        if not sched.is_empty:
            self.num_steps += 1
            self.num_computed_tokens += sched.total_num_scheduled_tokens
        self.last_step_size = (len(sched.num_scheduled_tokens), sched.total_num_scheduled_tokens)
        copy_seconds = 0.0
        for out in outputs:
            if out.finished:
                if out.request_id in self._held:
                    request = self._held.pop(out.request_id)
                    copy_started = time.perf_counter()
                    bs = self.config.block_size
                    sent = slice(request.kv_reused_tokens // bs,
                                 cdiv(request.num_prompt_tokens, bs))
                    out.kv = self.runner.gather_kv(self.kv.block_ids(out.request_id)[sent])
                    copied = time.perf_counter() - copy_started
                    request.transfer_seconds += copied  # the KV copy is its alone
                    copy_seconds += copied
                    self.scheduler.release_held_kv(request)
        self.last_step_seconds = time.perf_counter() - started
        charge_step(rows, row_tokens, self.last_step_seconds - copy_seconds)
        if outputs:
            # Every output carries the running total, so a stream cut before its end (the
            # client left, a deadline, a worker failed) is still charged what it used.
            in_step = {row[0].request_id: row[0] for row in rows}
            for out in outputs:
                request = in_step.get(out.request_id)
                if request is not None:
                    out.compute = request.compute_seconds
        return outputs

    def stats(self) -> dict[str, float]:
        return {
            "running": len(self.scheduler.running),
            "max_running": self.scheduler.config.max_num_seqs,
            "waiting": len(self.scheduler.waiting),
            "waiting_for_kv": len(self.scheduler.waiting_for_kv),
            "kv_blocks_total": self.kv.num_blocks,
            "kv_blocks_free": self.kv.num_free_blocks,
            "queued_prefill_tokens": self.scheduler.queued_prefill_tokens(),
            "prefix_queries": self.kv.prefix_queries,
            "prefix_hits": self.kv.prefix_hits,
            "preemptions": self.scheduler.num_preemptions,
            "steps": self.num_steps,
            "computed_tokens": self.num_computed_tokens,
            **(self.speculator.stats() if self.speculator is not None else {}),
        }

    def release_kv(self, kv) -> None:
        """Hand back a prompt's KV from its output (`out.kv`) once nothing reads it any more
        (its transfer is done), for the next gather to fill. Any thread may call it; KV that
        never comes back is freed as usual."""
        self.runner.release_kv(kv)

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any; a one-rank engine holds nothing."""
        if isinstance(self.runner, TensorParallelExecutor):
            self.runner.close()

    # -- offline -------------------------------------------------------------------------

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.config.model)
        return self._tokenizer

    def generate(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
    ) -> list[GenerationResult]:
        """Run prompts (text or token ids) to completion; results in prompt order."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        ids: list[str] = []
        results: dict[str, GenerationResult] = {}
        start = time.monotonic()
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            rid = f"gen-{i}-{start}"
            self.add_request(rid, token_ids, p, arrival_time=start + i * 1e-9)
            ids.append(rid)
            results[rid] = GenerationResult(rid, token_ids, [], None, [])
        while self.has_unfinished():
            for out in self.step():
                result = results[out.request_id]
                result.token_ids.extend(out.new_token_ids)
                result.logprobs.extend(out.new_logprobs)
                if out.prompt_logprobs is not None:
                    result.prompt_logprobs = out.prompt_logprobs
                if out.finished:
                    result.finish_reason = out.finish_reason
        if self._tokenizer is not None or any(isinstance(p, str) for p in prompts):
            for result in results.values():
                result.text = self.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        return [results[rid] for rid in ids]
