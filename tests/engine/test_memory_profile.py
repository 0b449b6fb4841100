"""Memory at start (engine/memory_profile.py): the profile step is the largest the scheduler can
build, its peak is measured, the KV pool is sized from what is left (GPU arithmetic through a
fake memory reader, CPU for real) and a pool that cannot hold one max-length request refuses."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from engine import memory_profile
from engine.config import EngineConfig, ModelConfig
from engine.llm_engine import LLMEngine
from engine.memory_profile import (
    CPU_AUTO_KV_CAP,
    KVPoolTooSmall,
    ProfileStep,
    kv_budget,
)
from engine.memory_readers import MemoryReader
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerConfig

REPO = Path(__file__).resolve().parents[2]

GiB = 1 << 30


class FakeGpuMemory(MemoryReader):
    """A mock for a CUDA device, which this machine lacks: reports a fixed step peak and the
    free/total pair cudaMemGetInfo would, so the GPU sizing rule runs on the CPU."""

    device_type = "cuda"

    def __init__(self, peak: int, free: int, total: int) -> None:
        self.peak, self.free, self.total = peak, free, total
        self.started = False

    def start(self) -> None:
        self.started = True

    def peak_above_start(self) -> int:
        assert self.started, "the peak was read without a reset before the step"
        return self.peak

    def free_and_total(self) -> tuple[int, int]:
        return self.free, self.total


def model_config(tiny_llama_dir) -> ModelConfig:
    return ModelConfig.from_dir(tiny_llama_dir)


def config(tiny_llama_dir, **fields) -> EngineConfig:
    sched = {k: fields.pop(k) for k in list(fields) if hasattr(SchedulerConfig, k)}
    return EngineConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu",
                        scheduler=SchedulerConfig(**sched), **fields)


# -- the profile step ---------------------------------------------------------------------


def test_profile_step_fills_the_token_budget_and_the_seq_limit(tiny_llama_dir):
    # Defaults: 2048 tokens, 128 sequences, chunks of 512; the tiny model's context is 512.
    step = ProfileStep.largest(config(tiny_llama_dir), model_config(tiny_llama_dir))
    assert step.num_tokens == 2048 and step.num_rows == 128
    assert step.prefill_chunks == (511, 511, 511, 391) and step.num_decode_rows == 124
    assert step.context_len == 511  # each chunk ends a prompt of max_model_len - 1 tokens


def test_profile_step_cuts_chunks_as_the_scheduler_does(tiny_llama_dir):
    mc = model_config(tiny_llama_dir)
    one_seq = ProfileStep.largest(config(tiny_llama_dir, max_num_seqs=1), mc)
    assert (one_seq.num_decode_rows, one_seq.prefill_chunks) == (0, (511,))
    short = ProfileStep.largest(config(tiny_llama_dir, max_model_len=100,
                                       long_prefill_token_threshold=64), mc)
    assert short.context_len == 99 and max(short.prefill_chunks) == 64
    assert short.num_tokens == 2048 and short.num_rows == 128
    decode_only = ProfileStep.largest(config(tiny_llama_dir, max_num_batched_tokens=32,
                                             max_num_seqs=64), mc)
    assert (decode_only.num_decode_rows, decode_only.prefill_chunks) == (32, ())
    assert decode_only.num_blocks == 1


def test_a_step_of_prompts_alone_is_a_second_candidate_when_its_chunks_are_longer(tiny_llama_dir):
    mc = model_config(tiny_llama_dir)
    # Chunks of 64 beside decode rows; prompts alone take the whole budget of 256 in one chunk.
    mixed, alone = ProfileStep.candidates(config(tiny_llama_dir, max_num_batched_tokens=256,
                                                 long_prefill_token_threshold=64), mc)
    assert max(mixed.prefill_chunks) == 64 and mixed.num_decode_rows > 0
    assert (alone.num_decode_rows, alone.prefill_chunks, alone.context_len) == (0, (256,), 511)
    # The model's context caps a chunk either way; and a scheduler that cuts every step has
    # one candidate.
    assert len(ProfileStep.candidates(config(tiny_llama_dir), mc)) == 1
    assert len(ProfileStep.candidates(config(tiny_llama_dir, max_num_batched_tokens=256,
                                             long_prefill_token_threshold=64,
                                             chunk_prompts_alone=True), mc)) == 1


def test_the_profile_runs_every_candidate_and_keeps_the_highest_peak(tiny_llama_dir, monkeypatch):
    peaks = iter([5 << 20, 9 << 20])
    seen = []

    class Reader(FakeGpuMemory):
        def peak_above_start(self) -> int:
            return next(peaks)

    execute = ModelRunner.execute_model

    def recording(self, sched, draft_probs=None):
        seen.append(sched.total_num_scheduled_tokens)
        return execute(self, sched, draft_probs)

    engine = LLMEngine(config(tiny_llama_dir, num_kv_blocks=4, max_num_batched_tokens=256,
                              long_prefill_token_threshold=64, max_num_seqs=16))
    monkeypatch.setattr(ModelRunner, "execute_model", recording)
    runner = engine.runner
    peak, step = memory_profile.profile_peak_step(runner, Reader(0, 0, 0))
    assert seen == [256, 0, 256, 0]  # each step, then the step that drops its requests
    assert (peak, step.prefill_chunks, step.num_decode_rows) == (9 << 20, (256,), 0)
    assert runner.requests == {}


def test_the_runner_runs_the_profile_step_and_forgets_it(tiny_llama_dir, monkeypatch):
    seen = []
    execute = ModelRunner.execute_model

    def recording(self, sched, draft_probs=None):
        seen.append(sched.total_num_scheduled_tokens)
        return execute(self, sched, draft_probs)

    monkeypatch.setattr(ModelRunner, "execute_model", recording)
    engine = LLMEngine(config(tiny_llama_dir, kv_cache_memory=0, max_num_batched_tokens=256,
                              max_num_seqs=16))
    monkeypatch.setattr(ModelRunner, "execute_model", execute)
    assert seen[:2] == [256, 0]  # the step, then the step that drops its requests
    memory = engine.runner.memory
    assert (memory.profile_tokens, memory.profile_rows) == (256, 16)
    assert memory.peak_step_bytes >= 0 and memory.source == "available_ram"
    assert engine.runner.requests == {}
    assert engine.runner.kv_cache.shape[2] == memory.num_blocks == engine.kv.num_blocks
    out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out[0].token_ids) == 4
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_explicit_num_kv_blocks_wins_and_skips_the_profile(tiny_llama_dir, monkeypatch):
    monkeypatch.setattr(memory_profile, "profile_peak_step",
                        lambda *a: pytest.fail("profiled under --num-kv-blocks"))
    engine = LLMEngine(config(tiny_llama_dir, num_kv_blocks=3))
    memory = engine.runner.memory
    assert (memory.num_blocks, memory.source, memory.peak_step_bytes) == (3, "num_kv_blocks", -1)
    assert memory.weights_bytes == sum(p.numel() * 4 for p in engine.runner.model.parameters())


# -- measuring ----------------------------------------------------------------------------


_PEAK_PROBE = """
import sys, time, torch
from engine.memory_readers import HostMemory
reset = sys.argv[1] == "1"
reader = HostMemory(reset_high_water=reset)
reader.start()
block = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, every page touched
if not reset:
    time.sleep(0.05)  # the sampler looks every millisecond
del block
free, total = reader.free_and_total()
print(reader.peak_above_start(), free, total)
"""


@pytest.mark.parametrize("reset_high_water", [True, False], ids=["vmhwm", "sampled"])
def test_host_memory_sees_a_step_peak_that_is_freed_before_the_reading(reset_high_water):
    """In a fresh process, as at a worker's start: in the test process, heap that earlier tests
    freed but kept resident can take the 64 MiB without the resident set growing at all (the
    full suite read 0 and 4096 bytes)."""
    out = subprocess.run([sys.executable, "-c", _PEAK_PROBE, "1" if reset_high_water else "0"],
                         capture_output=True, text=True, timeout=120, cwd=REPO, check=True)
    peak, free, total = (int(x) for x in out.stdout.split())
    assert 60 << 20 <= peak <= 96 << 20, peak
    assert 0 < free <= total


# -- sizing -------------------------------------------------------------------------------


def test_gpu_pool_is_the_utilization_share_minus_what_is_in_use_and_the_peak(tiny_llama_dir):
    cfg = config(tiny_llama_dir, kv_cache_memory=0, gpu_memory_utilization=0.9)
    # An 80 GiB device; 16 GiB in use after the profile (weights, CUDA context); 2 GiB peak.
    budget, source = kv_budget(cfg, "cuda", peak_step=2 * GiB, free=64 * GiB, total=80 * GiB)
    assert source == "gpu_memory_utilization"
    assert budget == int(80 * GiB * 0.9) - 16 * GiB - 2 * GiB
    # An explicit size is the pool on any device.
    assert kv_budget(dataclasses.replace(cfg, kv_cache_memory=3 * GiB), "cuda", 2 * GiB,
                     64 * GiB, 80 * GiB) == (3 * GiB, "kv_cache_memory")
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_budget(dataclasses.replace(cfg, gpu_memory_utilization=1.5), "cuda", 0, 1, 1)


def test_cpu_auto_pool_takes_half_of_what_is_available_capped(tiny_llama_dir):
    cfg = config(tiny_llama_dir, kv_cache_memory=0)
    assert kv_budget(cfg, "cpu", GiB, free=64 * GiB, total=128 * GiB) == (CPU_AUTO_KV_CAP,
                                                                          "available_ram")
    assert kv_budget(cfg, "cpu", 256 << 20, free=1280 << 20, total=GiB)[0] == 512 << 20
    # Ranks of one host share its RAM.
    assert kv_budget(cfg, "cpu", 0, free=1 * GiB, total=GiB, tp_size=2)[0] == 256 << 20


def test_a_gpu_sized_pool_through_a_fake_reader(tiny_llama_dir):
    cfg = config(tiny_llama_dir, kv_cache_memory=0, gpu_memory_utilization=0.5)
    runner = ModelRunner(dataclasses.replace(cfg, num_kv_blocks=1), model_config(tiny_llama_dir))
    runner.config = cfg  # the same runner, now sized from memory
    per_block = 8192  # tiny model, float32: 2 layers x K,V x 16 slots x 4 heads x 8 x 4 bytes
    reader = FakeGpuMemory(peak=100 * per_block, free=900 * per_block, total=1000 * per_block)
    figures = memory_profile.size_kv_pool(runner, per_block, reader=reader)
    # 500 blocks' worth may be used, 100 are in use, the step peaks at 100: 300 for KV.
    assert (figures.num_blocks, figures.kv_pool_bytes) == (300, 300 * per_block)
    assert figures.device == "cuda" and figures.source == "gpu_memory_utilization"
    assert (figures.peak_step_bytes, figures.free_bytes) == (100 * per_block, 900 * per_block)
    assert runner.requests == {}

    # 0.2 of the device leaves 200 - 100 - 100 = 0 blocks: refused with the numbers.
    runner.config = dataclasses.replace(cfg, gpu_memory_utilization=0.2)
    with pytest.raises(KVPoolTooSmall) as refused:
        memory_profile.size_kv_pool(runner, per_block, reader=reader)
    message = str(refused.value)
    assert "holds 0 blocks" in message and "max_model_len=512" in message
    assert "needs 32 blocks" in message and "Raise --gpu-memory-utilization" in message


def test_a_pool_short_of_one_max_length_request_refuses(tiny_llama_dir):
    # 512 tokens need 32 blocks of 8 KiB; 100 KB holds 12.
    with pytest.raises(KVPoolTooSmall, match=r"holds 12 blocks \(192 tokens\).*needs 32 blocks"):
        LLMEngine(config(tiny_llama_dir, kv_cache_memory=100_000))
    # The same memory serves a shorter context.
    engine = LLMEngine(config(tiny_llama_dir, kv_cache_memory=100_000, max_model_len=192))
    assert engine.kv.num_blocks == 12


@pytest.mark.timeout(180)
def test_tensor_parallel_ranks_profile_the_same_step_together(tiny_llama_dir):
    # Every rank runs the profile step in its ModelRunner at once; were the steps different,
    # their collectives would not pair and the start would hang (or fail) here.
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    single = LLMEngine(config(tiny_llama_dir, kv_cache_memory=0, max_num_batched_tokens=256))
    expected = single.generate([[5, 6, 7, 8]], params)[0].token_ids
    engine = LLMEngine(config(tiny_llama_dir, kv_cache_memory=0, max_num_batched_tokens=256,
                              tensor_parallel_size=2, num_threads=1))
    try:
        memory = engine.runner.memory
        assert memory.profile_tokens == 256 and memory.peak_step_bytes >= 0
        # Each rank holds half the KV heads, so a block is half the bytes of one rank's.
        assert memory.bytes_per_block * 2 == single.runner.memory.bytes_per_block
        assert engine.generate([[5, 6, 7, 8]], params)[0].token_ids == expected
    finally:
        engine.close()


def test_an_explicit_pool_short_of_max_model_len_limits_what_is_advertised(tiny_llama_dir, caplog):
    """An explicit --num-kv-blocks is not refused (tests and benchmarks size pools small on
    purpose), but the worker then serves and advertises what the pool holds: the gateway
    refuses a longer request up front (400) instead of cutting its output with "length"."""
    with caplog.at_level("WARNING", logger="engine.memory_profile"):
        engine = LLMEngine(config(tiny_llama_dir, num_kv_blocks=8))
    held = 8 * engine.config.block_size
    assert engine.max_model_len > held
    assert engine.servable_len == held
    assert any("limited to" in r.getMessage() for r in caplog.records), caplog.text
    roomy = LLMEngine(config(tiny_llama_dir, num_kv_blocks=256))
    assert roomy.servable_len == roomy.max_model_len
