"""Benchmark: the engine's decode step over rows behind shared prefixes, with the shared-prefix
decode attention (shipped) and without it (every row reads its whole context), side by side.

Two LLMEngines as `make run` builds them (shipped dtype, 2 threads), identical but for
cpu_shared_prefix_attention, take turns: each round both get the same batch of requests whose
prompts are one of --prefixes shared prefixes (cached beforehand, as a system prompt is) and
their own random tokens, and decode them together. A row's step time is the median over the
steps in which every request decodes (no prompt tokens), from the first step after every
request has its first token.

    python bench/shared_prefix_decode.py [--batch 32] [--prefixes 4] [--prefix-len 1024]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402


def decode_steps(engine: LLMEngine, prompts: list[list[int]], output_len: int, tag: str) -> list[float]:
    """Seconds of each step in which every request decoded one token."""
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    started: set[str] = set()
    times: list[float] = []
    scheduled = []
    schedule = engine.scheduler.schedule

    def keep(*args, **kwargs):  # what each step ran
        scheduled.append(schedule(*args, **kwargs))
        return scheduled[-1]

    engine.scheduler.schedule = keep
    try:
        while engine.has_unfinished():
            begin = time.perf_counter()
            outputs = engine.step()
            spent = time.perf_counter() - begin
            counts = scheduled[-1].num_scheduled_tokens
            if len(started) == len(prompts) and counts and all(n == 1 for n in counts.values()):
                times.append(spent)
            started.update(o.request_id for o in outputs if o.new_token_ids)
    finally:
        engine.scheduler.schedule = schedule
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prefixes", type=int, default=4)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--own", default="64,300", help="each prompt's own tokens, drawn in [lo,hi]")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    lo, hi = (int(n) for n in args.own.split(","))
    engines = {on: LLMEngine(EngineConfig(model=args.model, num_threads=args.threads, seed=0,
                                          cpu_shared_prefix_attention=on)) for on in (True, False)}
    shipped = engines[True]
    print(f"engine decode step, {args.threads} threads, dtype {shipped.runner.dtype}, batch "
          f"{args.batch} behind {args.prefixes} prefixes of {args.prefix_len} tokens, own tokens "
          f"{lo}-{hi}, {args.output_len} output tokens, greedy; the two engines alternate, the "
          f"order swapped each round (shared-prefix attention applies: "
          f"{shipped.runner.shared_prefixes})")
    rng = random.Random(0)
    vocab = shipped.model_config.vocab_size
    print("| round | shared prefixes once: step ms (median) | every row on its own | ratio |")
    print("|---|---|---|---|")
    ratios = []
    for round_ in range(args.rounds):
        # Fresh prefixes each round: no round finds the one before it in a prefix cache.
        prefixes = [[rng.randrange(100, vocab) for _ in range(args.prefix_len)]
                    for _ in range(args.prefixes)]
        prompts = [prefixes[i % args.prefixes] + [rng.randrange(100, vocab)
                                                  for _ in range(rng.randint(lo, hi))]
                   for i in range(args.batch)]
        medians = {}
        for on in ((True, False) if round_ % 2 == 0 else (False, True)):
            engine = engines[on]
            engine.generate([p + [rng.randrange(100, vocab)] for p in prefixes],
                            SamplingParams(max_tokens=1))  # the prefixes now cached
            medians[on] = statistics.median(decode_steps(engine, prompts, args.output_len,
                                                         f"r{round_}-{on}"))
        ratios.append(medians[True] / medians[False])
        print(f"| {round_ + 1} | {medians[True] * 1e3:.1f} | {medians[False] * 1e3:.1f} | "
              f"{ratios[-1]:.2f}x |", flush=True)
    print(f"median ratio {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
