"""Benchmark: the C++ small-M bfloat16 linear kernel against torch's bf16 mm on SmolLM2's
shapes (microseconds and GB/s of weights per call; with --layouts also the matmul from weights
packed once: "packed", torch's mm from oneDNN's blocked layout, and "amx", the AMX kernel from
its tile layout, kernels/packed_weights.py), and batch-1 decode of the engine with cpu_linear
torch and cpp against the read-bandwidth floor.

Run from the repo root:  .venv/bin/python bench/cpu_linear.py [--rows 1,2,4,8] [--skip-engine]
                         .venv/bin/python bench/cpu_linear.py --rows 1,4,8,16,64 --layouts packed,amx --skip-engine
(--packed is --layouts packed.)
Each call reads another copy of the weights, more of them than the last-level cache holds, so
the weights come from memory as in a decode step, not from cache.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(_ROOT))
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.offline.floor import read_bandwidth_gbs, weight_bytes  # noqa: E402
from bench.offline.splitserve_runner import decode_step_ms as splitserve_decode_ms  # noqa: E402
from engine.config import EngineConfig, ModelConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from kernels.linear import SMALL_M_MAX_ROWS, small_m_linear_available  # noqa: E402
from kernels.packed_weights import amx_available, pack_weight, packed_linear  # noqa: E402


def model_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(N, K) of each linear layer of a decode step, as engine/models/llama.py builds them."""
    h, d = config.hidden_size, config.head_dim
    return {
        "qkv_proj": ((config.num_heads + 2 * config.num_kv_heads) * d, h),
        "o_proj": (h, config.num_heads * d),
        "gate_up_proj": (2 * config.intermediate_size, h),
        "down_proj": (h, config.intermediate_size),
        "lm_head": (config.vocab_size, h),
    }


def time_per_call(fn, weights: list[torch.Tensor], repeats: int) -> float:
    """Seconds per call, the best of `repeats` passes over all weight copies."""
    for w in weights[:2]:
        fn(w)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for w in weights:
            fn(w)
        best = min(best, (time.perf_counter() - start) / len(weights))
    return best


def micro(shapes: dict[str, tuple[int, int]], rows: list[int], repeats: int,
          rotate_bytes: int, layouts: tuple[str, ...] = ()) -> list[dict]:
    results = []
    kernel = torch.ops.splitserve_cpu.small_m_linear
    print(f"{'layer':13s} {'M':>3s} {'N':>6s} {'K':>5s} {'torch us':>9s} {'GB/s':>6s} "
          f"{'cpp us':>9s} {'GB/s':>6s} {'speedup':>8s}"
          + "".join(f" {layout + ' us':>10s} {'GB/s':>6s} {'vs torch':>9s}" for layout in layouts),
          flush=True)
    totals: dict[int, dict[str, float]] = {}
    for name, (n, k) in shapes.items():
        nbytes = n * k * 2
        weights = [torch.randn(n, k).bfloat16() for _ in range(max(2, rotate_bytes // nbytes))]
        packs = {layout: {id(w): pack_weight(w, layout) for w in weights} for layout in layouts}
        for m in rows:
            x = torch.randn(m, k).bfloat16()
            t_torch = time_per_call(lambda w, x=x: F.linear(x, w), weights, repeats)
            t_cpp = time_per_call(lambda w, x=x: kernel(x, w), weights, repeats)
            row = {"layer": name, "m": m, "n": n, "k": k, "torch_us": t_torch * 1e6,
                   "cpp_us": t_cpp * 1e6, "torch_gbs": nbytes / t_torch / 1e9,
                   "cpp_gbs": nbytes / t_cpp / 1e9, "speedup": t_torch / t_cpp}
            line = (f"{name:13s} {m:3d} {n:6d} {k:5d} {row['torch_us']:9.1f} {row['torch_gbs']:6.1f} "
                    f"{row['cpp_us']:9.1f} {row['cpp_gbs']:6.1f} {row['speedup']:7.2f}x")
            for layout in layouts:
                t_packed = time_per_call(
                    lambda w, x=x, p=packs[layout], n=n: packed_linear(x, p[id(w)], None, n),
                    weights, repeats)
                row.update({f"{layout}_us": t_packed * 1e6, f"{layout}_gbs": nbytes / t_packed / 1e9})
                line += (f" {row[f'{layout}_us']:10.1f} {row[f'{layout}_gbs']:6.1f} "
                         f"{t_torch / t_packed:8.2f}x")
            if layouts and name != "lm_head":
                total = totals.setdefault(m, dict.fromkeys(("torch", "cpp", *layouts), 0.0))
                for path in total:
                    total[path] += row[f"{path}_us"]
            results.append(row)
            print(line, flush=True)
        del weights, packs
    for m, total in totals.items():
        print(f"one decoder layer's projections at {m} rows: torch {total['torch']:.0f} us, cpp "
              f"{total['cpp']:.0f} us" + "".join(
                  f", {layout} {total[layout]:.0f} us ({total['torch'] / total[layout]:.2f}x torch's)"
                  for layout in layouts))
    return results


def engine_decode(model: str, threads: int, tokens: int, rounds: int) -> dict:
    """Batch-1 decode ms/token with each linear path, the two engines alternating so that both
    see the same machine; the read bandwidth is sampled between rounds."""
    vocab = ModelConfig.from_dir(model).vocab_size
    prompt = [100 + (i * 7919) % (vocab - 100) for i in range(128)]
    base = EngineConfig(model=model, dtype="bfloat16", device="cpu", num_threads=threads,
                        kv_cache_memory=64 << 20, max_model_len=2048)  # 64 MiB holds 2048
    engines = {c: LLMEngine(dataclasses.replace(base, cpu_linear=c)) for c in ("torch", "cpp")}
    assert engines["cpp"].runner.small_m_linear and not engines["torch"].runner.small_m_linear
    for engine in engines.values():
        splitserve_decode_ms(engine, prompt, 8)  # warm-up
    runs: dict[str, list[float]] = {c: [] for c in engines}
    copies = [read_bandwidth_gbs()]
    for _ in range(rounds):
        for choice, engine in engines.items():
            runs[choice].append(splitserve_decode_ms(engine, prompt, tokens))
        copies.append(read_bandwidth_gbs())
    bandwidth = statistics.median(copies)
    wbytes = weight_bytes(engines["cpp"].runner.model)
    floor_ms = wbytes / (bandwidth * 1e9) * 1e3
    out = {"read_bandwidth_gbs": bandwidth, "read_bandwidth_samples_gbs": copies,
           "weight_bytes": wbytes, "floor_ms": floor_ms}
    print(f"\nbatch-1 decode in bfloat16 (the dtype the cpp linear path serves; the shipped CPU "
          f"dtype is float32), {tokens} tokens x {rounds} rounds, {threads} threads; read bandwidth "
          f"{bandwidth:.1f} GB/s ({', '.join(f'{c:.1f}' for c in copies)}), weights "
          f"{wbytes / 1e6:.0f} MB -> floor {floor_ms:.1f} ms/token")
    for choice, times in runs.items():
        ms = statistics.median(times)
        out[f"{choice}_ms"], out[f"{choice}_ms_runs"] = ms, times
        print(f"  cpu_linear={choice:5s} {ms:6.2f} ms/token ({ms / floor_ms:.2f}x the floor; "
              f"runs {', '.join(f'{t:.2f}' for t in times)})")
    print(f"  cpp vs torch: {out['torch_ms'] / out['cpp_ms']:.2f}x faster", flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(_ROOT / "models" / "smollm2-135m-instruct"))
    parser.add_argument("--rows", default="1,2,4,8", help="values of M, comma separated")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rotate-mb", type=int, default=160,
                        help="MB of weight copies per shape, cycled through: several times the L3")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--decode-rounds", type=int, default=3)
    parser.add_argument("--skip-engine", action="store_true", help="the micro-benchmark only")
    parser.add_argument("--layouts", default="",
                        help="also time the matmul from weights packed in these layouts, comma "
                             "separated: packed (oneDNN's), amx (the AMX kernel's)")
    parser.add_argument("--packed", action="store_true", help="the same as --layouts packed")
    parser.add_argument("--out", help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    if not small_m_linear_available():
        raise SystemExit("the C++ small-M linear kernel needs the C++ kernels and avx512_bf16")
    torch.set_num_threads(args.threads)
    rows = [int(m) for m in args.rows.split(",")]
    layouts = tuple(dict.fromkeys([*filter(None, args.layouts.split(",")), *(["packed"] if args.packed else [])]))
    if "amx" in layouts and not amx_available():
        raise SystemExit("the amx layout needs a CPU with AMX BF16 and the C++ kernels")
    print(f"cpu_linear: {args.threads} threads; the engine measures at start up to which M (at "
          f"most {SMALL_M_MAX_ROWS}) the kernel wins, and takes it up to there", flush=True)
    report = {"micro": micro(model_shapes(ModelConfig.from_dir(args.model)), rows, args.repeats,
                             args.rotate_mb << 20, layouts)}
    if not args.skip_engine:
        report["engine"] = engine_decode(args.model, args.threads, args.decode_tokens, args.decode_rounds)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
