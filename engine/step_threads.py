"""How many torch threads each CPU step runs with.

A step of a few tokens (decode at a small batch) is a long chain of small kernels, each a
parallel region whose threads meet at a barrier. In a serving worker those threads share the
cores with the worker's event loop, the gateway and the clients, and a team that waits for one
descheduled thread at every barrier runs slower than fewer threads would. Measured on this
2-core machine in an aggregated worker behind the gateway (`splitserve up --mode agg`), ITL at
batch 1/4/16/32 was 10.3/13.0/32.7/61.6 ms with one thread and 15.0/17.7/33.8/50.5 ms with two;
prefill chunks and large batches gain from every thread. So steps of at most `small_tokens`
tokens run with `small_threads`, and the rest with all of them.
"""

from __future__ import annotations

import torch

DEFAULT_SMALL_STEP_TOKENS = 16


def default_small_threads(num_threads: int) -> int:
    """Half the worker's threads (one on two cores), never fewer than one."""
    return max(1, num_threads // 2)


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
        self.current = 0  # not yet set by us

    @property
    def active(self) -> bool:
        return self.small_threads != self.num_threads

    def threads_for(self, num_tokens: int) -> int:
        return self.small_threads if num_tokens <= self.small_tokens else self.num_threads

    def before_step(self, num_tokens: int) -> None:
        want = self.threads_for(num_tokens)
        if want != self.current:  # a switch costs tens of microseconds: only on a change
            torch.set_num_threads(want)
            self.current = want
