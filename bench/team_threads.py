"""Benchmark: a GEMM on a thread whose team was sized by engine/step_threads.set_team_threads
(the engine thread under a core share: torch's process-wide count stays at one) against the
same thread sized by torch.set_num_threads, and against one thread, side by side in one run.

    python bench/team_threads.py [--size 2048] [--threads 2] [--repeats 5]

"OpenMP only" sizes the team without MKL's per-thread count: what set_team_threads did before
it set MKL's too (float32 GEMMs run in MKL, which reads its own count).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine import step_threads  # noqa: E402


def best_ms(dtype: torch.dtype, size: int, repeats: int) -> float:
    x, y = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    x @ y
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x @ y
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def on_fresh_thread(setup, dtype: torch.dtype, size: int, repeats: int) -> float:
    result: list[float] = []

    def run() -> None:
        if step_threads._mkl() is not None:
            step_threads._mkl()(0)  # MKL's own count for this thread: none (a reused thread keeps it)
        setup()
        result.append(best_ms(dtype, size, repeats))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    torch.set_num_threads(1)  # the process-wide count a worker keeps under a core share
    return result[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    n = args.threads
    torch.set_num_threads(1)

    def openmp_only() -> None:
        with mock.patch.object(step_threads, "_mkl", lambda: None):
            step_threads.set_team_threads(n)

    setups = {
        f"set_team_threads({n})": lambda: step_threads.set_team_threads(n),
        f"OpenMP only ({n})": openmp_only,
        f"torch.set_num_threads({n})": lambda: torch.set_num_threads(n),
        "one thread": lambda: step_threads.set_team_threads(1),
    }
    print(f"{args.size}x{args.size} GEMM, best of {args.repeats}, on a fresh thread each; "
          "torch's process-wide count 1")
    print("| dtype | " + " | ".join(setups) + " | set_team_threads / torch.set_num_threads |")
    print("|---" * (len(setups) + 2) + "|")
    for dtype in (torch.float32, torch.bfloat16):
        ms = {name: on_fresh_thread(setup, dtype, args.size, args.repeats)
              for name, setup in setups.items()}
        ratio = ms[f"set_team_threads({n})"] / ms[f"torch.set_num_threads({n})"]
        print(f"| {str(dtype).removeprefix('torch.')} | "
              + " | ".join(f"{v:.1f} ms" for v in ms.values()) + f" | {ratio:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
