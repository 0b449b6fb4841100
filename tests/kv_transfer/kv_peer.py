"""A separate worker process for the kv_transfer tests: a prefill sender or a decode receiver.

Driven by JSON commands on stdin, one per line; reports JSON events on stdout, one per line.
Also imported by the tests for `make_kv`, so both processes derive the same payloads.
"""

from __future__ import annotations

import collections
import json
import sys
import threading
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for kv_transfer

import torch  # noqa: E402

from kv_transfer import KVLayout, KVReceiver, KVSender  # noqa: E402


def make_kv(layout: KVLayout, key: str, num_blocks: int, device: str = "cpu") -> torch.Tensor:
    """The payload every test process associates with `key`: random, but reproducible."""
    generator = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    kv = torch.randn(layout.payload_shape(num_blocks), generator=generator)
    return kv.to(device=device, dtype=layout.torch_dtype)


class Peer:
    """Command loop. Sender and receiver callbacks run on kv_transfer threads, hence the lock."""

    def __init__(self) -> None:
        self._out_lock = threading.Lock()
        self.senders: dict[str, KVSender] = {}
        self.receiver: KVReceiver | None = None
        self.stall = threading.Event()

    def emit(self, **event: object) -> None:
        with self._out_lock:
            sys.stdout.write(json.dumps(event) + "\n")
            sys.stdout.flush()

    def run(self) -> None:
        torch.set_num_threads(1)
        self.emit(event="started")
        for line in sys.stdin:
            command = json.loads(line)
            getattr(self, "op_" + command.pop("op"))(**command)

    # ---- sender side ----

    def op_connect(
        self, name: str, endpoint: str, layout: dict, timeout_s: float, device: str = "cpu",
        shared_memory_bytes: int | None = None,
    ) -> None:
        options = {} if shared_memory_bytes is None else {"shared_memory_bytes": shared_memory_bytes}
        sender = KVSender(endpoint, KVLayout.from_dict(layout), device, timeout_s, peer_id=name,
                          **options)
        self.senders[name] = sender
        try:
            sender.wait_ready()
        except Exception as exc:
            self.emit(event="error", name=name, type=type(exc).__name__, message=str(exc))
            return
        self.emit(event="connected", name=name, transport=sender.transport)

    def op_send(
        self, name: str, key: str, num_blocks: int, num_tokens: int, first_token: int
    ) -> None:
        sender = self.senders[name]
        kv = make_kv(sender.layout, key, num_blocks, str(sender.device))
        self._report(key, sender.send(key, first_token, num_tokens, kv))

    def op_stream(self, name: str, prefix: str, num_blocks: int, count: int) -> None:
        """Send `count` transfers back to back, keeping at most half the sender's queue in
        flight: a producer faster than the channel waits rather than overflow the queue."""
        sender = self.senders[name]
        in_flight: collections.deque = collections.deque()
        for i in range(count):
            while len(in_flight) >= max(1, sender.max_queued // 2):
                in_flight.popleft().exception()  # waits; the outcome is reported by _report
            key = f"{prefix}-{i}"
            future = sender.send(key, 0, num_blocks, make_kv(sender.layout, key, num_blocks))
            self._report(key, future)
            in_flight.append(future)

    def op_abort(self, name: str, key: str) -> None:
        self._report(key, self.senders[name].send_abort(key))

    def op_stall_payloads(self, name: str) -> None:
        """From now on this sender rings the doorbell but never sends the payload (a hung peer)."""
        channel = self.senders[name]._channel
        channel.send = lambda payload: self.stall.wait()
        self.emit(event="stalling", name=name)

    def _report(self, key: str, future) -> None:
        def done(f) -> None:
            exc = f.exception()
            if exc is None:
                self.emit(event="sent", key=key, nbytes=f.result().nbytes)
            else:
                self.emit(event="failed", key=key, type=type(exc).__name__, message=str(exc))

        future.add_done_callback(done)

    # ---- receiver side ----

    def op_serve(self, port: int, layout: dict, timeout_s: float) -> None:
        kv_layout = KVLayout.from_dict(layout)

        def on_kv(header, payload) -> None:
            expected = make_kv(kv_layout, header.request_key, header.num_blocks)
            self.emit(event="kv", key=header.request_key, ok=torch.equal(payload, expected))

        self.receiver = KVReceiver("127.0.0.1", port, kv_layout, "cpu", on_kv, timeout_s)
        self.emit(event="listening", endpoint=self.receiver.endpoint)

    def op_exit(self) -> None:
        self.stall.set()
        for sender in self.senders.values():
            sender.close(cancel_pending=True, timeout_s=1.0)
        if self.receiver is not None:
            self.receiver.close(timeout_s=1.0)
        self.emit(event="bye")
        sys.exit(0)


if __name__ == "__main__":
    Peer().run()
