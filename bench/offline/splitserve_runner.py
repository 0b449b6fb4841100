"""splitserve's side: the engine as `make run` builds it (its shipped dtype, chunked prefill and
prefix caching on), driven through its step API in this process."""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from bench.offline.workload import Workload
from engine.config import EngineConfig, ModelConfig
from engine.kv_tensor import kv_cache_bytes_per_block
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


def kv_cache_memory(model_dir: str, config: EngineConfig, plan: dict[str, list[Workload]]) -> int:
    """The shipped KV budget, or more where the largest run's requests at their full length at
    once (plus slack) would not fit: no run preempts, as none does in vLLM with its 4 GiB."""
    model_config = ModelConfig.from_dir(model_dir)
    bs = config.block_size
    per_block = kv_cache_bytes_per_block(model_config, bs, config.resolve_dtype(torch.device("cpu")),
                                         model_config.num_kv_heads)
    blocks = max(sum(-(-(len(r.prompt) + r.max_tokens) // bs) for r in w.requests)
                 for ws in plan.values() for w in ws)
    return max(config.kv_cache_memory, (blocks + 64) * per_block)


def build_engine(model_dir: str, threads: int, seed: int, plan: dict[str, list[Workload]],
                 dtype: str = "auto") -> LLMEngine:
    config = EngineConfig(model=model_dir, dtype=dtype, device="cpu", num_threads=threads, seed=seed)
    return LLMEngine(dataclasses.replace(config, kv_cache_memory=kv_cache_memory(model_dir, config, plan)))


class SplitserveRunner:
    """Owned by the bench's thread, like any engine."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._runs = 0

    def run(self, work: Workload) -> dict:
        engine = self.engine
        self._runs += 1
        tag = f"{work.name}-{self._runs}"
        hits_before = engine.kv.prefix_hits
        for i, r in enumerate(work.requests):
            engine.add_request(f"{tag}-{i}", r.prompt, SamplingParams(**r.sampling_fields()))
        done = 0
        wall, cpu = time.perf_counter(), time.process_time()
        while engine.has_unfinished():
            for out in engine.step():
                done += len(out.new_token_ids)
        return {"seconds": time.perf_counter() - wall, "cpu_seconds": time.process_time() - cpu,
                "output_tokens": done, "cached_tokens": engine.kv.prefix_hits - hits_before}


def decode_step_ms(engine: LLMEngine, prompt: list[int], num_tokens: int) -> float:
    """Median milliseconds of one batch-1 engine step after the prefill step (bench/cpu_linear.py
    compares linear paths with it; this bench times whole runs instead, as it must for vLLM)."""
    engine.add_request(f"b1-{time.monotonic_ns()}", prompt,
                       SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True))
    engine.step()  # prefill and the first token
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3
