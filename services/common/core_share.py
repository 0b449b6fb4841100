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

_SLOT = struct.Struct("<qiiii")  # pid, own threads, active (1) or idle (0), borrowed, unused
MAX_WORKERS = 16
_SIZE = _SLOT.size * MAX_WORKERS
# How often a worker checks that the peers it counts are alive (a signal-0 kill each).
_LIVENESS_EVERY_S = 1.0
# Past a 2,048-token prefill step on two threads (0.35 s), with room for a slower host.
DEFAULT_WAIT_LIMIT_S = 1.0
_POLL_S = 0.0005


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
                 liveness_every_s: float = _LIVENESS_EVERY_S) -> None:
        if own_threads < 1:
            raise ValueError("own_threads must be >= 1")
        self.path = path
        self.own_threads = own_threads
        self.borrow = borrow
        self.cores = max(own_threads, cores or host_cores())
        self.wait_limit_s = wait_limit_s
        self.liveness_every_s = liveness_every_s
        self.active = False
        self.borrowed = 0
        self.waits = 0  # steps that waited for a borrower to hand cores back
        self.wait_seconds = 0.0
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
                        1 if self.active else 0, self.borrowed, 0)

    def _peers(self) -> list[tuple[int, int, int, int]]:
        """(pid, own threads, active, borrowed) of every peer; a dead one reads as idle (its
        threads are free to borrow, and it uses none)."""
        now = time.monotonic()
        peers = []
        for slot in range(MAX_WORKERS):
            if slot != self.slot:
                pid, own, active, borrowed, _ = _SLOT.unpack_from(self._map, slot * _SLOT.size)
                if pid or own:  # pid 0 with threads: a worker that stopped, lending them all
                    peers.append((pid, own, active, borrowed))
        if now >= self._next_liveness:
            self._dead = {peer[0] for peer in peers if peer[0] and not _alive(peer[0])}
            self._next_liveness = now + self.liveness_every_s
        return [(pid, own, 0, 0) if pid in self._dead or not pid else (pid, own, active, borrowed)
                for pid, own, active, borrowed in peers]

    def step_threads(self) -> int:
        """Marks this worker active and returns the threads its next step runs with: its own,
        plus (borrow=True) those of every idle peer, waiting first (up to wait_limit_s) for
        peers that borrowed to hand them back."""
        if not self.active:
            self.active = True
            self._write()
        peers = self._peers()
        lend = sum(own for _, own, active, _ in peers if not active) if self.borrow else 0
        want = min(self.cores, self.own_threads + lend)
        if want - self.own_threads != self.borrowed:
            self.borrowed = want - self.own_threads
            self._write()
            if self.borrowed:  # a peer may have turned active meanwhile: it goes first
                peers = self._peers()
                if any(active for _, _, active, _ in peers):
                    self.borrowed, want = 0, self.own_threads
                    self._write()
        in_use = sum(own + borrowed for _, own, active, borrowed in peers if active)
        if in_use + want > self.cores:
            self._wait_for_room(want)
        return want

    def _wait_for_room(self, want: int) -> None:
        start = time.monotonic()
        deadline = start + self.wait_limit_s
        while time.monotonic() < deadline:
            time.sleep(_POLL_S)
            in_use = sum(own + borrowed for _, own, active, borrowed in self._peers() if active)
            if in_use + want <= self.cores:
                break
        self.waits += 1
        self.wait_seconds += time.monotonic() - start

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
