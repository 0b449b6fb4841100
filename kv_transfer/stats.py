"""KVStats: thread-safe transfer counters shared by a sender or receiver and its channel threads."""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class KVStatsSnapshot:
    """A consistent copy of the counters at one instant (plain data, safe to log or export)."""

    transfers: int = 0  # DATA payloads completed (sent, or received and handed to on_kv)
    bytes: int = 0  # payload bytes of those transfers
    shared_bytes: int = 0  # of those, the bytes that crossed a shared-memory region (one host)
    seconds: float = 0.0  # wall time spent moving them (sum over transfers)
    dropped: int = 0  # received in full but unwanted (is_wanted said no), then discarded
    aborts: int = 0  # ABORT frames sent or received
    failures: int = 0  # channel failures (each may fail several queued transfers)
    failed_transfers: int = 0  # transfers that did not complete because of a failure
    rejected: int = 0  # sends refused up front because the queue was full
    refused: int = 0  # senders turned away at connect (layout, backend, auth, channel limit)
    auth_failures: int = 0  # channels closed because the peer did not prove the cluster secret
    refused_frames: int = 0  # frames refused: bad header or tag, or fields the request rules out
    callback_errors: int = 0  # exceptions raised by user callbacks (logged, channel kept)
    channels_opened: int = 0
    channels_closed: int = 0

    @property
    def gbps(self) -> float:
        """Mean payload rate in GB/s (1e9 bytes) over the time spent transferring."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


_FIELDS = tuple(f.name for f in fields(KVStatsSnapshot))


class KVStats:
    """Counters updated by channel threads and read by anyone.

    One lock guards all fields so a snapshot never mixes two updates (e.g. transfers counted
    but their bytes not yet).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, float] = dict.fromkeys(_FIELDS, 0)

    def add(self, **deltas: float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                if name not in self._values:
                    raise KeyError(f"unknown stats counter {name!r}")
                self._values[name] += delta

    def snapshot(self) -> KVStatsSnapshot:
        with self._lock:
            return KVStatsSnapshot(**self._values)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"KVStats({self.snapshot()})"
