"""Benchmark: a burst's prefill with the KV pool's next pages faulted in while the engine idled
(the shipped cpu_kv_prefault_tokens) against the same engine with the prefault off, whose
steps fault each new page in as they write it (engine/kv_prefault.py).

Two engines as `make run` builds them (every setting its default but the prefault), in one
process, the bursts alternating between them so both see the same machine state. Each
repetition sends `--burst` new prompts of `--prompt-len` random tokens (a cold prefix cache)
with max_tokens 1 and times them to their first tokens; before it, the prefaulting engine runs
its idle work to the end, as the engine loop does between requests. The pool is never reused
within the run (each burst takes blocks no burst took before), so every burst of the engine
without the prefault writes fresh pages, as the first bursts after a worker starts do.

    python bench/kv_prefault.py                  # 32 prompts of 128 tokens, 5 each
    python bench/kv_prefault.py --burst 16 --prompt-len 512 --repeats 3
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

_SALT = iter(range(10**6))


def burst(engine: LLMEngine, n: int, length: int) -> tuple[float, int]:
    """Seconds for `n` new prompts to their first tokens, and the page faults meanwhile."""
    s = next(_SALT)
    for r in range(n):
        engine.add_request(f"b{s}-{r}", [100 + (i * 7 + 31 * s + 977 * r) % 20000 for i in range(length)],
                           SamplingParams(max_tokens=1, ignore_eos=True))
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    while engine.scheduler.waiting or engine.scheduler.running:
        engine.step()
    return time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults


def idle(engine: LLMEngine) -> float:
    """The engine loop's idle work, run to the end; returns its seconds."""
    start = time.perf_counter()
    while engine.prefault_kv():
        pass
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--burst", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    base = EngineConfig(model=args.model, num_threads=args.threads)
    engines = {"prefault": LLMEngine(base),
               "off": LLMEngine(replace(base, cpu_kv_prefault_tokens=0))}
    pool = engines["off"].kv.num_blocks * base.block_size
    need = (args.repeats + 1) * args.burst * args.prompt_len
    print(f"settings: every engine setting its default ({args.threads} threads, dtype "
          f"{engines['off'].runner.dtype}) but cpu_kv_prefault_tokens 0 for 'off'; bursts of "
          f"{args.burst} x {args.prompt_len}-token prompts, max_tokens 1, alternating")
    if need > pool:
        raise SystemExit(f"{need} tokens of bursts exceed the pool's {pool}: fewer repeats")
    for engine in engines.values():  # kernels warmed, a few blocks taken
        burst(engine, 2, 64)
    times: dict[str, list[float]] = {name: [] for name in engines}
    for rep in range(args.repeats):
        order = list(engines) if rep % 2 == 0 else list(reversed(engines))
        for name in order:
            idle_s = idle(engines[name])
            seconds, faults = burst(engines[name], args.burst, args.prompt_len)
            times[name].append(seconds)
            print(f"  [{rep + 1}/{args.repeats}] {name:8s} {seconds * 1e3:7.0f} ms, "
                  f"{faults} page faults (idle prefault before it {idle_s * 1e3:.0f} ms)",
                  flush=True)
    on, off = (statistics.median(times[name]) for name in ("prefault", "off"))
    print(f"median to the last first token: prefault {on * 1e3:.0f} ms, off {off * 1e3:.0f} ms "
          f"(off / prefault {off / on:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
