"""Measures a HardwareProfile on this machine: the engine in-process, driven the way a
prefill worker (prompts held for KV hand-off) and a decode worker (KV arrives, then one token
per step) drive it. The only module of the autoscaler that imports torch."""

from __future__ import annotations

import logging
import random
import signal
import socket
import statistics
import time
from dataclasses import dataclass

from services.autoscaler.profile import DecodePoint, HardwareProfile, PrefillPoint

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProfileSettings:
    """The worker settings the profile is valid for (pass the same ones to the workers)."""

    model: str
    num_threads: int = 1
    kv_cache_memory: str = "1GiB"
    block_size: int = 16
    dtype: str = "auto"
    device: str = "auto"
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    long_prefill_token_threshold: int = 512
    quick: bool = False
    measure_worker_start: bool = True
    repeats: int = 3
    # Time every point while a real decode worker streams `colocated_batch` generations to a
    # client process, as a 1 prefill + 1 decode deployment sharing this host's cores does: the
    # two phases then contend for the CPUs (scheduling, caches, memory bandwidth) and the
    # per-token gRPC streaming costs CPU too. 0: each point with the machine to itself.
    colocated_batch: int = 0

    @property
    def prefill_sizes(self) -> list[int]:
        sizes = [64, 512, 2048] if self.quick else [16, 64, 256, 512, 1024, 2048]
        return [s for s in sizes if s <= self.max_num_batched_tokens]

    @property
    def decode_grid(self) -> tuple[list[int], list[int]]:
        if self.quick:
            return [1, 8, 32], [128, 1024]
        return [1, 4, 16, 64], [128, 512, 1536]


def measure_profile(settings: ProfileSettings, progress=print) -> HardwareProfile:
    """Times each point, and notes (notes["point_slowdown"]) how much longer it took because
    other processes held the CPU: see HardwareProfile.without_contention()."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.scheduler import SchedulerConfig
    from services.common.worker_config import parse_size

    config = EngineConfig(
        model=settings.model, dtype=settings.dtype, device=settings.device,
        block_size=settings.block_size, kv_cache_memory=parse_size(settings.kv_cache_memory),
        num_threads=settings.num_threads or None,
        scheduler=SchedulerConfig(
            max_num_batched_tokens=settings.max_num_batched_tokens,
            max_num_seqs=settings.max_num_seqs,
            long_prefill_token_threshold=settings.long_prefill_token_threshold,
        ),
    )
    start = time.perf_counter()
    engine = LLMEngine(config)
    _sync(engine)
    load_s = time.perf_counter() - start
    progress(f"model load {load_s:.2f}s, {engine.kv.num_blocks} KV blocks, "
             f"{engine.runner.device} {engine.runner.dtype}")
    rng = random.Random(0)
    _warm_up(engine, rng)
    background = _ColocatedLoad(settings) if settings.colocated_batch else None
    try:
        result = _measure_points(engine, rng, settings, load_s, progress)
    finally:
        if background is not None:
            background.stop()
    if background is not None:
        result.notes.update(colocated={"decode_batch": settings.colocated_batch,
                                       "tokens_streamed": background.tokens})
    return result


def _measure_points(engine, rng, settings: ProfileSettings, load_s: float, progress) -> HardwareProfile:
    slowdowns: list[float] = []  # per point, in the order measured (prefill, then decode)
    prefill = [_timed(slowdowns, _time_prefill, engine, rng, n, settings)
               for n in settings.prefill_sizes]
    for p, slow in zip(prefill, slowdowns, strict=True):
        progress(f"prefill {p.batch_tokens:5d} tokens: {p.seconds * 1e3:8.1f} ms "
                 f"({p.batch_tokens / p.seconds:7.0f} tokens/s; CPU contention x{slow:.1f})")
    decode = []
    sizes, lengths = settings.decode_grid
    for length in lengths:
        for size in sizes:
            tokens = length + settings.repeats + 8
            blocks_per_seq = -(-tokens // settings.block_size)
            if (size > settings.max_num_seqs or size * blocks_per_seq > engine.kv.num_blocks
                    or tokens > engine.max_model_len):
                continue  # this worker could never hold that batch
            point = _timed(slowdowns, _time_decode, engine, rng, size, length, settings)
            decode.append(point)
            progress(f"decode batch {size:3d} context {length:5d}: {point.seconds * 1e3:8.1f} ms/step"
                     f" (CPU contention x{slowdowns[-1]:.1f})")
    worker_start_s = _time_worker_start(settings) if settings.measure_worker_start else 0.0
    if worker_start_s:
        progress(f"worker start (process to READY) {worker_start_s:.2f}s")
    from engine.kv_tensor import kv_cache_bytes_per_block

    return HardwareProfile(
        model=engine.model_config.path.rstrip("/").rsplit("/", 1)[-1],
        device=str(engine.runner.device), dtype=str(engine.runner.dtype).removeprefix("torch."),
        num_threads=settings.num_threads, block_size=settings.block_size,
        kv_blocks=engine.kv.num_blocks,
        kv_bytes_per_block=kv_cache_bytes_per_block(
            engine.model_config, settings.block_size, engine.runner.dtype, engine.runner.num_kv_heads),
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_num_seqs=settings.max_num_seqs,
        long_prefill_token_threshold=settings.long_prefill_token_threshold,
        model_load_s=round(load_s, 3), worker_start_s=round(worker_start_s, 3),
        prefill=tuple(prefill), decode=tuple(decode),
        host=socket.gethostname(), measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        notes={"kv_cache_memory": settings.kv_cache_memory, "quick": settings.quick,
               "point_slowdown": slowdowns},
    )


def _timed(slowdowns: list[float], measure, *args):
    """measure(*args), noting how much longer it took because other processes held the CPU
    ((on CPU + waiting) / on CPU for this thread, from the kernel's schedstat)."""
    before = _thread_schedstat()
    point = measure(*args)
    after = _thread_schedstat()
    if before and after and after[0] > before[0]:
        run, wait = after[0] - before[0], after[1] - before[1]
        slowdowns.append(round((run + wait) / run, 4))
    else:
        slowdowns.append(1.0)
    return point


def _thread_schedstat() -> tuple[int, int] | None:
    """(ns on a CPU, ns runnable but waiting) of this thread; None where Linux does not say.
    The engine computes on this thread (torch intra-op threads = 1 in workers and here)."""
    try:
        on_cpu, waiting, _ = open("/proc/thread-self/schedstat").read().split()
    except (OSError, ValueError):
        return None
    return int(on_cpu), int(waiting)


def _sync(engine) -> None:
    if engine.runner.device.type == "cuda":
        import torch

        torch.cuda.synchronize()


def _prompt(rng: random.Random, engine, n: int) -> list[int]:
    # Random ids: no prefix-cache hits between measurements.
    return [rng.randrange(100, engine.model_config.vocab_size) for _ in range(n)]


def _warm_up(engine, rng: random.Random) -> None:
    from engine.sampling_params import SamplingParams

    for n in (32, 256):
        engine.add_request(f"warm-{n}", _prompt(rng, engine, n),
                           SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()


def _time_prefill(engine, rng, batch_tokens: int, settings: ProfileSettings) -> PrefillPoint:
    """Prompts of at most one chunk each, filling one step with batch_tokens tokens, held for
    KV hand-off as a prefill worker holds them (the step includes gathering their KV)."""
    from engine.sampling_params import SamplingParams

    chunk = min(batch_tokens, settings.long_prefill_token_threshold, engine.max_model_len - 2)
    times = []
    for rep in range(settings.repeats):
        ids = []
        left = batch_tokens
        while left > 0:
            n = min(chunk, left)
            rid = f"prefill-{batch_tokens}-{rep}-{left}"
            engine.add_request(rid, _prompt(rng, engine, n),
                               SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                               hold_kv=True)
            ids.append(rid)
            left -= n
        _sync(engine)
        start = time.perf_counter()
        engine.step()
        _sync(engine)
        times.append(time.perf_counter() - start)
        while engine.has_unfinished():
            engine.step()
    return PrefillPoint(batch_tokens, round(statistics.median(times), 6))


def _time_decode(engine, rng, batch_size: int, context_len: int,
                 settings: ProfileSettings) -> DecodePoint:
    """batch_size sequences whose KV 'arrived' (reserved blocks, no payload: the values do not
    change the timing), then decode steps at that context length."""
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=settings.repeats + 8, temperature=0.0, ignore_eos=True)
    ids = []
    for i in range(batch_size):
        rid = f"decode-{batch_size}-{context_len}-{i}"
        engine.remote.reserve(rid, _prompt(rng, engine, context_len - 1), params)
        engine.remote.start_for_profiling(rid, 100)
        ids.append(rid)
    engine.step()  # first step of this batch shape
    times = []
    for _ in range(settings.repeats):
        _sync(engine)
        start = time.perf_counter()
        engine.step()
        _sync(engine)
        times.append(time.perf_counter() - start)
    for rid in ids:
        engine.abort(rid)
    return DecodePoint(batch_size, context_len, round(statistics.median(times), 6))


def _time_worker_start(settings: ProfileSettings) -> float:
    """A real worker process (the one the actuators start) from spawn to its READY line."""
    from splitserve_cli.processes import start_worker

    start = time.perf_counter()
    worker = start_worker("decode", settings.model, "--kv-cache-memory", settings.kv_cache_memory,
                          "--metrics-port", "-1", "--dtype", settings.dtype,
                          "--device", settings.device,
                          "--num-threads", str(settings.num_threads), timeout=300)
    elapsed = time.perf_counter() - start
    worker.kill(signal.SIGTERM)
    return elapsed


class _ColocatedLoad:
    """A real decode worker (the workers' flags) on this host, and a client process that keeps
    `colocated_batch` generations streaming from it (128-token prompts, 256 tokens each, one
    after another): the other phase of a 1 + 1 deployment sharing this machine, busy."""

    def __init__(self, settings: ProfileSettings) -> None:
        import subprocess
        import sys
        from pathlib import Path

        from splitserve_cli.processes import start_worker

        self.tokens = 0
        self.worker = start_worker(
            "decode", settings.model, "--kv-cache-memory", settings.kv_cache_memory,
            "--max-num-batched-tokens", str(settings.max_num_batched_tokens),
            "--metrics-port", "-1", "--dtype", settings.dtype, "--device", settings.device,
            "--num-threads", str(settings.num_threads), timeout=300)
        self.client = subprocess.Popen(
            [sys.executable, "-c", "import sys; from services.autoscaler.profiler import "
             "colocated_client; colocated_client(sys.argv[1], int(sys.argv[2]))",
             self.worker.address, str(settings.colocated_batch)],
            cwd=str(Path(__file__).resolve().parent.parent.parent),
            stdout=subprocess.PIPE, text=True)
        line = self.client.stdout.readline()  # the first token streamed: the load is on
        if not line.startswith("tokens"):
            self.stop()
            raise RuntimeError("colocated decode load did not start")
        time.sleep(1.0)

    def stop(self) -> None:
        self.client.terminate()
        try:
            out, _ = self.client.communicate(timeout=10)
            counts = [int(line.split()[1]) for line in out.splitlines() if line.startswith("tokens")]
            self.tokens = max(counts, default=0)
        except Exception:  # noqa: BLE001 - the count is informational only
            self.client.kill()
        self.worker.kill(signal.SIGTERM)


def colocated_client(address: str, batch: int) -> None:
    """Runs in its own process: `batch` concurrent streams from the decode worker at address,
    each restarted when it ends, until SIGTERM; prints 'tokens N' as it goes."""
    import asyncio
    import sys

    from splitserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc

    from services.common.security import TLSFiles, aio_channel

    signal.signal(signal.SIGTERM, lambda *_: (print(f"tokens {count[0]}", flush=True), sys.exit(0)))
    count, shown = [0], [0]

    async def stream(slot: int) -> None:
        # The worker inherited this environment: TLS (SPLITSERVE_TLS_*) if it has it.
        async with aio_channel(address, TLSFiles.from_env()) as channel:
            stub = decode_pb2_grpc.DecodeStub(channel)
            n = 0
            while True:
                n += 1
                prompt = [(31 * slot + 7 * n + 13 * i) % 500 + 100 for i in range(128)]  # any vocab
                sampling = common_pb2.SamplingParams(max_tokens=256, temperature=0.0,
                                                     has_temperature=True, ignore_eos=True, seed=1)
                call = stub.Generate(decode_pb2.GenerateRequest(
                    request_id=f"colocated-{slot}-{n}", prompt_token_ids=prompt, sampling=sampling))
                async for message in call:
                    count[0] += len(message.delta.token_ids)
                    if count[0] > shown[0]:
                        print(f"tokens {count[0]}", flush=True)
                        shown[0] = count[0] + 499

    async def main() -> None:
        await asyncio.gather(*(stream(i) for i in range(batch)))

    asyncio.run(main())
