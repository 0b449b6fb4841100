"""Which reserved request a KV transfer's key names: request ids too long for the KV header
travel as a digest key (kv_transfer.transfer_key), and the decode worker maps them back.

Written on the gRPC event loop (a Generate stream reserves blocks, and ends), read on
kv_transfer receiver threads; a lock keeps the two apart.
"""

from __future__ import annotations

import threading

from kv_transfer import transfer_key


class RemoteKVKeys:
    """Transfer key -> request id, for the requests waiting for remote KV whose id does not
    travel verbatim. An entry lives as long as its Generate stream, so it cannot outgrow the
    streams this worker serves."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids: dict[str, str] = {}

    def add(self, request_id: str) -> str:
        """Expect KV for `request_id`; returns the key its transfer will carry."""
        key = transfer_key(request_id)
        if key != request_id:
            with self._lock:
                self._ids[key] = request_id
        return key

    def discard(self, request_id: str) -> None:
        key = transfer_key(request_id)
        if key != request_id:
            with self._lock:
                if self._ids.get(key) == request_id:
                    del self._ids[key]

    def request_id(self, key: str) -> str:
        """The request a transfer's key names (the key itself for ids that travel verbatim, or
        for a request nobody waits for any more: the engine then drops its KV)."""
        with self._lock:
            return self._ids.get(key, key)

    def __len__(self) -> int:
        with self._lock:
            return len(self._ids)
