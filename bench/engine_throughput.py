"""Benchmark: offline throughput of the splitserve engine against transformers `generate` (static
batches) and transformers continuous batching, and batch-1 decode latency against the memory floor.

Run from the repo root:  .venv/bin/python bench/engine_throughput.py [--quick] [--dtype auto]
Everything runs in this one process on the same requests; results go to
bench/results/engine_throughput.json as well as to stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(_ROOT))
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from bench.engine_plot import plot  # noqa: E402
from engine.config import EngineConfig, ModelConfig, cpu_has_fast_bf16  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.model_runner import kv_cache_bytes_per_block  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

PROGRESS_EVERY_S = 5.0


@dataclass(frozen=True)
class Workload:
    """Fixed-seed requests: random prompt token ids and an exact number of tokens to generate
    (EOS ignored), so every system does the same work."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(n: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                  vocab: int, seed: int) -> Workload:
    rng = random.Random(seed)
    # Ids from 100 up: clear of the special tokens at the bottom of the Llama-family vocabularies.
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(*prompt_range))] for _ in range(n)]
    return Workload(prompts, [rng.randint(*output_range) for _ in range(n)])


class Progress:
    """One line every few seconds, so a long run shows it is alive."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total = label, total
        self.start = self.last = time.perf_counter()

    def update(self, done: int, force: bool = False) -> None:
        now = time.perf_counter()
        if force or now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            print(f"  {self.label}: {done}/{self.total} tokens, {now - self.start:.1f}s", flush=True)


# -- splitserve -------------------------------------------------------------------------------


def run_splitserve(engine: LLMEngine, work: Workload, label: str = "splitserve") -> float:
    """Seconds to finish every request, driving the engine's step API."""
    tag = f"{label}-{time.monotonic_ns()}"
    for i, (prompt, n) in enumerate(zip(work.prompts, work.output_lens, strict=True)):
        engine.add_request(f"{tag}-{i}", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    progress = Progress(label, work.num_output_tokens)
    done = 0
    start = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            done += len(out.new_token_ids)
        progress.update(done)
    elapsed = time.perf_counter() - start
    if done != work.num_output_tokens:
        raise RuntimeError(f"splitserve generated {done} tokens, expected {work.num_output_tokens}")
    return elapsed


def splitserve_decode_ms(engine: LLMEngine, prompt: list[int], num_tokens: int) -> float:
    """Median milliseconds of one batch-1 decode step (the prefill step excluded)."""
    engine.add_request(f"b1-{time.monotonic_ns()}", prompt,
                       SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True))
    engine.step()  # prefill and the first token
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


# -- transformers -----------------------------------------------------------------------------


def run_hf_static(model, work: Workload, batch_size: int, pad_id: int,
                  label: str = "transformers generate") -> float:
    """`generate` on static batches in arrival order, prompts padded left. A batch runs until
    its longest request is done; only each request's own tokens count as output."""
    from transformers import GenerationConfig

    progress = Progress(label, work.num_output_tokens)
    done = 0
    start = time.perf_counter()
    for first in range(0, len(work.prompts), batch_size):
        prompts = work.prompts[first : first + batch_size]
        new = max(work.output_lens[first : first + batch_size])
        width = max(map(len, prompts))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        config = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                  pad_token_id=pad_id, eos_token_id=None)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        if out.shape[1] != width + new:
            raise RuntimeError(f"transformers generated {out.shape[1] - width} tokens, expected {new}")
        done += sum(work.output_lens[first : first + batch_size])
        progress.update(done, force=True)
    return time.perf_counter() - start


def run_hf_continuous(model, work: Workload, padding: int) -> float:
    """transformers continuous batching (the manager behind `generate_batch`), with each
    request's own max_new_tokens. Timed from the first add_request to the last result."""
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    config = GenerationConfig(max_new_tokens=max(work.output_lens), do_sample=False, eos_token_id=-1)
    # The default padding intervals size CUDA graphs; on CPU they only add padded work.
    cb_config = ContinuousBatchingConfig(q_padding_interval_size=padding, kv_padding_interval_size=padding) \
        if padding else None
    hints = WorkloadHints(max_prompt_length=max(map(len, work.prompts)),
                          max_generated_length=max(work.output_lens), num_requests=len(work.prompts))
    with model.continuous_batching_context_manager(
        generation_config=config, block=True, timeout=5, workload_hints=hints,
        continuous_batching_config=cb_config,
    ) as manager:
        progress = Progress("transformers continuous batching", work.num_output_tokens)
        start = time.perf_counter()
        for i, (prompt, n) in enumerate(zip(work.prompts, work.output_lens, strict=True)):
            manager.add_request(prompt, request_id=f"cb-{i}", max_new_tokens=n, eos_token_id=-1)
        finished: dict[str, int] = {}
        while len(finished) < len(work.prompts):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                finished[result.request_id] = len(result.generated_tokens)
                progress.update(sum(finished.values()))
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers continuous batching stopped before finishing")
        elapsed = time.perf_counter() - start
    if sum(finished.values()) != work.num_output_tokens:
        raise RuntimeError(f"continuous batching generated {sum(finished.values())} tokens, "
                           f"expected {work.num_output_tokens}")
    return elapsed


def hf_decode_ms(model, prompt: list[int], num_tokens: int) -> float:
    """Batch-1 `generate`: (time for 1 + n tokens - time for 1 token) / n."""
    from transformers import GenerationConfig

    ids = torch.tensor([prompt])

    def timed(new: int) -> float:
        config = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                  pad_token_id=0, eos_token_id=None)
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
        return time.perf_counter() - start

    return (timed(num_tokens + 1) - timed(1)) / num_tokens * 1e3


# -- memory floor -----------------------------------------------------------------------------


def copy_bandwidth_gbs(nbytes: int = 512 << 20, reps: int = 7) -> float:
    """GB/s of copying a large tensor into an existing buffer (bytes copied / time), median."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def read_bandwidth_gbs(nbytes: int = 512 << 20, reps: int = 7) -> float:
    """GB/s of only reading a large tensor (a float32 sum), median: a copy also writes as many
    bytes as it reads, so this is the stricter floor for a step that only reads weights."""
    src = torch.ones(nbytes // 4)
    src.sum()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        src.sum()
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters a decode step reads; tied embeddings count once."""
    seen: dict[int, int] = {}
    for p in model.parameters():
        seen[p.data_ptr()] = p.numel() * p.element_size()
    return sum(seen.values())


# -- main -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchConfig:
    model: str
    dtype: str
    quick: bool
    num_requests: int
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    hf_batch_size: int
    cb_padding: int
    decode_tokens: int
    decode_repeats: int
    threads: int
    seed: int
    skip_hf: bool
    out: str


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(_ROOT / "models" / "smollm2-135m-instruct"))
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="auto: the faster on this CPU (bfloat16 where it has bf16 dot products)")
    parser.add_argument("--quick", action="store_true",
                        help="16 requests, prompts 128-256, outputs 32-64 (about 2-3 minutes)")
    parser.add_argument("--num-requests", type=int)
    parser.add_argument("--hf-batch-size", type=int, help="static batch size for transformers generate")
    parser.add_argument("--cb-padding", type=int, default=1,
                        help="transformers CB q/kv padding interval (0: its CUDA-graph default)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-hf", action="store_true", help="splitserve figures only")
    parser.add_argument("--out", default=str(_ROOT / "bench" / "results" / "engine_throughput.json"))
    args = parser.parse_args(argv)
    quick = args.quick
    return BenchConfig(
        model=args.model, dtype=args.dtype, quick=quick,
        num_requests=args.num_requests or (16 if quick else 64),
        prompt_len=(128, 256) if quick else (128, 512),
        output_len=(32, 64) if quick else (64, 256),
        hf_batch_size=args.hf_batch_size or (16 if quick else 32),
        cb_padding=args.cb_padding,
        decode_tokens=32 if quick else 64,
        decode_repeats=3,
        threads=args.threads, seed=args.seed, skip_hf=args.skip_hf, out=args.out,
    )


def bench_dtype(requested: str) -> str:
    """`auto` here means the faster dtype on this CPU, not the engine's default (float32, for
    batch-invariant greedy output): bfloat16 where the cores multiply it natively."""
    if requested != "auto":
        return requested
    return "bfloat16" if cpu_has_fast_bf16() else "float32"


def timed(run, *args) -> dict:
    """Wall and process CPU seconds of run(*args), and the load average around it: the machine
    may be shared, and CPU seconds per token are the steadier figure then."""
    load_before = os.getloadavg()[0]
    wall, cpu = time.perf_counter(), time.process_time()
    run(*args)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"seconds": wall, "cpu_seconds": cpu,
            "load_average": (load_before + os.getloadavg()[0]) / 2}


def throughput(runs: list[dict], tokens: int) -> dict:
    """Medians over the runs, as output tokens per (CPU) second."""
    seconds = statistics.median(r["seconds"] for r in runs)
    cpu_seconds = statistics.median(r["cpu_seconds"] for r in runs)
    return {"seconds": seconds, "cpu_seconds": cpu_seconds,
            "load_average": statistics.fmean(r["load_average"] for r in runs),
            "tokens_per_s": tokens / seconds, "tokens_per_cpu_s": tokens / cpu_seconds, "runs": runs}


def build_engine(cfg: BenchConfig, dtype: str, work: Workload) -> LLMEngine:
    """An engine with room for every request at its full length at once: never preempts."""
    model_config = ModelConfig.from_dir(cfg.model)
    config = EngineConfig(model=cfg.model, dtype=dtype, device="cpu", num_threads=cfg.threads,
                          seed=cfg.seed)
    bs = config.block_size
    per_block = kv_cache_bytes_per_block(model_config, bs, config.resolve_dtype(torch.device("cpu")),
                                         model_config.num_kv_heads)
    num_blocks = sum(-(-(len(p) + n) // bs) for p, n in zip(work.prompts, work.output_lens, strict=True))
    return LLMEngine(dataclasses.replace(config, kv_cache_memory=(num_blocks + 64) * per_block))


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_args(argv)
    torch.set_num_threads(cfg.threads)
    dtype_name = bench_dtype(cfg.dtype)
    why = ("--dtype given" if cfg.dtype != "auto" else
           "this bench's auto: the faster dtype on this CPU; the engine's shipped CPU dtype is "
           "float32 (batch-invariant greedy tokens)")
    print(f"engine_throughput: {asdict(cfg)}; dtype {cfg.dtype} -> {dtype_name} ({why})",
          flush=True)
    vocab = ModelConfig.from_dir(cfg.model).vocab_size
    work = make_workload(cfg.num_requests, cfg.prompt_len, cfg.output_len, vocab, cfg.seed)
    warm = make_workload(2, (32, 32), (8, 8), vocab, cfg.seed + 1)
    decode_prompt = make_workload(1, (128, 128), (1, 1), vocab, cfg.seed + 2).prompts[0]
    print(f"workload: {len(work.prompts)} requests, {sum(map(len, work.prompts))} prompt tokens, "
          f"{work.num_output_tokens} output tokens", flush=True)

    start = time.perf_counter()
    engine = build_engine(cfg, dtype_name, work)
    dtype = engine.runner.dtype
    print(f"splitserve engine ready in {time.perf_counter() - start:.1f}s, {engine.kv.num_blocks} KV blocks",
          flush=True)
    wbytes = weight_bytes(engine.runner.model)
    print("splitserve: batch-1 decode", flush=True)
    splitserve_decode_ms(engine, decode_prompt, 8)  # warm-up
    # The bandwidth is sampled between the decode runs, so that both see the same machine
    # (on a shared host either drifts by tens of percent over a minute).
    copies, b1 = [copy_bandwidth_gbs()], []
    for _ in range(cfg.decode_repeats):
        b1.append(splitserve_decode_ms(engine, decode_prompt, cfg.decode_tokens))
        copies.append(copy_bandwidth_gbs())
    bandwidth = statistics.median(copies)
    reads = read_bandwidth_gbs()
    floor_ms = wbytes / (bandwidth * 1e9) * 1e3
    print(f"copy bandwidth {bandwidth:.1f} GB/s (samples {', '.join(f'{c:.1f}' for c in copies)}); "
          f"weights {wbytes / 1e6:.0f} MB -> floor {floor_ms:.1f} ms/token; read bandwidth {reads:.1f} GB/s",
          flush=True)
    results: dict = {"dtype": str(dtype).removeprefix("torch."), "copy_bandwidth_gbs": bandwidth,
                     "copy_bandwidth_samples_gbs": copies, "read_bandwidth_gbs": reads,
                     "weight_bytes": wbytes, "decode_floor_ms": floor_ms,
                     "decode_read_floor_ms": wbytes / (reads * 1e9) * 1e3}
    results["splitserve_decode_ms"] = statistics.median(b1)
    results["splitserve_decode_ms_runs"] = b1
    print("splitserve: offline throughput", flush=True)
    run_splitserve(engine, warm, "splitserve warm-up")
    ours = [timed(run_splitserve, engine, work)]

    if not cfg.skip_hf:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=dtype).eval()
        pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        print("transformers: batch-1 decode", flush=True)
        hf_decode_ms(model, decode_prompt, 4)  # warm-up
        hf_b1 = [hf_decode_ms(model, decode_prompt, cfg.decode_tokens) for _ in range(cfg.decode_repeats)]
        results["hf_generate_decode_ms"] = statistics.median(hf_b1)
        print(f"transformers: generate, static batches of {cfg.hf_batch_size}", flush=True)
        run_hf_static(model, warm, cfg.hf_batch_size, pad_id, "transformers warm-up")
        static = timed(run_hf_static, model, work, cfg.hf_batch_size, pad_id)
        results["hf_generate"] = {**throughput([static], work.num_output_tokens),
                                  "batch_size": cfg.hf_batch_size}
        print("transformers: continuous batching", flush=True)
        continuous = timed(run_hf_continuous, model, work, cfg.cb_padding)
        results["hf_continuous_batching"] = {**throughput([continuous], work.num_output_tokens),
                                             "padding_interval": cfg.cb_padding}
        model = None
        # Once more after the peers, so that a change in the machine's load over the run
        # shows up in splitserve's figures too (the median of the runs is reported).
        print("splitserve: offline throughput, second run", flush=True)
        ours.append(timed(run_splitserve, engine, work))
    results["splitserve"] = throughput(ours, work.num_output_tokens)
    if not cfg.skip_hf:
        best = max(results["hf_generate"]["tokens_per_s"], results["hf_continuous_batching"]["tokens_per_s"])
        results["speedup_vs_best_hf"] = results["splitserve"]["tokens_per_s"] / best

    report = {
        "config": asdict(cfg),
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": cfg.threads,
                    "torch": torch.__version__, "cpu_has_fast_bf16": cpu_has_fast_bf16()},
        "workload": {"requests": len(work.prompts), "prompt_tokens": sum(map(len, work.prompts)),
                     "output_tokens": work.num_output_tokens},
        "results": results,
    }
    print_table(report)
    Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
    Path(cfg.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {cfg.out}", flush=True)
    if not cfg.quick:
        print(f"wrote {plot(report, Path(cfg.out).with_suffix('.png'))}", flush=True)
    return report


def print_table(report: dict) -> None:
    r = report["results"]
    w = report["workload"]
    print()
    print(f"offline throughput, {w['requests']} requests ({w['prompt_tokens']} prompt / "
          f"{w['output_tokens']} output tokens), dtype {r['dtype']}, {report['machine']['threads']} threads")
    print(f"  {'system':<44} {'seconds':>8} {'tok/s':>8} {'tok/CPU-s':>10} {'load':>5} {'splitserve x':>13}")
    ours = r["splitserve"]["tokens_per_s"]
    rows = [("splitserve LLMEngine", r["splitserve"])]
    if "hf_generate" in r:
        rows.append((f"transformers generate (static, batch {r['hf_generate']['batch_size']})", r["hf_generate"]))
        rows.append(("transformers continuous batching", r["hf_continuous_batching"]))
    for name, row in rows:
        print(f"  {name:<44} {row['seconds']:>8.1f} {row['tokens_per_s']:>8.1f} {row['tokens_per_cpu_s']:>10.1f} "
              f"{row['load_average']:>5.1f} {ours / row['tokens_per_s']:>12.2f}x")
    print("batch-1 decode (prompt 128), ms/token")
    print(f"  copy-bandwidth floor:  {r['decode_floor_ms']:.1f} ms "
          f"({r['weight_bytes'] / 1e6:.0f} MB weights / {r['copy_bandwidth_gbs']:.1f} GB/s)")
    if "decode_read_floor_ms" in r:
        print(f"  read-bandwidth floor:  {r['decode_read_floor_ms']:.1f} ms "
              f"({r['read_bandwidth_gbs']:.1f} GB/s: reading only, the stricter bound)")
    print(f"  splitserve:            {r['splitserve_decode_ms']:.1f} ms "
          f"({r['splitserve_decode_ms'] / r['decode_floor_ms']:.2f}x the floor)")
    if "hf_generate_decode_ms" in r:
        print(f"  transformers generate: {r['hf_generate_decode_ms']:.1f} ms "
              f"({r['hf_generate_decode_ms'] / r['decode_floor_ms']:.2f}x the floor)")
    if "speedup_vs_best_hf" in r:
        print(f"splitserve / best transformers: {r['speedup_vs_best_hf']:.2f}x (target >= 2x); "
              f"batch-1 vs floor: {r['splitserve_decode_ms'] / r['decode_floor_ms']:.2f}x (target <= 1.5x)")


if __name__ == "__main__":
    main()
