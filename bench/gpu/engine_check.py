"""The engine steps of bench/gpu/check.sh. `parity`: greedy tokens and logprobs against
transformers on a SmolLM2-shaped model (float32) and a ~1B Llama (Llama 3.2 1B's shape,
bfloat16, GQA 4). `engine`: on an 8B-shaped Llama (Llama 3.1 8B's shape, bfloat16), batch-1
decode against the HBM read floor with and without CUDA graphs, offline throughput at batch
32 and 256, and prefill tokens/s with its MFU at 4,096 tokens.

Every model has random weights: the device machine has no network and the working tree
travels in 64 MiB, so no real checkpoint gets there (SmolLM2's smallest GGUF is 98 MB). The
parity models are written as checkpoints that both sides load; the 8B shape's weights are
drawn in place on the GPU (engine.model_runner.load_model is replaced, nothing else), since
16 GB of safetensors would take much of the time budget to write and read back. The engine
runs as a worker does, its defaults untouched except where a row says otherwise.
--smoke runs every code path on CPU at tiny sizes under the Triton interpreter (CI's check of
this file; its times mean nothing, and CPU has no CUDA graphs).
"""

from __future__ import annotations

import gc
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.gpu.random_models import (
    SHAPES,
    hf_checkpoint,
    std_for,
    weights_drawn_in_place,
    write_config,
)
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerConfig

H200_BF16_PEAK_TFLOPS = 989.4  # dense bf16 tensor-core peak of an H100/H200 SXM (NVIDIA's sheet)
FP32_NEAR_TIE_NATS = 0.05  # tests/engine/engine_harness.py NEAR_TIE_NATS
BF16_NEAR_TIE_NATS = 0.25  # tests/engine/test_bf16_parity.py

def engine_for(folder: Path, dtype: str, device: torch.device, **overrides) -> LLMEngine:
    scheduler = overrides.pop("scheduler", SchedulerConfig())
    return LLMEngine(EngineConfig(model=str(folder), dtype=dtype, device=device.type,
                                  scheduler=scheduler, **overrides))


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count, length), generator=generator).tolist()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(*engines) -> None:
    for engine in engines:
        engine.close()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def graph_facts(engine: LLMEngine) -> dict:
    graphs = engine.runner.graphs
    if graphs is None:
        return {"cuda_graphs": False}
    return {"cuda_graphs": True, "graph_sizes": f"{graphs.sizes[0]}..{graphs.sizes[-1]}",
            "graph_replays": graphs.replays, "capture_s": round(graphs.capture_seconds, 2),
            "graph_mib": round(graphs.memory_bytes / 2**20)}


# -- parity ----------------------------------------------------------------------------------


def parity_case(name: str, dtype: torch.dtype, device: torch.device, smoke: bool) -> dict:
    """Greedy tokens of 4 prompts (16 to 200 tokens, 32 new each) from the engine (every step
    batched, decode steps through CUDA graphs) against transformers' generate."""
    shape = SHAPES["tiny" if smoke else name]
    near_tie = FP32_NEAR_TIE_NATS if dtype == torch.float32 else BF16_NEAR_TIE_NATS
    new_tokens = 6 if smoke else 32
    lengths = (5, 9) if smoke else (16, 48, 120, 200)
    with tempfile.TemporaryDirectory() as tmp:
        hf = hf_checkpoint(Path(tmp), shape, dtype, device)
        engine = engine_for(Path(tmp), str(dtype).removeprefix("torch."), device,
                            num_kv_blocks=512, attention_backend="triton",
                            cpu_attention="torch" if smoke else "auto")
        prompts = [random_prompts(1, n, shape["vocab_size"], seed=n)[0] for n in lengths]
        ours = engine.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0,
                                                       logprobs=0, ignore_eos=True))
        row = {"model": f"{name} (random weights)", "dtype": str(dtype).removeprefix("torch."),
               "sequences": len(prompts), "compared": 0, "near_ties": 0, "failures": 0,
               "max_logprob_diff": 0.0, **graph_facts(engine)}
        for prompt, result in zip(prompts, ours, strict=True):
            compare(hf, prompt, result, new_tokens, near_tie, row)
        free(engine)
        del hf
    row["ok"] = row["failures"] == 0
    return row


def compare(hf, prompt, result, new_tokens: int, near_tie: float, row: dict) -> None:
    device = next(hf.parameters()).device
    ids = torch.tensor([prompt], device=device)
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, pad_token_id=0)
    theirs = out.sequences[0, len(prompt):].tolist()
    logprobs = torch.stack([step[0] for step in out.logits]).float().log_softmax(-1)
    for i, (mine, ref) in enumerate(zip(result.token_ids, theirs, strict=False)):
        if mine != ref:
            gap = float(logprobs[i][ref] - logprobs[i][mine])
            row["near_ties" if gap < near_tie else "failures"] += 1
            return  # the rule of DESIGN.md: this sequence's comparison stops at a near-tie
        row["compared"] += 1
        diff = abs(result.logprobs[i].logprob - float(logprobs[i][mine]))
        row["max_logprob_diff"] = max(row["max_logprob_diff"], diff)


def step_parity(device: torch.device, smoke: bool, save) -> list[dict]:
    """float32 on the SmolLM2 shape (exact rule), bfloat16 on the 1B (bf16 near-tie rule);
    both float32 in --smoke (CPU bf16 would take the C++ kernels' paths, not Triton's)."""
    cases = (("smollm2-135m", torch.float32),
             ("llama-1b", torch.float32 if smoke else torch.bfloat16))
    rows = []
    for name, dtype in cases:
        try:
            rows.append(parity_case(name, dtype, device, smoke))
        except Exception as exc:  # one model failing (out of memory, say) must not hide the other
            rows.append({"model": name, "error": f"{type(exc).__name__}: {exc}"[:300], "ok": False})
        print(format_parity(rows[-1]), flush=True)
        save(rows)
    return rows


def format_parity(row: dict) -> str:
    if "error" in row:
        return f"parity {row['model']}: FAILED {row['error']}"
    return (f"parity {row['model']:<28} {row['dtype']:<9} {row['compared']:4d} tokens equal, "
            f"{row['near_ties']} near-ties, {row['failures']} failures, max |logprob diff| "
            f"{row['max_logprob_diff']:.3g}, CUDA graphs {row['cuda_graphs']}"
            + (f" ({row['graph_replays']} replays)" if row["cuda_graphs"] else ""))


def format_engine(rows: dict) -> list[str]:
    """The engine step's lines, from whatever it measured (a step cut short has fewer)."""
    lines = [f"engine on {rows.get('shape')}, {rows.get('dtype')}; {rows.get('settings')}"]
    if "error" in rows:
        lines.append(f"  FAILED {rows['error']}")
    lines += [f"  {rows[key]}" for key in ("kernels", "memory") if key in rows]
    if "engine_start_s" in rows:
        lines.append(f"  engine start {rows['engine_start_s']:.1f} s; CUDA graphs "
                     f"{rows['cuda_graphs']}" + (f" (batches {rows['graph_sizes']}, captured in "
                                                 f"{rows['capture_s']} s, "
                                                 f"{rows.get('graph_mib', '?')} MiB, "
                                                 f"{rows['graph_replays']} replays)"
                                                 if rows["cuda_graphs"] else ""))
    for key, label in (("batch1_ms", "with CUDA graphs where on"), ("batch1_eager_ms", "eager")):
        if key in rows:
            lines.append(
                f"  batch-1 decode {label}: {rows[key]:.2f} ms/token; read floor "
                f"{rows['read_floor_ms_copy']:.2f} ms by a copy's reads "
                f"({rows['copy_read_gbs']:.0f} GB/s): {rows[key] / rows['read_floor_ms_copy']:.2f}x, "
                f"{rows['read_floor_ms_sum']:.2f} ms by a sum ({rows['sum_read_gbs']:.0f} GB/s): "
                f"{rows[key] / rows['read_floor_ms_sum']:.2f}x")
    lines += [f"  offline batch {t['batch']}: {t['output_tok_s']:.0f} output tok/s "
              f"({t['seconds']:.2f} s)" for t in rows.get("throughput", [])]
    if "prefill_tok_s" in rows:
        lines.append(
            f"  prefill {rows['prefill_tokens']} tokens: {rows['prefill_tok_s']:.0f} tok/s, "
            f"{rows['prefill_tflops']:.0f} TFLOP/s = {rows['prefill_mfu']:.1%} of "
            f"{H200_BF16_PEAK_TFLOPS} (bf16 matmul measured here: {rows['matmul_tflops']:.0f})")
    return lines


def run_step(step: str, smoke: bool, save) -> int:
    """Runs parity (a row per model) or engine (one dict), handing `save` what it has measured
    as it goes; returns the exit code."""
    if smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("--smoke needs TRITON_INTERPRET=1 (the kernels run interpreted on CPU)")
            return 2
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print(f"{step}: skipped, no CUDA device")
        save({"skipped": "no CUDA device"})
        return 0
    else:
        device = torch.device("cuda")
    if step == "parity":
        rows = step_parity(device, smoke, lambda rows: save({"rows": rows}))
        return 0 if all(r.get("ok") for r in rows) else 1
    partial: dict = {}

    def keep(rows: dict) -> None:
        partial.update(rows)
        save(rows)

    try:
        rows = step_engine(device, smoke, keep)
    except Exception as exc:  # what was measured before stays, with the error beside it
        rows = {**partial, "error": f"{type(exc).__name__}: {exc}"[:500]}
        save(rows)
    for line in format_engine(rows):
        print(line, flush=True)
    return 1 if "error" in rows else 0


# -- the 8B shape: decode, throughput, prefill -------------------------------------------------


def read_bandwidth(device: torch.device, smoke: bool) -> dict:
    """Bytes read per second: by a device-to-device copy, counting its reads only (the issue's
    floor), and by a sum (a pure read)."""
    n = (1 << 20) if smoke else (4 << 30)
    src = torch.empty(n, dtype=torch.uint8, device=device).view(torch.bfloat16)
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), device, 3 if smoke else 10)
    sum_s = timed(lambda: src.sum(dtype=torch.float32), device, 3 if smoke else 10)
    return {"copy_read_gbs": n / copy_s / 1e9, "sum_read_gbs": n / sum_s / 1e9}


def matmul_tflops(device: torch.device, smoke: bool) -> float:
    n = 256 if smoke else 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    seconds = timed(lambda: a @ a, device, 3 if smoke else 20)
    return 2 * n**3 / seconds / 1e12


def timed(fn, device: torch.device, iters: int) -> float:
    """Median seconds of fn() after a warm-up call."""
    fn()
    times = []
    for _ in range(iters):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def decode_step_ms(engine: LLMEngine, batch: int, prompt_len: int, steps: int, seed: int,
                   device: torch.device) -> float:
    """Median wall time of a decode step of `batch` requests (fresh prompts, prefilled first)."""
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(batch, prompt_len, vocab, seed)):
        engine.add_request(f"d{seed}-{i}", prompt, params)
    while engine.scheduler.waiting or engine.last_step_size[1] > batch:  # until all decode
        engine.step()
    engine.step()
    times = []
    for _ in range(steps):
        sync(device)
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished():
        engine.step()
    return statistics.median(times) * 1e3


def throughput(engine: LLMEngine, batch: int, prompt_len: int, output_len: int, seed: int,
               device: torch.device) -> dict:
    vocab = engine.model_config.vocab_size
    prompts = random_prompts(batch, prompt_len, vocab, seed)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    sync(device)
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    sync(device)
    seconds = time.perf_counter() - start
    return {"batch": batch, "output_tok_s": sum(len(r.token_ids) for r in results) / seconds,
            "seconds": seconds}


def prefill(engine: LLMEngine, tokens: int, reps: int, device: torch.device) -> float:
    """Median seconds of the one step that prefills a fresh `tokens`-token prompt (a new
    random prompt each time: no prefix-cache hit)."""
    vocab = engine.model_config.vocab_size
    times = []
    for rep in range(reps + 1):
        engine.add_request(f"p{rep}", random_prompts(1, tokens, vocab, 1000 + rep)[0],
                           SamplingParams(max_tokens=1, temperature=0.0))
        sync(device)
        start = time.perf_counter()
        engine.step()
        sync(device)
        if rep:  # the first is a warm-up
            times.append(time.perf_counter() - start)
        while engine.has_unfinished():
            engine.step()
    return statistics.median(times)


def prefill_flops(shape: dict, tokens: int) -> float:
    """Matmul FLOPs of one prompt's forward: 2 x weights x tokens for the decoder layers, the
    LM head on the last token only, and causal attention (QK^T and PV, 2 T^2 H D a layer)."""
    h, d = shape["hidden_size"], shape["head_dim"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    per_layer = h * (heads + 2 * kv) * d + heads * d * h + 3 * h * shape["intermediate_size"]
    layers = shape["num_hidden_layers"]
    dense = 2 * per_layer * layers * tokens + 2 * h * shape["vocab_size"]
    return dense + 2 * tokens * tokens * heads * d * layers


def weight_read_bytes(shape: dict, dtype: torch.dtype) -> int:
    """Bytes a batch-1 decode step must read: every weight but the embedding table (one row
    of it), counted once when tied."""
    h = shape["hidden_size"]
    d, heads, kv = shape["head_dim"], shape["num_attention_heads"], shape["num_key_value_heads"]
    per_layer = h * (heads + 2 * kv) * d + heads * d * h + 3 * h * shape["intermediate_size"] + 2 * h
    params = per_layer * shape["num_hidden_layers"] + h + shape["vocab_size"] * h
    return params * dtype.itemsize


def step_engine(device: torch.device, smoke: bool, save) -> dict:
    """The 8B shape's figures; `save(rows)` after each, so a step cut by its time limit still
    leaves what it measured."""
    shape = SHAPES["tiny" if smoke else "llama-8b"]
    dtype = torch.float32 if smoke else torch.bfloat16
    rows: dict = {"shape": "tiny" if smoke else "llama-8b (Llama 3.1 8B's shape, random weights)",
                  "dtype": str(dtype).removeprefix("torch.")}
    rows.update(read_bandwidth(device, smoke))
    rows["matmul_tflops"] = matmul_tflops(device, smoke)
    floor_bytes = weight_read_bytes(shape, dtype)
    rows["read_floor_ms_copy"] = floor_bytes / (rows["copy_read_gbs"] * 1e9) * 1e3
    rows["read_floor_ms_sum"] = floor_bytes / (rows["sum_read_gbs"] * 1e9) * 1e3
    scheduler = SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=256,
                                long_prefill_token_threshold=8192)
    # What differs from a worker's defaults, and why: a 4,096-token prompt in one step (the
    # worker chunks long prompts at 512 tokens and steps at 2,048), room for batch 256 (the
    # worker's --max-num-seqs is 128); the KV pool is sized from --gpu-memory-utilization 0.9.
    rows["settings"] = ("max_num_batched_tokens 8192, long_prefill_token_threshold 8192, "
                        "max_num_seqs 256, kv_cache_memory auto")
    save(rows)
    prompt_len, steps = (16, 4) if smoke else (128, 64)
    with tempfile.TemporaryDirectory() as tmp, weights_drawn_in_place(std_for(shape)):
        start = time.perf_counter()
        engine = engine_for(write_config(Path(tmp), shape), rows["dtype"], device,
                            scheduler=scheduler, kv_cache_memory=0,
                            num_kv_blocks=256 if smoke else None,
                            attention_backend="triton" if smoke else "auto")
        rows["engine_start_s"] = time.perf_counter() - start
        rows["kernels"] = str(engine.runner.kernel_paths)
        rows["memory"] = engine.runner.memory.describe()
        rows.update(graph_facts(engine))
        save(rows)
        rows["batch1_ms"] = decode_step_ms(engine, 1, prompt_len, steps, 1, device)
        save(rows)
        graphs, engine.runner.graphs = engine.runner.graphs, None
        rows["batch1_eager_ms"] = decode_step_ms(engine, 1, prompt_len, steps, 2, device)
        engine.runner.graphs = graphs
        save(rows)
        rows["throughput"] = []
        for batch in (2, 4) if smoke else (32, 256):
            rows["throughput"].append(throughput(engine, batch, prompt_len, 8 if smoke else 128,
                                                 10 + batch, device))
            save(rows)
        tokens = 64 if smoke else 4096
        seconds = prefill(engine, tokens, 1 if smoke else 3, device)
        rows["prefill_tokens"] = tokens
        rows["prefill_tok_s"] = tokens / seconds
        rows["prefill_tflops"] = prefill_flops(shape, tokens) / seconds / 1e12
        rows["prefill_mfu"] = rows["prefill_tflops"] / H200_BF16_PEAK_TFLOPS
        rows.update(graph_facts(engine))
        save(rows)
        free(engine)
    return rows
