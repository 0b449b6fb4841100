"""Benchmark: the C++ paged decode attention (kernels/cpu/paged_decode_attention.cpp) in
bfloat16 on SmolLM2's heads (9 query, 3 KV, head_dim 64), one decode step's batch: one layer
over and over (its K/V partly in cache), and 30 layers each with its own cache (K/V from
memory, as in a step), reported as GB/s of K/V read.

With --shared-prefix N the rows' contexts begin with one of --prefixes prefixes of N tokens
(their own tokens, drawn from --context, after it), as behind shared system prompts; the 30
layers then run both ways, taking turns: every row on its own (what the kernel reads without
being told), and each prefix attended once for its rows (shared_prefix_of / _lens).

    python bench/decode_attention.py [--batch 64] [--context 256,320] [--threads 2]
    python bench/decode_attention.py --batch 32 --context 64,512 --shared-prefix 1024 --prefixes 4
"""

from __future__ import annotations

import argparse
import gc
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
    gc.disable()  # a collection inside a timed call would cost more than some kernels
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
    finally:
        gc.enable()
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", default="256,320", help="contexts drawn uniformly in [lo,hi]")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--shared-prefix", type=int, default=0,
                        help="tokens of a shared prefix before each row's own (0: none)")
    parser.add_argument("--prefixes", type=int, default=4, help="with --shared-prefix: how many")
    args = parser.parse_args(argv)
    if args.shared_prefix:
        return shared_prefix(args)
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


def shared_prefix(args) -> None:
    """30 layers over rows behind shared prefixes, read per row and per prefix, in turns."""
    if not cpu_kernels.load():
        raise SystemExit(f"the C++ kernels did not build: {cpu_kernels.build_error()}")
    torch.set_num_threads(args.threads)
    heads, kv_heads, dim, block_size = 9, 3, 64, 16
    lo, hi = (int(n) for n in args.context.split(","))
    prefix_blocks = -(-args.shared_prefix // block_size)
    rng = random.Random(0)
    used = args.prefixes * prefix_blocks  # the prefixes' blocks first, then each row's own
    tables, lens, of = [], [], []
    for row in range(args.batch):
        p = row % args.prefixes
        own = rng.randint(lo, hi)
        blocks = -(-own // block_size)
        tables.append(list(range(p * prefix_blocks, (p + 1) * prefix_blocks))
                      + list(range(used, used + blocks)))
        lens.append(prefix_blocks * block_size + own)
        of.append(p)
        used += blocks
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    seq_lens = torch.tensor(lens)
    prefix_of = torch.tensor(of)
    prefix_lens = torch.full((args.prefixes,), prefix_blocks * block_size)
    query = torch.randn(args.batch, heads, dim).bfloat16()
    caches = [(torch.randn(used, block_size, kv_heads, dim).bfloat16(),
               torch.randn(used, block_size, kv_heads, dim).bfloat16()) for _ in range(args.layers)]
    attend = torch.ops.splitserve_cpu.paged_decode_attention
    per_row = lambda: [attend(query, k, v, block_tables, seq_lens, 0.125, 0) for k, v in caches]  # noqa: E731
    per_prefix = lambda: [attend(query, k, v, block_tables, seq_lens, 0.125, 0, prefix_of,  # noqa: E731
                                 prefix_lens) for k, v in caches]
    err = (per_row()[0].float() - per_prefix()[0].float()).abs().max().item()
    rounds = max(3, args.repeats // 2)
    times = {"per row": [], "per prefix": []}
    for _ in range(rounds):  # in turns, so the machine's drift lands on both
        times["per row"].append(_best_s(per_row, 2))
        times["per prefix"].append(_best_s(per_prefix, 2))
    row_s, prefix_s = min(times["per row"]), min(times["per prefix"])
    print(f"batch {args.batch} behind {args.prefixes} prefixes of {prefix_blocks * block_size} "
          f"tokens, own tokens {lo}-{hi}, {args.threads} threads, {args.layers} layers; "
          f"max |difference| {err:.4f}")
    print(f"  every row on its own: {row_s * 1e3:.2f} ms (best of {rounds} turns)")
    print(f"  each prefix once:     {prefix_s * 1e3:.2f} ms ({prefix_s / row_s:.2f}x)")


if __name__ == "__main__":
    main()
