"""Test harness for kv_transfer: peer processes driven over pipes, and an in-process inbox."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kv_transfer import KVHeader, KVLayout

KV_PEER = Path(__file__).resolve().parent / "kv_peer.py"
REPO_ROOT = Path(__file__).resolve().parents[2]
# Small on purpose: failure tests wait for these to expire.
TIMEOUT_S = 2.0


class PeerProcess:
    """A kv_peer.py child process. Owned by the test (or module) that spawned it."""

    def __init__(self) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
        self.process = subprocess.Popen(
            [sys.executable, str(KV_PEER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO_ROOT,
            env=env,
        )
        self._events: queue.Queue = queue.Queue()
        self._unclaimed: list[dict] = []
        threading.Thread(target=self._read, daemon=True).start()

    @property
    def pid(self) -> int:
        return self.process.pid

    def _read(self) -> None:
        for line in self.process.stdout:
            self._events.put(json.loads(line))
        self._events.put({"event": "eof"})

    def command(self, op: str, **args: object) -> None:
        self.process.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.process.stdin.flush()

    def expect(self, match: Callable[[dict], bool] | str, timeout_s: float = 30.0) -> dict:
        """The first event (in arrival order) that matches; earlier non-matching ones are kept."""
        if isinstance(match, str):
            name = match
            match = lambda event: event["event"] == name  # noqa: E731
        for i, event in enumerate(self._unclaimed):
            if match(event):
                return self._unclaimed.pop(i)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                event = self._events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"peer {self.pid}: no matching event in {timeout_s}s; got {self._unclaimed}"
                ) from None
            if match(event):
                return event
            if event["event"] == "eof":
                raise AssertionError(f"peer {self.pid} exited; events: {self._unclaimed}")
            self._unclaimed.append(event)

    def connect(self, name: str, endpoint: str, layout: KVLayout, **options: object) -> dict:
        """Open sender `name` (`options` go to KVSender); returns the "connected" event."""
        self.command(
            "connect", name=name, endpoint=endpoint, layout=layout.to_dict(), timeout_s=TIMEOUT_S,
            **options,
        )
        event = self.expect(
            lambda e: e.get("name") == name and e["event"] in ("connected", "error")
        )
        assert event["event"] == "connected", event
        return event

    def kill(self) -> None:
        """SIGKILL, like an OOM kill or a node loss: no cleanup runs in the peer."""
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                self.command("exit")
                self.process.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()


class Inbox:
    """Receiver callbacks for a test: records everything, thread-safe, with blocking waits."""

    def __init__(self, wanted: Callable[[str], bool] | None = None) -> None:
        self.cond = threading.Condition()
        self.kv: list[tuple[KVHeader, torch.Tensor]] = []
        self.aborts: list[KVHeader] = []
        self.errors: list[tuple[str, BaseException]] = []
        self.wanted = wanted

    def on_kv(self, header: KVHeader, payload: torch.Tensor) -> None:
        with self.cond:
            self.kv.append((header, payload))
            self.cond.notify_all()

    def on_abort(self, header: KVHeader) -> None:
        with self.cond:
            self.aborts.append(header)
            self.cond.notify_all()

    def on_channel_error(self, peer_id: str, exc: BaseException) -> None:
        with self.cond:
            self.errors.append((peer_id, exc))
            self.cond.notify_all()

    def is_wanted(self, key: str) -> bool:
        return self.wanted is None or self.wanted(key)

    def wait(self, done: Callable[[Inbox], bool], timeout_s: float = 30.0) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: done(self), timeout_s):
                raise AssertionError(
                    f"timed out: kv={[h.request_key for h, _ in self.kv]} "
                    f"aborts={[h.request_key for h in self.aborts]} errors={self.errors}"
                )

    def receiver_kwargs(self) -> dict:
        return {
            "on_kv": self.on_kv,
            "is_wanted": self.is_wanted,
            "on_abort": self.on_abort,
            "on_channel_error": self.on_channel_error,
        }


def wait_until(
    condition: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition"
) -> None:
    """Poll for state that has no notification of its own (e.g. a channel thread exiting)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.02)
