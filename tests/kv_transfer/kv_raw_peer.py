"""A KV sender written from the wire protocol instead of KVSender: what anyone who can reach a
decode worker's KV port can do with a TCPStore client and gloo (forge hellos, proofs, frames).

Used by the security tests and fuzzers; owned by the test thread that made it.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from kv_transfer import HEADER_WORDS, KVHeader, KVLayout
from kv_transfer.channel import (
    ARRIVALS_QUEUE,
    PEERS_COUNTER,
    SENDER_RANK,
    KVChannel,
    channel_key,
    parse_endpoint,
    timedelta,
)
from kv_transfer.header import _W_CHECKSUM, _checksum, header_to_bytes

# Word offsets of the header fields a forger changes (kv_transfer/header.py is the spec).
WORDS = {"flags": 2, "seq": 3, "num_tokens": 4, "num_blocks": 5, "first_token": 6,
         "layout_version": 7, "num_layers": 8, "num_kv_heads": 9, "head_dim": 10,
         "block_size": 11, "dtype": 12, "key_len": 13}


def forged_frame(header: KVHeader, checksum: bool = True, **words: int) -> bytes:
    """`header`'s wire bytes with some words overwritten (values wrap to int64), the checksum
    recomputed unless `checksum` is False: a frame no honest encoder would write."""
    frame = list(torch.frombuffer(bytearray(header_to_bytes(header)), dtype=torch.int64).tolist())
    for name, value in words.items():
        value &= (1 << 64) - 1
        frame[WORDS[name]] = value - (1 << 64) if value >= 1 << 63 else value
    if checksum:
        frame[_W_CHECKSUM] = _checksum(frame[:_W_CHECKSUM])
    assert len(frame) == HEADER_WORDS
    return torch.tensor(frame, dtype=torch.int64).numpy().tobytes()


class RawPeer:
    """One hand-driven sender connection: hello, verdict, optional proof, process group."""

    def __init__(self, endpoint: str, layout: KVLayout, timeout_s: float = 2.0,
                 peer_id: str | None = None) -> None:
        host, port = parse_endpoint(endpoint)
        self.layout = layout
        self.timeout_s = timeout_s
        self.peer_id = peer_id or f"raw-{os.getpid()}"
        self.store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(timeout_s))
        self.index = -1
        self.channel: KVChannel | None = None
        self.seq = 0

    def hello(self, **fields: object) -> dict:
        """Take an index, say hello (fields override the honest ones), return the verdict."""
        self.index = self.store.add(PEERS_COUNTER, 1)
        hello = {"index": self.index, "peer_id": self.peer_id, "layout": self.layout.to_dict(),
                 "backend": "gloo", "tp_rank": 0, "tp_size": 1, **fields}
        self.store.queue_push(ARRIVALS_QUEUE, json.dumps(hello))
        return json.loads(self.store.get(channel_key(self.index, "verdict")))

    def answer(self, proof: str) -> bytes:
        """Answer the receiver's challenge; returns its auth verdict (b"ok" or b"refused")."""
        self.store.set(channel_key(self.index, "auth"), proof)
        return self.store.get(channel_key(self.index, "auth_verdict"))

    def open_channel(self) -> KVChannel:
        self.channel = KVChannel(self.store, self.index, SENDER_RANK, torch.device("cpu"),
                                 self.timeout_s)
        return self.channel

    def ring(self, raw: bytes) -> None:
        """Put raw bytes on this channel's doorbell, exactly as given."""
        self.store.queue_push(channel_key(self.index, "bell"), raw)

    def ring_other(self, index: int, raw: bytes) -> None:
        """Put raw bytes on another channel's doorbell (any store client can)."""
        self.store.queue_push(channel_key(index, "bell"), raw)

    def send_kv(self, key: str, num_tokens: int, num_blocks: int, first_token: int,
                payload: torch.Tensor | None = None) -> None:
        """An honest-looking DATA frame and its payload (zeros unless given)."""
        header = KVHeader(key, num_tokens, num_blocks, first_token, self.layout, seq=self.seq)
        self.ring(header_to_bytes(header))
        self.seq += 1
        if payload is None:
            payload = torch.zeros(self.layout.payload_shape(num_blocks),
                                  dtype=self.layout.torch_dtype)
        self.channel.send(payload)

    def closed_by_receiver(self) -> bool:
        return self.store.check([channel_key(self.index, "closed")])

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
