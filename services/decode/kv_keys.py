"""The decode worker's remote-KV reservations, by the key their transfer carries: request ids
too long for the KV header travel as a digest key (kv_transfer.transfer_key), and every frame
is checked against the reservation it names before its KV can reach the engine.

Written on the gRPC event loop (a Generate stream reserves blocks, and ends), read on
kv_transfer receiver threads; a lock keeps the two apart.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from kv_transfer import KVHeader, transfer_key


@dataclass(frozen=True)
class Reservation:
    """What the decode worker reserved for one request: the only KV frame it accepts for it
    carries exactly this many prompt tokens in exactly this many blocks."""

    request_id: str
    num_tokens: int
    num_blocks: int


class RemoteKVKeys:
    """Transfer key -> reservation, for the requests waiting for remote KV. An entry lives as
    long as its Generate stream, so it cannot outgrow the streams this worker serves."""

    def __init__(self, vocab_size: int | None = None) -> None:
        self.vocab_size = vocab_size  # a first token outside it would crash the next step
        self._lock = threading.Lock()
        self._reserved: dict[str, Reservation] = {}

    def add(self, request_id: str, num_tokens: int, num_blocks: int) -> str:
        """Expect KV for `request_id`; returns the key its transfer will carry."""
        key = transfer_key(request_id)
        with self._lock:
            self._reserved[key] = Reservation(request_id, num_tokens, num_blocks)
        return key

    def discard(self, request_id: str) -> None:
        key = transfer_key(request_id)
        with self._lock:
            entry = self._reserved.get(key)
            if entry is not None and entry.request_id == request_id:
                del self._reserved[key]

    def request_id(self, key: str) -> str:
        """The request a transfer's key names (the key itself for a request nobody waits for
        any more: the engine then drops its KV)."""
        with self._lock:
            entry = self._reserved.get(key)
        return entry.request_id if entry is not None else key

    def check_frame(self, header: KVHeader) -> str | None:
        """Why this DATA frame cannot be the KV its key's request waits for, or None (receiver
        thread, before anything is allocated for the payload). A frame for a key nobody waits
        for passes: its payload is read and the engine drops it, as for a cancelled request."""
        vocab = self.vocab_size
        if vocab is not None and not 0 <= header.first_token < vocab:
            return f"first_token={header.first_token} is outside the vocabulary [0, {vocab})"
        with self._lock:
            entry = self._reserved.get(header.request_key)
        if entry is None:
            return None
        if header.num_tokens != entry.num_tokens:
            return (f"num_tokens={header.num_tokens}, but the request reserved KV for "
                    f"{entry.num_tokens} prompt tokens")
        if header.num_blocks != entry.num_blocks:
            return (f"num_blocks={header.num_blocks}, but {entry.num_blocks} blocks were "
                    "reserved")
        return None

    def __len__(self) -> int:
        with self._lock:
            return len(self._reserved)
