"""Benchmark: the greedy pick of a CPU step, torch's argmax against max(dim).indices (what
engine/sampler.py greedy_tokens uses), on float32 logits of SmolLM2's vocabulary, side by side
in one run, after checking both pick the same tokens (ties included).

    python bench/greedy_pick.py [--rows 1,32,64] [--vocab 49152] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch


def best_ms(fn, repeats: int = 5, loops: int = 50) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(loops):
            fn()
        best = min(best, (time.perf_counter() - start) / loops)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,32,64")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    print(f"greedy pick over {args.vocab} float32 logits, {args.threads} threads, best of 5 x 50")
    print(f"{'rows':>5} {'argmax ms':>10} {'max ms':>8} {'argmax / max':>13}")
    for rows in (int(r) for r in args.rows.split(",")):
        logits = torch.randn(rows, args.vocab, generator=generator)
        ties = torch.randint(0, 4, (rows, args.vocab), generator=generator).float()
        for x in (logits, ties):
            assert torch.equal(x.argmax(dim=-1), x.max(dim=-1).indices), "the picks differ"
        old = best_ms(lambda x=logits: x.argmax(dim=-1))
        new = best_ms(lambda x=logits: x.max(dim=-1).indices)
        print(f"{rows:>5} {old:>10.3f} {new:>8.3f} {old / new:>12.2f}x", flush=True)


if __name__ == "__main__":
    main()
