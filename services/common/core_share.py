"""Workers on one host that split its cores lend their share to each other while idle: a
worker steps on its own threads plus those of every idle peer, and hands the borrowed ones
back before a peer's next step.

`splitserve up --mode disagg` starts a prefill and a decode worker on one machine and gives
each half of the cores. Without a share the decode worker ran every step on its half while
the other half sat idle between prompts (on 2 cores, one thread for a batch-32 step), and a
prompt that arrived while nothing decoded was prefilled on one core.

The share is a small file (`--core-share PATH`) that every worker of the host maps: one slot
per worker of (pid, own threads, active, borrowed threads). Before each step a worker marks
itself active, then runs on its own threads plus those of every idle (or dead, or stopped)
peer, and says how many it borrowed. A worker about to step first waits until the peers'
threads in use leave room for its own, that is until a borrower has seen it active at its
next step boundary and stepped on its own threads again: at most one step (a decode step:
tens of milliseconds; a prefill step of 2,048 tokens: about 0.35 s on SmolLM2 here), never
past `wait_limit_s`.

Why the wait: the threads of an OpenMP team meet at a barrier hundreds of times a step and
spin there, so three threads on two cores do not share them gracefully. A 2,048-token
prefill step that overlapped a one-thread decode took 3.5 s instead of about 0.35 s.

Prompts first: a worker that prefills (`priority=True`) asks for every core at each step
boundary, and a decoding peer willing to yield pauses at its own next boundary (one decode
step, tens of milliseconds) and stays idle while the prefill worker steps. Each prompt then
runs on every core and its first token comes sooner (a 2,048-token prompt: 590 ms on two
threads against 980 ms on one, `bench/prefill.py`). The pause is bounded by a credit that refills at
`yield_share` of the time, up to `yield_burst_s`: a decoder pauses only while its credit is
positive, and every second it spends paused (and waiting for the step it gave its core to)
is charged, so a stream of prompts slows tokens down (by default to no less than half their
rate, over time) but never stops them. A decoder without credit says so, and the prefill
worker then steps on its own threads without waiting. A paused decoder still takes new
requests (its engine loop runs queued commands at each poll of the wait): the gateway sends a
prompt to the prefill worker only once the decode worker has reserved its KV blocks, so a
reservation held until the pause ended kept the next prompts from the prefill worker that
the pause was for. A decoder that has just reserved KV for a prompt waits briefly for that
prompt's ask (EXPECT_ASK_S) instead of starting a step the prompt would wait out, and the
prefill worker lends its cores back only once its step's KV has left
(services/common/kv_handoffs.py), so the paused decoder lands it before its next step.

Best effort: the slots are plain shared memory without locks, so two workers that change
state in the same microsecond may overlap for one step. Only for workers that share cores: in
Kubernetes each pod has its own (leave it unset).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import time
from collections.abc import Callable

# pid, own threads, active (1) or idle (0), borrowed, flags (below)
_SLOT = struct.Struct("<qiiii")
_PRIORITY = 1  # a worker that prefills: its steps go first
_ASKING = 2  # ... at a step boundary, asking willing peers to pause
_WILLING = 4  # a worker that would pause for a prefill worker's step (it has credit)
MAX_WORKERS = 16
_SIZE = _SLOT.size * MAX_WORKERS
# How often a worker checks that the peers it counts are alive (a signal-0 kill each).
_LIVENESS_EVERY_S = 1.0
# Past a 2,048-token prefill step on two threads (0.35 s), with room for a slower host.
DEFAULT_WAIT_LIMIT_S = 1.0
# A waiting worker polls every 0.5 ms at first, backing off to 4 ms: each poll wakes a
# thread on a core a peer's OpenMP team is using: a decoder polling every 0.5 ms through a
# 2,048-token prefill step made that step about half as long again in one debugging run.
_POLL_S = 0.0005
_POLL_MAX_S = 0.004


def _poll_sleep(waited_s: float) -> None:
    """Sleeps until the next poll of a wait that has lasted `waited_s`: late by at most an
    eighth of the wait, or 4 ms."""
    time.sleep(min(_POLL_MAX_S, max(_POLL_S, waited_s / 8)))


# How long a prefill worker waits at a step boundary for a willing decoder to pause: past
# one decode step (tens of milliseconds; ~0.1 s for hundreds of sequences on one thread).
ASK_LIMIT_S = 0.2
# How long a decoder that has just reserved KV for a prompt waits for its prefill worker to
# ask for the cores (the reservation's answer, the gateway's Prefill call, the prefill
# worker's next step boundary: a few milliseconds). Starting a step instead, it made the
# prompt wait out that step: 84 ms of a 95 ms step at p50 beside 64 streams in `make run`.
EXPECT_ASK_S = 0.02
# Unanswered waits in a row after which a decoder stops waiting for asks until its next pause.
EXPECT_ASK_MISSES = 3
# Decode pauses for prompts at most half its time, and at most this long at once: with the
# step that is running when it gives up (<= 0.4 s), a token may be ~0.9 s late in a burst.
DEFAULT_YIELD_SHARE = 0.5
DEFAULT_YIELD_BURST_S = 0.5


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def host_cores() -> int:
    """The cores this process may run on (its affinity), at least one."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class CoreShare:
    """This worker's slot in the host's share file. Called from the engine thread only."""

    def __init__(self, path: str, own_threads: int, *, borrow: bool = True,
                 cores: int | None = None, wait_limit_s: float = DEFAULT_WAIT_LIMIT_S,
                 liveness_every_s: float = _LIVENESS_EVERY_S, priority: bool = False,
                 yield_share: float = DEFAULT_YIELD_SHARE,
                 yield_burst_s: float = DEFAULT_YIELD_BURST_S) -> None:
        if own_threads < 1:
            raise ValueError("own_threads must be >= 1")
        if not 0.0 <= yield_share <= 1.0 or yield_burst_s < 0:
            raise ValueError("yield_share must be in [0, 1] and yield_burst_s >= 0")
        self.path = path
        self.own_threads = own_threads
        self.borrow = borrow
        self.cores = max(own_threads, cores or host_cores())
        self.wait_limit_s = wait_limit_s
        self.liveness_every_s = liveness_every_s
        self.active = False
        self.borrowed = 0
        self.priority = priority
        self.yield_share = yield_share
        self.yield_burst_s = yield_burst_s
        self.waits = 0  # steps that waited for a borrower to hand cores back
        self.wait_seconds = 0.0
        self.yields = 0  # steps that paused for a prefilling peer (priority=False only)
        self.yield_seconds = 0.0
        self._asking = False
        self._unanswered = 0  # waits for an expected ask that went unanswered, in a row
        self._meanwhile: Callable[[], object] | None = None  # step_threads' hook, while it waits
        self._yield_credit = yield_burst_s
        self._credit_at = time.monotonic()
        self._dead: set[int] = set()
        self._next_liveness = 0.0
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # two workers starting at once take two slots
            try:
                if os.fstat(fd).st_size < _SIZE:
                    os.ftruncate(fd, _SIZE)
                self._map = mmap.mmap(fd, _SIZE)
                self.slot = self._claim_slot()
                self._write()  # taken before the next worker looks
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def _claim_slot(self) -> int:
        me = os.getpid()
        for slot in range(MAX_WORKERS):
            pid = _SLOT.unpack_from(self._map, slot * _SLOT.size)[0]
            if pid in (0, me) or not _alive(pid):
                return slot
        raise RuntimeError(f"core share {self.path}: all {MAX_WORKERS} slots are taken by "
                           "live workers")

    def _write(self) -> None:
        _SLOT.pack_into(self._map, self.slot * _SLOT.size, os.getpid(), self.own_threads,
                        1 if self.active else 0, self.borrowed, self._flags())

    def _flags(self) -> int:
        if self.priority:
            return _PRIORITY | (_ASKING if self._asking else 0)
        return _WILLING if self.yield_share > 0 and self._yield_credit > 0 else 0

    def _peers(self) -> list[tuple[int, int, int, int, int]]:
        """(pid, own threads, active, borrowed, flags) of every peer; a dead one reads as idle
        (its threads are free to borrow, and it uses none)."""
        now = time.monotonic()
        peers = []
        for slot in range(MAX_WORKERS):
            if slot != self.slot:
                pid, own, active, borrowed, flags = _SLOT.unpack_from(self._map,
                                                                      slot * _SLOT.size)
                if pid or own:  # pid 0 with threads: a worker that stopped, lending them all
                    peers.append((pid, own, active, borrowed, flags))
        if now >= self._next_liveness:
            self._dead = {peer[0] for peer in peers if peer[0] and not _alive(peer[0])}
            self._next_liveness = now + self.liveness_every_s
        return [(peer[0], peer[1], 0, 0, 0) if peer[0] in self._dead or not peer[0] else peer
                for peer in peers]

    def step_threads(self, meanwhile: Callable[[], object] | None = None,
                     expect_ask: bool = False) -> int:
        """Marks this worker active and returns the threads its next step runs with: its own,
        plus (borrow=True) those of every idle peer, waiting first (up to wait_limit_s) for
        peers that borrowed to hand them back. A prefill worker first asks willing peers to
        pause; a willing peer pauses while it is asked (see the module docstring).

        `meanwhile()` is called at every poll of those waits (every 0.5-4 ms): the engine
        loop runs its queued commands there (a new request's KV reservation, received KV),
        so a decoder paused for the prefill worker's steps still answers a new request
        within milliseconds instead of after the pause, and the prefill worker gets the
        prompt while it is still stepping.

        `expect_ask`: this worker has just reserved KV for a prompt, so its prefill worker
        will ask for the cores within milliseconds; a willing worker waits for that ask (up to
        EXPECT_ASK_S) rather than start a step the prompt would then wait out."""
        self._meanwhile = meanwhile
        try:
            return self._step_threads(expect_ask)
        finally:
            self._meanwhile = None

    def _step_threads(self, expect_ask: bool) -> int:
        paused_at = self._pause_for_prompts(expect_ask) if not self.priority else None
        if not self.active or self.priority:
            self.active = True
            self._asking = self.priority and self.borrow
            if self._asking:
                self.borrowed = 0  # at a boundary, it holds only its own threads
            self._write()
            if self._asking:
                self._wait_for_willing_peers()
        peers = self._peers()
        lend = sum(own for _, own, active, *_ in peers if not active) if self.borrow else 0
        want = min(self.cores, self.own_threads + lend)
        if want - self.own_threads != self.borrowed or self._asking:
            self.borrowed = want - self.own_threads
            self._asking = False
            self._write()
            if self.borrowed:  # a peer may have turned active meanwhile: it goes first
                peers = self._peers()
                if any(active for _, _, active, *_ in peers):
                    self.borrowed, want = 0, self.own_threads
                    self._write()
        in_use = sum(own + borrowed for _, own, active, borrowed, _ in peers if active)
        if in_use + want > self.cores:
            self._wait_for_room(want)
        if paused_at is not None:  # the pause, and the wait for the step it let run
            self._charge_pause(time.monotonic() - paused_at)
        return want

    def _wait_for_willing_peers(self) -> None:
        """A prefill worker at its step boundary: waits (up to ASK_LIMIT_S) until no active
        peer is willing to pause, that is until they have paused at their own boundary."""
        start = time.monotonic()
        while time.monotonic() - start < ASK_LIMIT_S and any(
                active and flags & _WILLING for _, _, active, _, flags in self._peers()):
            self._poll(time.monotonic() - start)

    def _poll(self, waited_s: float) -> None:
        """One poll of a wait: the step_threads caller's work first, then the sleep."""
        if self._meanwhile is not None:
            self._meanwhile()
        _poll_sleep(waited_s)

    def _asked_to_pause(self) -> bool:
        """A prefill peer is asking for the cores, or stepping on some it borrowed."""
        return any(active and flags & _PRIORITY and (flags & _ASKING or borrowed)
                   for _, _, active, borrowed, flags in self._peers())

    def _refill(self) -> None:
        now = time.monotonic()
        self._yield_credit = min(self.yield_burst_s,
                                 self._yield_credit + self.yield_share * (now - self._credit_at))
        self._credit_at = now

    def _pause_for_prompts(self, expect_ask: bool = False) -> float | None:
        """A worker that does not prefill, at its step boundary: idle (lending every thread)
        while a prefill peer asks for the cores or steps on them, within the credit; with
        `expect_ask`, waiting for that ask first. Returns when the pause (the wait for the
        ask included) began, None without one."""
        was_willing = self._flags() & _WILLING
        self._refill()
        if self._flags() & _WILLING != was_willing:
            self._write()  # a prefill worker waits for a willing peer, not for others
        if not self._flags() & _WILLING:
            return None
        start = time.monotonic()
        if not self._asked_to_pause() and not (expect_ask and self._await_ask(start)):
            return None
        self._unanswered = 0
        self.idle()
        deadline = start + self._yield_credit
        while time.monotonic() < deadline and self._asked_to_pause():
            self._poll(time.monotonic() - start)
        if self._meanwhile is not None:
            # What came while the last poll slept (the prefill step's KV, which its worker
            # hands over before it lends the cores back: kv_handoffs.py) joins this step.
            self._meanwhile()
        return start

    def _await_ask(self, start: float) -> bool:
        """A decoder that has just reserved KV: waits (up to EXPECT_ASK_S, within its credit)
        for the prompt's prefill worker to ask for the cores; True if it asked. Only with a
        live prefill peer on this host, and not after EXPECT_ASK_MISSES unanswered waits in a
        row (its prompts go to prefill workers elsewhere) until a pause. An unanswered wait is
        charged to the credit, as a pause is."""
        if self._unanswered >= EXPECT_ASK_MISSES or not any(
                flags & _PRIORITY for *_, flags in self._peers()):
            return False
        limit = start + min(EXPECT_ASK_S, self._yield_credit)
        while time.monotonic() < limit and not self._asked_to_pause():
            self._poll(time.monotonic() - start)
        if self._asked_to_pause():
            return True
        self._unanswered += 1
        self._refill()
        self._yield_credit -= time.monotonic() - start
        if not self._flags() & _WILLING:
            self._write()  # out of credit: the prefill worker must not wait for this one
        return False

    def _charge_pause(self, seconds: float) -> None:
        self._refill()
        self._yield_credit -= seconds
        self.yields += 1
        self.yield_seconds += seconds
        if not self._flags() & _WILLING:
            self._write()

    def _wait_for_room(self, want: int) -> None:
        start = time.monotonic()
        deadline = start + self.wait_limit_s
        while time.monotonic() < deadline:
            self._poll(time.monotonic() - start)
            in_use = sum(own + borrowed for _, own, active, borrowed, _ in self._peers()
                         if active)
            if in_use + want <= self.cores:
                break
        self.waits += 1
        self.wait_seconds += time.monotonic() - start

    def peer_active(self) -> bool:
        """Whether a live peer is stepping (on its threads, and on any it borrowed)."""
        return any(active for _, _, active, *_ in self._peers())

    def idle(self) -> None:
        """Marks this worker idle: it lends its threads until it next steps."""
        if self.active or self.borrowed:
            self.active, self.borrowed = False, 0
            self._write()

    def close(self) -> None:
        """Frees the slot for another worker; until one takes it, its threads are lent."""
        try:
            _SLOT.pack_into(self._map, self.slot * _SLOT.size, 0, self.own_threads, 0, 0, 0)
            self._map.close()
        except (ValueError, OSError):
            pass
