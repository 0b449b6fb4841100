"""How many torch threads each CPU step runs with, when asked to differ by step size.

A step of a few tokens (decode at a small batch) is a long chain of small kernels, each a
parallel region whose threads meet at a barrier. With `--small-step-threads N`, steps of at
most `small_tokens` tokens run with N threads and the rest with all of them.

It was the default (half the threads) while every barrier of a serving worker ended in a sleep
and a wake-up: the worker had two OpenMP teams, and GNU OpenMP stops spinning once a process
has more OpenMP threads than CPUs (services/common/engine_build.build_engine). Then one thread
won at small batches (ITL 10.3 against 15.0 ms at batch 1 behind the gateway). With one team,
two threads win at every batch: aggregated, through HTTP, batch 1/4/16 took 10.3-12.2 /
14.6-16.9 / 26.0 ms with two against 12.4-15.2 / 16.2-17.3 / 32.4-38.8 ms with one
(`bench/serving_overhead.py`, alternating runs). So the default is now every thread for every
step; the split stays for hosts where the cores are shared with other work.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

DEFAULT_SMALL_STEP_TOKENS = 16


def _loaded(prefixes: tuple[str, ...], symbol: str):
    """`symbol` (taking one int) of the first loaded library whose file name starts with one
    of `prefixes` and exports it, or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/lib" in line}
    except OSError:
        return None
    for path in sorted(paths):
        if os.path.basename(path).startswith(prefixes):
            try:
                function = getattr(ctypes.CDLL(path), symbol)  # loaded: the same instance
            except (OSError, AttributeError):
                continue
            function.argtypes = [ctypes.c_int]
            return function
    return None


@functools.cache
def _openmp():
    """omp_set_num_threads of the OpenMP runtime torch loaded (GNU, LLVM's or Intel's)."""
    return _loaded(("libgomp", "libiomp5", "libomp."), "omp_set_num_threads")


@functools.cache
def _mkl():
    """MKL's per-thread count (its C entry point), where torch links MKL: MKL's BLAS (float32
    GEMMs) reads its own count, not OpenMP's, and stayed on one thread in a team of two."""
    return _loaded(("libtorch_cpu",), "MKL_Set_Num_Threads_Local")


def set_team_threads(num_threads: int) -> None:
    """The calling thread's OpenMP team size from now on, leaving torch's process-wide count
    alone. torch.set_num_threads also sets the count every other thread adopts at its first
    parallel op: once the engine thread had raised it, a decode worker's KV receiver thread
    copying a payload started a second team, the process had more OpenMP threads than CPUs,
    GNU OpenMP stopped spinning at barriers, and every decode step of a burst took 134 ms
    where it takes 35 (the one-team rule of services/common/engine_build.py)."""
    openmp = _openmp()
    if openmp is None:
        torch.set_num_threads(num_threads)
        return
    # torch sets a thread's count from the process-wide one at its first parallel op (each
    # library that inlines at::parallel_for, our kernels too, on its own first op): done now
    # for torch's, and set again before every step, so that a later first op cannot undo it.
    torch.get_num_threads()
    openmp(num_threads)
    mkl = _mkl()
    if mkl is not None:
        mkl(num_threads)


def default_small_threads(num_threads: int) -> int:
    """All the worker's threads: no split unless --small-step-threads asks for one."""
    return max(1, num_threads)


class StepThreads:
    """Sets torch's intra-op threads before each step; a no-op when both counts are equal.
    Only the thread that runs the steps calls it (OpenMP's thread count is per calling thread)."""

    def __init__(self, num_threads: int, small_threads: int,
                 small_tokens: int = DEFAULT_SMALL_STEP_TOKENS) -> None:
        if num_threads < 1 or small_threads < 1:
            raise ValueError("thread counts must be >= 1")
        self.num_threads = num_threads
        self.small_threads = min(small_threads, num_threads)
        self.small_tokens = small_tokens

    @property
    def active(self) -> bool:
        return self.small_threads != self.num_threads

    def threads_for(self, num_tokens: int) -> int:
        if num_tokens <= self.small_tokens:
            return min(self.small_threads, self.num_threads)
        return self.num_threads

    def set_num_threads(self, num_threads: int) -> None:
        """Threads for large steps from now on (a core share lends or takes back cores); small
        steps keep their count, at most this many."""
        self.num_threads = max(1, num_threads)

    def before_step(self, num_tokens: int) -> None:
        # Every step, a microsecond or two: a library's first parallel op resets the count.
        set_team_threads(self.threads_for(num_tokens))
