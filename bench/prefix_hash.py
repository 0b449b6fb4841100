"""Benchmark: the prefix-cache block hash (BLAKE2b chain, engine/block_pool.py) of one prompt,
against the Python `hash()` of (parent, tokens) tuples it replaced, timed in the same run. Both
run per request on the engine thread and again in the gateway for routing.

    python bench/prefix_hash.py                       # 4096 tokens, block size 16
    python bench/prefix_hash.py --tokens 1024,32768 --block-size 32
"""

from __future__ import annotations

import argparse
import random
import time

from engine.block_pool import hash_prompt_blocks


def _tuple_hash_blocks(token_ids: list[int], block_size: int) -> list[int]:
    """The scheme before: fast, but not collision resistant (parents equal mod 2^61-1 collide)."""
    hashes: list[int] = []
    parent = 0x5EED
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        hashes.append(parent)
    return hashes


def _best_us(fn, repeats: int, number: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - start) / number)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="4096", help="prompt lengths, comma-separated")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7, help="best of this many rounds")
    parser.add_argument("--number", type=int, default=100, help="calls per round")
    args = parser.parse_args()
    rng = random.Random(0)
    print(f"block size {args.block_size}, best of {args.repeats} rounds of {args.number} calls")
    print(f"{'tokens':>8} {'blocks':>7} {'blake2b us':>11} {'tuple hash() us':>16} {'ratio':>6}")
    for n in (int(t) for t in args.tokens.split(",")):
        prompt = [rng.randrange(49152) for _ in range(n)]
        new = _best_us(lambda p=prompt: hash_prompt_blocks(p, args.block_size, "tenant:a"),
                       args.repeats, args.number)
        old = _best_us(lambda p=prompt: _tuple_hash_blocks(p, args.block_size),
                       args.repeats, args.number)
        print(f"{n:>8} {n // args.block_size:>7} {new:>11.1f} {old:>16.1f} {new / old:>6.2f}")


if __name__ == "__main__":
    main()
