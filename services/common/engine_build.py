"""Builds a worker's engine so that the thread which steps it holds the process's only OpenMP
team (see build_engine)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from engine.llm_engine import LLMEngine


def build_engine(factory: Callable[[], LLMEngine]) -> LLMEngine:
    """`factory()` (which builds the engine: weights, memory profile step, KV pool) run on a
    thread that exits when it is done; its errors are raised here.

    GNU OpenMP (torch's) spins at a barrier before it sleeps only while the process has no
    more OpenMP threads than CPUs. Each thread that runs a parallel region keeps a team of
    its own, so an engine built on the main thread and stepped on the engine loop's thread
    leaves two teams, and on 2 cores with 2 torch threads every parallel region of every step
    then ends in a futex sleep and a wake-up instead of a spin: an aggregated worker's
    batch-32 decode step took 70 ms behind gRPC against 40 ms offline, its engine thread off
    the CPU a quarter of the time and switching out 3,500 times a second. A thread's team
    goes with the thread, so the build runs on one that ends, and the engine loop's thread is
    the only one left with a team (46 ms in the same conditions)."""
    built: list[LLMEngine] = []
    failed: list[BaseException] = []

    def build() -> None:
        try:
            built.append(factory())
        except BaseException as exc:  # re-raised on the caller's thread
            failed.append(exc)

    thread = threading.Thread(target=build, name="engine-build")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return built[0]
