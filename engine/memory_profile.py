"""Memory at start: after the weights load, run the largest step the configuration allows,
record its peak, and size the KV pool from what is left (README "Memory at start").

Runs on the thread that builds the ModelRunner, before its KV cache exists (every
tensor-parallel rank runs the same profile step at the same time, so its collectives pair up).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.config import EngineConfig, ModelConfig
from engine.memory_readers import MemoryReader, memory_reader
from engine.outputs import NewRequestData, SchedulerOutput
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# On a CPU without --kv-cache-memory the pool takes half of what is available after the step's
# peak (the other processes of `make run` start beside this one and need theirs), at most this:
# today's shipped 1 GiB, so a host with room to spare serves exactly as before.
CPU_AUTO_KV_CAP = 1 << 30
CPU_AUTO_SHARE = 0.5
PROFILE_REQUEST_PREFIX = "__memory_profile_"


class KVPoolTooSmall(ValueError):
    """The KV pool the memory allows cannot hold one request of max_model_len tokens."""


@dataclass(frozen=True)
class MemoryFigures:
    """What the start-up profile found and what the KV pool got; read by logs and /metrics."""

    device: str  # "cpu" | "cuda"
    weights_bytes: int  # parameters and buffers of the model on this rank, packed copies too
    peak_step_bytes: int  # above the memory held before the profile step; -1: not profiled
    kv_pool_bytes: int
    num_blocks: int
    bytes_per_block: int
    source: str  # what sized the pool: num_kv_blocks | kv_cache_memory | available_ram | gpu_memory_utilization
    free_bytes: int = 0  # device free memory (CUDA) or MemAvailable (CPU) after the profile
    total_bytes: int = 0  # device memory (CUDA) or MemTotal (CPU)
    profile_tokens: int = 0  # tokens of the profile step
    profile_rows: int = 0  # requests of the profile step
    profile_seconds: float = 0.0  # wall time of the profile step (start-up's kv_allocation)

    def describe(self) -> str:
        """One log line: exact bytes to parse, MiB to read."""
        return (f"memory at start: device={self.device} weights_bytes={self.weights_bytes} "
                f"peak_step_bytes={self.peak_step_bytes} kv_pool_bytes={self.kv_pool_bytes} "
                f"kv_blocks={self.num_blocks} bytes_per_block={self.bytes_per_block} "
                f"sized_by={self.source} free_bytes={self.free_bytes} "
                f"total_bytes={self.total_bytes} profile_step={self.profile_tokens}tokens/"
                f"{self.profile_rows}requests/{self.profile_seconds:.2f}s (weights "
                f"{_mib(self.weights_bytes)}, peak step {_mib(self.peak_step_bytes)}, KV pool "
                f"{_mib(self.kv_pool_bytes)}, free {_mib(self.free_bytes)} of "
                f"{_mib(self.total_bytes)})")


def _mib(n: int) -> str:
    if n < 0:
        return "-"
    return f"{n / 2**20:.1f}MiB" if n >= 2**20 else f"{n / 2**10:.1f}KiB"


# -- the profile step ---------------------------------------------------------------------


def max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    """The longest request (prompt plus output) the engine accepts; as LLMEngine reads it."""
    limit = model_config.max_position_embeddings
    return min(config.max_model_len or limit, limit)


@dataclass(frozen=True)
class ProfileStep:
    """One of the largest steps the scheduler can build: `num_decode_rows` requests decoding
    one token each and prefill chunks filling the rest of max_num_batched_tokens, each chunk as
    long as the scheduler cuts one and placed at the end of a max_model_len prompt, so it
    attends to the longest context a chunk can see. Rows share their blocks: only the memory of
    the step is measured, not its KV. A step with decode rows cuts chunks at
    long_prefill_token_threshold; one of prompts alone takes them whole (engine/scheduler.py),
    so there are two candidates (candidates())."""

    num_decode_rows: int
    prefill_chunks: tuple[int, ...]
    context_len: int  # tokens each prefill chunk's prompt ends at
    block_size: int

    @property
    def num_tokens(self) -> int:
        return self.num_decode_rows + sum(self.prefill_chunks)

    @property
    def num_rows(self) -> int:
        return self.num_decode_rows + len(self.prefill_chunks)

    @property
    def num_blocks(self) -> int:
        """Blocks of the scratch KV cache the step writes into (shared by all rows)."""
        return -(-self.context_len // self.block_size) if self.prefill_chunks else 1

    @classmethod
    def largest(cls, config: EngineConfig, model_config: ModelConfig,
                decoding: bool = True) -> ProfileStep:
        """With `decoding`, the step with the most decode rows beside chunks of the threshold;
        without, prompts alone in the longest chunks the scheduler then takes."""
        sched = config.scheduler
        length = max_model_len(config, model_config)
        budget = max(sched.max_num_batched_tokens, 1)
        cut = decoding or sched.chunk_prompts_alone
        chunk = (sched.long_prefill_token_threshold if sched.enable_chunked_prefill and cut
                 else budget)
        chunk = max(min(chunk or budget, budget, length - 1), 1)
        # Decode rows take one token each; prefill chunks take the rest of the budget, and
        # every row counts against max_num_seqs.
        rows = min(sched.max_num_seqs, budget)
        decode = rows if decoding else 0
        while decode > 0 and decode + -(-(budget - decode) // chunk) > rows:
            decode -= 1
        left = budget - decode
        chunks = [chunk] * (left // chunk) + ([left % chunk] if left % chunk else [])
        chunks = chunks[: rows - decode]
        return cls(num_decode_rows=decode, prefill_chunks=tuple(chunks),
                   context_len=max(length - 1, *chunks, 1), block_size=config.block_size)

    @classmethod
    def candidates(cls, config: EngineConfig, model_config: ModelConfig) -> list[ProfileStep]:
        """The steps whose peak bounds every step's: the largest with decode rows, and the
        largest of prompts alone where its chunks are longer."""
        steps = [cls.largest(config, model_config)]
        alone = cls.largest(config, model_config, decoding=False)
        if alone.prefill_chunks and max(alone.prefill_chunks) > max(steps[0].prefill_chunks,
                                                                     default=0):
            steps.append(alone)
        return steps

    def scheduler_output(self, vocab_size: int) -> SchedulerOutput:
        bs = self.block_size
        new, scheduled = [], {}
        # Sampled like a real request (temperature, top-p/top-k), so the sampler's sorts count.
        params = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.9, top_k=50, seed=0)
        for i, n in enumerate(self.prefill_chunks):
            end = self.context_len
            tokens = [(7 * t + i) % vocab_size for t in range(end)]
            rid = f"{PROFILE_REQUEST_PREFIX}prefill_{i}"
            new.append(NewRequestData(rid, tokens, params, list(range(-(-end // bs))),
                                      num_computed_tokens=end - n, num_prompt_tokens=end))
            scheduled[rid] = n
        for i in range(self.num_decode_rows):
            ctx = bs  # decode attention reads in place (or gathers what the pool holds)
            rid = f"{PROFILE_REQUEST_PREFIX}decode_{i}"
            new.append(NewRequestData(rid, [(3 * t + i) % vocab_size for t in range(ctx)],
                                      params, [0], num_computed_tokens=ctx - 1,
                                      num_prompt_tokens=ctx - 1))
            scheduled[rid] = 1
        return SchedulerOutput(new_requests=new, cached_requests=[],
                               num_scheduled_tokens=scheduled,
                               total_num_scheduled_tokens=sum(scheduled.values()),
                               finished_request_ids=set())


def weights_bytes(model: torch.nn.Module) -> int:
    """Parameters and buffers (tied ones once), and the weights' packed copies, in the AMX
    kernel's layout or oneDNN's (engine/layers/linear.py use_packed_weights)."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    packed = [m.packed_weight for m in model.modules() if getattr(m, "packed_weight", None) is not None]
    return sum(t.numel() * t.element_size() for t in (*tensors.values(), *packed))


def profile_peak_step(runner, reader: MemoryReader) -> tuple[int, ProfileStep]:
    """Runs the largest steps (ProfileStep.candidates) on `runner` (a ModelRunner without its
    KV cache yet) over a scratch cache, and returns the most bytes one took above what was held
    before it, and that step.

    Only the first decoder layer runs (the model runs as many layers as it is given caches):
    layers run one after another and each frees its temporaries, so one layer peaks as high
    as all of them, while a full step of 2048 tokens takes tens of seconds on a small CPU host
    and its scratch cache would be a whole max-length request's KV.
    """
    measured = [(_step_peak(runner, reader, step), step)
                for step in ProfileStep.candidates(runner.config, runner.model_config)]
    return max(measured, key=lambda pair: pair[0])


def _step_peak(runner, reader: MemoryReader, step: ProfileStep) -> int:
    mc = runner.model_config
    # A step of decode rows alone may take the fused C++ decode, which runs every layer.
    layers = 1 if step.prefill_chunks else mc.num_layers
    scratch = torch.zeros(layers, 2, step.num_blocks, step.block_size,
                          runner.num_kv_heads, mc.head_dim, dtype=runner.dtype,
                          device=runner.device)
    runner.kv_cache, runner.kv_caches = scratch, list(scratch.unbind(0))
    sched = step.scheduler_output(mc.vocab_size)
    try:
        reader.start()
        runner.execute_model(sched)
        return reader.peak_above_start()
    finally:
        # The runner forgets the profile's requests; the scratch cache goes with the references.
        runner.execute_model(SchedulerOutput([], [], {}, 0, set(sched.num_scheduled_tokens)))
        runner.kv_cache, runner.kv_caches = None, []
        del scratch


# -- sizing -------------------------------------------------------------------------------


def kv_budget(config: EngineConfig, device_type: str, peak_step: int, free: int, total: int,
              tp_size: int = 1) -> tuple[int, str]:
    """Bytes of KV this rank may allocate, and what decided it. An explicit kv_cache_memory is
    the pool itself. On CUDA the worker may use gpu_memory_utilization of the device's total;
    what is in use already (these weights, the CUDA context, anything else on the device:
    total - free, after the profile) and the step's peak come off it. On a CPU the pool takes
    CPU_AUTO_SHARE of MemAvailable past the step's peak (the weights are resident already, so
    MemAvailable excludes them), split among the ranks on the host, at most CPU_AUTO_KV_CAP."""
    if config.kv_cache_memory:
        return config.kv_cache_memory, "kv_cache_memory"
    if device_type == "cuda":
        util = config.gpu_memory_utilization
        if not 0 < util <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util}")
        return int(total * util) - (total - free) - peak_step, "gpu_memory_utilization"
    share = int(CPU_AUTO_SHARE * (free - peak_step)) // max(tp_size, 1)
    return min(CPU_AUTO_KV_CAP, share), "available_ram"


def size_kv_pool(runner, bytes_per_block: int, *, reader: MemoryReader | None = None,
                 min_over_ranks: Callable[[int], int] = int, tp_size: int = 1) -> MemoryFigures:
    """The KV pool of `runner` (its model loaded, no KV cache yet): profiled, sized, checked."""
    config = runner.config
    device = runner.device
    weights = weights_bytes(runner.model)
    if config.num_kv_blocks:
        # An explicit block count wins, and no step runs: tests and benchmarks start fast.
        num = config.num_kv_blocks
        held, limit = num * config.block_size, max_model_len(config, runner.model_config)
        if held < limit:
            log.warning("--num-kv-blocks %d holds %d tokens, less than max_model_len=%d: requests "
                        "are limited to %d tokens (prompt and output), and that is the context "
                        "this worker advertises", num, held, limit, held)
        return MemoryFigures(device.type, weights, -1, num * bytes_per_block, num,
                             bytes_per_block, "num_kv_blocks")
    reader = reader or memory_reader(device)
    started = time.monotonic()
    try:
        peak, step = profile_peak_step(runner, reader)
    except torch.OutOfMemoryError as exc:
        raise KVPoolTooSmall(
            f"the profile step ({ProfileStep.largest(config, runner.model_config).num_tokens} "
            f"tokens) ran out of memory after the weights ({_mib(weights)}): {exc}. Lower "
            "--max-num-batched-tokens, --max-num-seqs or --max-model-len") from None
    seconds = time.monotonic() - started
    free, total = reader.free_and_total()
    budget, source = kv_budget(config, reader.device_type, peak, free, total, tp_size)
    # Tensor-parallel ranks share block ids, so they agree on the smallest count.
    num = min_over_ranks(max(budget // bytes_per_block, 0))
    figures = MemoryFigures(reader.device_type, weights, peak, num * bytes_per_block, num,
                            bytes_per_block, source, free, total, step.num_tokens, step.num_rows,
                            seconds)
    log.info("%s", figures.describe())
    if reader.device_type == "cpu" and source == "kv_cache_memory" and budget > free - peak:
        # Pages of a CPU pool are taken when first written: this fails later, not now.
        log.warning("--kv-cache-memory %s is more than the %s available past the step's peak; "
                    "the host may run out of memory as the pool fills",
                    _mib(budget), _mib(free - peak))
    check_holds_one_request(figures, max_model_len(config, runner.model_config),
                            config.block_size, budget)
    return figures


FLAG_OF_SOURCE = {
    "kv_cache_memory": "Raise --kv-cache-memory",
    "available_ram": "Free RAM or set --kv-cache-memory",
    "gpu_memory_utilization": "Raise --gpu-memory-utilization",
}


def check_holds_one_request(figures: MemoryFigures, max_len: int, block_size: int,
                            budget: int) -> None:
    needed = -(-max_len // block_size)
    if figures.num_blocks >= needed:
        return
    raise KVPoolTooSmall(
        f"the KV pool holds {figures.num_blocks} blocks ({figures.num_blocks * block_size} "
        f"tokens) but one request of max_model_len={max_len} tokens needs {needed} blocks "
        f"({_mib(needed * figures.bytes_per_block)}); budget {_mib(max(budget, 0))} from "
        f"{figures.source} (weights {_mib(figures.weights_bytes)}, peak step "
        f"{_mib(figures.peak_step_bytes)}, free {_mib(figures.free_bytes)} of "
        f"{_mib(figures.total_bytes)}). {FLAG_OF_SOURCE[figures.source]}, or lower "
        "--max-model-len")
