"""Lets another thread change the engine while the engine thread runs the model.

The engine thread owns the engine (services/common/engine_loop.py): other threads queue
commands that it runs between steps. A decode step is tens of milliseconds of model run, and a
disaggregated request's KV reservation, queued behind it, held the gateway's Prefill call for
the rest of the step: 61-78 ms at p50 for a short prompt beside 64 streams whose steps took
about 95 ms (`python -m bench.flood_fairness --anonymous --phases`).

During the model run the engine touches nothing but the runner, which keeps its own state (fed
by the scheduler's diffs, as on a tensor-parallel rank): not the scheduler, the KV block
tables, the prefix cache or the loop's streams. The engine thread therefore holds this lock
through all its work except that run (LLMEngine.forward_window), and a thread that finds the
window open may take the lock and make a change that touches only those (a KV reservation),
at once. The engine thread waits for it at the window's end, a fraction of a millisecond.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class ForwardWindow:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None  # the engine thread, while it holds it
        self.open = False  # the engine thread is in a model run, the lock released

    def hold(self) -> None:
        """The engine thread, from its start: it holds the engine from now on."""
        self._lock.acquire()
        self._thread = threading.current_thread()

    def release(self) -> None:
        """The engine thread, at its end."""
        self._thread = None
        self._lock.release()

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        """LLMEngine.forward_window: around the model run, on the engine thread (a step taken
        on any other thread, as before the loop starts, opens nothing)."""
        if threading.current_thread() is not self._thread:
            yield
            return
        self.open = True
        self._lock.release()
        try:
            yield
        finally:
            self._lock.acquire()
            self.open = False

    @contextlib.contextmanager
    def borrowed(self) -> Iterator[bool]:
        """Another thread: True (holding the engine until the block ends) if the engine thread
        is in a model run; False (holding nothing) otherwise."""
        taken = self.open and self._lock.acquire(blocking=False)
        try:
            yield bool(taken and self.open)
        finally:
            if taken:
                self._lock.release()
