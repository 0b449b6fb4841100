"""Benchmark: per-step time of a tensor-parallel engine and the share of it spent in collectives
(all-reduce after attention and MLP, all-gather of logits), TP=1 against TP=N, with the model size.

Run from the repo root:  .venv/bin/python bench/tp.py [--tp 1 2] [--device cpu|cuda] [--model DIR]
Without --model it builds a random Llama-shaped model (--size) once into the temp folder. On CPU
the ranks share the cores (--threads in all, split evenly), so expect little or no gain there:
the CPU run shows correctness and the communication cost; the speed-up is a GPU matter, where
each rank reads its shard of the weights from its own memory (NCCL; one GPU per rank).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(_ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from engine.config import EngineConfig, ModelConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

# Llama-shaped random models (16 heads, 8 KV heads: TP 1, 2, 4 and 8 all fit).
SIZES = {
    "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=32, vocab_size=8192),
    "medium": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                   num_attention_heads=16, num_key_value_heads=8, head_dim=64, vocab_size=32000),
    "large": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=32000),
}


def bench_model(size: str) -> Path:
    from splitserve_cli.tiny_model import build_tiny_model

    folder = Path(tempfile.gettempdir()) / f"splitserve-bench-tp-{size}"
    if not (folder / "config.json").is_file():
        print(f"building the random {size} model into {folder} (once)", flush=True)
        build_tiny_model(folder, arch="llama", seed=0, initializer_range=0.02,
                         max_position_embeddings=4096, **SIZES[size])
    return folder


def parameter_count(config: ModelConfig) -> int:
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_layers
    qkv = h * (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    per_layer = qkv + config.num_heads * config.head_dim * h + 3 * h * i + 2 * h
    embeddings = config.vocab_size * h * (1 if config.tie_word_embeddings else 2)
    return layers * per_layer + embeddings + h


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of this rank's parameters a step reads; tied embeddings count once."""
    return sum({p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}.values())


def measure(model: Path, tp: int, args) -> dict:
    threads = max(1, args.threads // tp)
    engine = LLMEngine(EngineConfig(
        model=str(model), dtype=args.dtype, device=args.device, tensor_parallel_size=tp,
        num_threads=threads, num_kv_blocks=args.batch * -(-(args.prompt_len + args.steps + 4) // 16) + 4,
        enable_prefix_caching=False,
    ))
    try:
        group = engine.runner.tp_group if tp > 1 else None
        if group is not None and engine.runner.device.type == "cuda":
            group.stats.synchronize = True  # time the collectives themselves, not their launch
        params = SamplingParams(max_tokens=args.steps + 2, temperature=0.0, ignore_eos=True)
        for i in range(args.batch):
            prompt = [(7 * i + j) % (engine.model_config.vocab_size - 100) + 100
                      for j in range(args.prompt_len)]
            engine.add_request(f"r{i}", prompt, params)
        prefill_s, _ = _timed_step(engine, group)
        _timed_step(engine, group)  # first decode step: warm-up
        steps = [_timed_step(engine, group) for _ in range(args.steps)]
        step_s = statistics.median(s for s, _ in steps)
        comm_s = statistics.median(c for _, c in steps)
        return {
            "tp": tp, "threads_per_rank": threads if engine.runner.device.type == "cpu" else None,
            "weights_per_rank_mb": weight_bytes(engine.runner.model) / 1e6,
            "prefill_step_ms": prefill_s * 1e3, "decode_step_ms": step_s * 1e3,
            "collective_ms_per_step": comm_s * 1e3,
            "collective_share": comm_s / step_s if step_s else 0.0,
            "decode_tokens_per_s": args.batch / step_s,
        }
    finally:
        engine.close()


def _timed_step(engine: LLMEngine, group) -> tuple[float, float]:
    comm_before = group.stats.seconds if group is not None else 0.0
    start = time.perf_counter()
    engine.step()  # ends by reading the sampled token ids, so the device work is done
    seconds = time.perf_counter() - start
    return seconds, (group.stats.seconds - comm_before) if group is not None else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--model", help="a model folder (default: a random --size model)")
    parser.add_argument("--size", choices=sorted(SIZES), default="medium")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="float32",
                        help="float32 by default, the shipped dtype on CPU (on GPU it is "
                             "bfloat16; the default keeps CPU and GPU figures comparable)")
    parser.add_argument("--batch", type=int, default=8, help="requests decoding together")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=16, help="decode steps measured")
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="CPU threads in all, split evenly across the ranks (at least 1 each)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    model = Path(args.model) if args.model else bench_model(args.size)
    config = ModelConfig.from_dir(model)
    itemsize = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    total = parameter_count(config)
    print(f"model {model.name}: {total / 1e6:.1f}M parameters ({total * itemsize / 1e6:.0f} MB "
          f"{args.dtype}), {config.num_layers} layers, hidden {config.hidden_size}, "
          f"{config.num_heads} heads / {config.num_kv_heads} KV heads, vocab {config.vocab_size}")
    print(f"device {args.device}; dtype {args.dtype}"
          + (" (the shipped dtype on GPU is bfloat16; pass --dtype bfloat16)"
             if args.device == "cuda" and args.dtype != "bfloat16" else "")
          + f"; batch {args.batch} x prompt {args.prompt_len}; "
          f"median of {args.steps} decode steps", flush=True)
    rows = []
    for tp in args.tp:
        rows.append(measure(model, tp, args))
        print(f"  TP={tp} done", flush=True)
    header = ("TP", "threads/rank", "weights/rank MB", "prefill step ms", "decode step ms",
              "collectives ms/step", "collective share", "decode tok/s")
    print(" | ".join(header))
    for r in rows:
        print(" | ".join([
            str(r["tp"]), str(r["threads_per_rank"] or "-"), f"{r['weights_per_rank_mb']:.0f}", f"{r['prefill_step_ms']:.1f}",
            f"{r['decode_step_ms']:.2f}", f"{r['collective_ms_per_step']:.2f}",
            f"{100 * r['collective_share']:.0f}%", f"{r['decode_tokens_per_s']:.0f}",
        ]))
    print("collective time is rank 0's: it includes waiting for the slowest rank at each "
          "all-reduce. On shared CPU cores TP mostly adds that cost; on GPUs each rank reads "
          "1/TP of the weights from its own memory.")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": str(model), "parameters": total,
                                               "args": vars(args), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
