"""Engine-thread cost of the worker's per-request metrics: one decode step's outputs (one
token per request) through RequestTimings, with our families only and with the vLLM-named ones
too, against the same loop with no families (the bookkeeping alone), in one run.

    .venv/bin/python bench/request_metrics_overhead.py [--batch 128] [--steps 2000]
"""

from __future__ import annotations

import argparse
import time

from engine.outputs import RequestOutput
from services.common.metrics import WorkerMetrics
from services.common.request_timing import RequestTimings


def per_step_seconds(timings: RequestTimings, batch: int, steps: int) -> float:
    live = {f"r{i}": None for i in range(batch)}
    for rid in live:
        timings.opened(rid, time.monotonic())
    outputs = [RequestOutput(rid, [5], False, num_prompt_tokens=10) for rid in live]
    timings.outputs(outputs, live)  # first tokens: later steps are the inter-token path
    start = time.perf_counter()
    for _ in range(steps):
        timings.outputs(outputs, live)
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    base = per_step_seconds(RequestTimings([]), args.batch, args.steps)
    print(f"batch {args.batch}: no families {base * 1e3:.3f} ms per step")
    for vllm in (False, True):
        timings = WorkerMetrics("decode", "w", model="m", vllm_metrics=vllm).requests
        seconds = per_step_seconds(timings, args.batch, args.steps)
        print(f"batch {args.batch}: {'ours + vLLM-named' if vllm else 'ours only':18s} "
              f"{seconds * 1e3:.3f} ms per step ({seconds / args.batch * 1e6:.2f} us per "
              f"request, {seconds / base:.1f}x the bookkeeping alone)")


if __name__ == "__main__":
    main()
