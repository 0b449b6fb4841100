"""A watchdog over the engine thread: while one step (or one command between steps, such as
writing received KV) runs longer than a bound, the worker reports itself not ready, so routers
send new work elsewhere, and says what the step held. It is ready again once the step ends.

Runs on its own daemon thread and only reads what the engine thread publishes (a timestamp and
a description, each swapped as one reference).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)
# A step held this many times the bound is wedged: the worker stops answering liveness too, so
# an orchestrator restarts it (its streams move to other workers) instead of leaving its
# devices held by a step that will not end (a hung GPU, a collective no watchdog of NCCL's saw).
WEDGED_STEPS = 10


class StepWatchdog:
    """`busy_since()` returns when the engine thread's current unit of work started
    (time.monotonic()), or None while it is idle; `describe()` says what that work holds."""

    def __init__(self, timeout_s: float, busy_since: Callable[[], float | None],
                 describe: Callable[[], str], poll_s: float | None = None) -> None:
        if timeout_s <= 0:
            raise ValueError("a step watchdog needs timeout_s > 0")
        self.timeout_s = timeout_s
        self._busy_since = busy_since
        self._describe = describe
        # A stall is reported within a fraction of the bound, and idle polling stays cheap.
        self._poll_s = poll_s if poll_s is not None else min(timeout_s / 4, 1.0)
        self.stalled = False  # written by the watchdog thread only; read anywhere
        self.num_stalls = 0
        self._stalled_at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="step-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self._poll_s + 1.0)

    def check(self, now: float | None = None) -> bool:
        """Compare the current work's age with the bound; returns `stalled`."""
        now = time.monotonic() if now is None else now
        since = self._busy_since()
        if since is not None and now - since > self.timeout_s:
            if not self.stalled:
                self.stalled = True
                self.num_stalls += 1
                self._stalled_at = since
                log.error("engine step running for %.1fs (over --step-timeout-s %.1fs); worker "
                          "is not ready until it ends: %s", now - since, self.timeout_s,
                          self._safe_describe())
        elif self.stalled:
            self.stalled = False
            held = now - self._stalled_at if self._stalled_at is not None else 0.0
            log.warning("engine step ended after about %.1fs; worker is ready again", held)
        return self.stalled

    @property
    def wedged(self) -> bool:
        """Stalled for over WEDGED_STEPS times the bound (judged at the last check)."""
        at = self._stalled_at
        return (self.stalled and at is not None
                and time.monotonic() - at > WEDGED_STEPS * self.timeout_s)

    def _safe_describe(self) -> str:
        try:
            return self._describe()
        except Exception as exc:  # the engine thread moved on mid-read: say so, never die
            return f"(could not describe the step: {exc})"

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            self.check()


def describe_work(busy: tuple[float, str] | None, sched) -> str:
    """What an engine thread is stuck in: `busy` is its (start, "step" | "command"), `sched`
    the engine's batch in progress (LLMEngine.scheduled)."""
    if busy is None:
        return "nothing (it has just ended)"
    if busy[1] != "step" or sched is None:
        return "a command between steps (e.g. writing received KV into the cache)"
    ids = list(sched.num_scheduled_tokens)
    shown = ", ".join(rid[:40] for rid in ids[:8]) + (", ..." if len(ids) > 8 else "")
    return (f"{len(ids)} requests, {sched.total_num_scheduled_tokens} tokens "
            f"({len(sched.new_requests)} new); request ids: {shown}")
