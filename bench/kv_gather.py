"""Benchmark: a prefill step's KV gather (the prompt's KV copied out of the paged cache for its
transfer) into buffers handed back after each transfer, as the prefill worker does, against
new memory each time, as before; in one engine, the two alternating in runs.

    python bench/kv_gather.py                      # SmolLM2, 2,048-token prompts, 3 x 2 runs of 6
    python bench/kv_gather.py --tokens 512 --runs 2 --prompts 8

Prints, per run, the gather's own time inside each step and the step's median.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--prompts", type=int, default=6, help="prompts per run")
    parser.add_argument("--runs", type=int, default=3, help="runs of each way, alternating")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, num_threads=args.threads,
                                    num_kv_blocks=max(2048, 4 * args.tokens // 16)))
    runner = engine.runner
    if runner.kv_payloads.staging is None:
        raise SystemExit("this device gathers without a buffer pool (CUDA); nothing to compare")
    gather = runner.gather_kv
    gathered_ms: list[float] = []

    def timed_gather(block_ids):
        start = time.perf_counter()
        kv = gather(block_ids)
        gathered_ms.append((time.perf_counter() - start) * 1e3)
        return kv

    runner.gather_kv = timed_gather
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    pool = runner.kv_payloads.staging
    summary: dict[str, list[float]] = {"reused": [], "new": []}
    for run in range(2 * args.runs):
        way = ("reused", "new")[run % 2]
        runner.kv_payloads.staging = pool if way == "reused" else None  # None: index_select, new memory
        gathered_ms.clear()
        steps = []
        for i in range(args.prompts):
            prompt = [rng.randrange(100, 40000) for _ in range(args.tokens)]
            engine.add_request(f"{run}-{i}", prompt, params, hold_kv=True)
            start = time.perf_counter()
            outputs = engine.step()
            steps.append((time.perf_counter() - start) * 1e3)
            while engine.has_unfinished():
                engine.step()
            kv = next(out.kv for out in outputs if out.kv is not None)
            if way == "reused":
                engine.release_kv(kv)  # what the prefill worker does once the send settles
            del kv, outputs
        # The first of a run warms what that way needs (the pool's buffer, say).
        summary[way].extend(gathered_ms[1:])
        print(f"run {run + 1} ({way}): gather " + " ".join(f"{ms:.1f}" for ms in gathered_ms)
              + f" ms; step median {statistics.median(steps[1:]):.1f} ms", flush=True)
    runner.kv_payloads.staging = pool
    reused, new = (statistics.median(summary[way]) for way in ("reused", "new"))
    print(f"\n{args.tokens}-token prompts: gather median {reused:.1f} ms into reused buffers "
          f"against {new:.1f} ms into new memory ({new / reused:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
