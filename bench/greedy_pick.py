"""Benchmark: the greedy pick of a CPU step, torch's argmax against max(dim).indices (the torch
path of engine/sampler.py greedy_tokens) and the C++ greedy_argmax (its path where the kernels
are loaded) on bfloat16 logits as the model computes them, on SmolLM2's vocabulary, side by
side in one run, after checking all pick the same tokens (ties included).

    python bench/greedy_pick.py [--rows 1,32,64] [--vocab 49152] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch

from kernels import cpu_kernels


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
    kernel = cpu_kernels.load()
    print(f"greedy pick over {args.vocab} logits, {args.threads} threads, best of 5 x 50 "
          "(argmax and max on float32, as the sampler converted before; the kernel on bf16)")
    print(f"{'rows':>5} {'argmax ms':>10} {'max ms':>8} {'argmax / max':>13} {'kernel ms':>10} "
          f"{'max / kernel':>13}")
    for rows in (int(r) for r in args.rows.split(",")):
        logits = torch.randn(rows, args.vocab, generator=generator).bfloat16()
        ties = torch.randint(0, 4, (rows, args.vocab), generator=generator).bfloat16()
        for x in (logits, ties):
            picks = x.float().max(dim=-1).indices
            assert torch.equal(x.float().argmax(dim=-1), picks), "the picks differ"
            if kernel:
                assert torch.equal(torch.ops.splitserve_cpu.greedy_argmax(x), picks), "the picks differ"
        old = best_ms(lambda x=logits: x.float().argmax(dim=-1))
        new = best_ms(lambda x=logits: x.float().max(dim=-1).indices)
        line = f"{rows:>5} {old:>10.3f} {new:>8.3f} {old / new:>12.2f}x"
        if kernel:
            ours = best_ms(lambda x=logits: torch.ops.splitserve_cpu.greedy_argmax(x))
            line += f" {ours:>10.3f} {new / ours:>12.2f}x"
        print(line, flush=True)

if __name__ == "__main__":
    main()
