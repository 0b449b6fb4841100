"""Benchmark: the C++ paged decode attention (kernels/cpu/paged_decode_attention.cpp) in
bfloat16 on SmolLM2's heads (9 query, 3 KV, head_dim 64), one decode step's batch: one layer
over and over (its K/V partly in cache), and 30 layers each with its own cache (K/V from
memory, as in a step), reported as GB/s of K/V read.

    python bench/decode_attention.py [--batch 64] [--context 256,320] [--threads 2]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kernels import cpu_kernels  # noqa: E402


def _best_s(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", default="256,320", help="contexts drawn uniformly in [lo,hi]")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    if not cpu_kernels.load():
        raise SystemExit(f"the C++ kernels did not build: {cpu_kernels.build_error()}")
    torch.set_num_threads(args.threads)
    heads, kv_heads, dim, block_size = 9, 3, 64, 16
    lo, hi = (int(n) for n in args.context.split(","))
    rng = random.Random(0)
    lens = [rng.randint(lo, hi) for _ in range(args.batch)]
    width = max(-(-n // block_size) for n in lens)
    tables, used = [], 0
    for n in lens:  # each sequence's blocks in a row, as a fresh pool hands them out
        blocks = -(-n // block_size)
        tables.append(list(range(used, used + blocks)) + [0] * (width - blocks))
        used += blocks
    block_tables, seq_lens = torch.tensor(tables), torch.tensor(lens)
    query = torch.randn(args.batch, heads, dim).bfloat16()
    caches = [(torch.randn(used, block_size, kv_heads, dim).bfloat16(),
               torch.randn(used, block_size, kv_heads, dim).bfloat16()) for _ in range(args.layers)]
    attend = torch.ops.splitserve_cpu.paged_decode_attention
    kv_bytes = sum(lens) * kv_heads * dim * 2 * 2
    one = _best_s(lambda: attend(query, *caches[0], block_tables, seq_lens, 0.125, 0), args.repeats)
    every = _best_s(lambda: [attend(query, k, v, block_tables, seq_lens, 0.125, 0) for k, v in caches],
                    max(3, args.repeats // 3))
    print(f"batch {args.batch}, contexts {lo}-{hi} (mean {sum(lens) / len(lens):.0f}), "
          f"{args.threads} threads, K/V {kv_bytes / 1e6:.1f} MB a layer")
    print(f"  one layer repeated: {one * 1e3:.3f} ms ({kv_bytes / one / 1e9:.1f} GB/s)")
    print(f"  {args.layers} layers, each its own cache: {every * 1e3:.2f} ms "
          f"({args.layers * kv_bytes / every / 1e9:.1f} GB/s)")


if __name__ == "__main__":
    main()
