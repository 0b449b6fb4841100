"""The prefill worker's KV handoff over real gloo channels: a transfer that fails after it was
queued is followed at once by an ABORT frame on a fresh channel, so the decode worker can
recompute the prompt instead of waiting out its timers."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from kv_transfer import KVChannelError, KVLayout, KVReceiver, KVSenderPool, transfer_key
from services.prefill.kv_handoff import KVHandoff

pytestmark = pytest.mark.timeout(120)

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32")


class StallingDecode:
    """Receiver callbacks of a decode worker whose channel thread stops reading payloads
    (as if stuck) until an ABORT arrives on another channel."""

    def __init__(self) -> None:
        self.aborted = threading.Event()
        self.abort_keys: list[str] = []
        self.kv_keys: list[str] = []

    def is_wanted(self, key: str) -> bool:
        self.aborted.wait(60)  # the payload stays unread, so the sender's wait times out
        return True

    def on_abort(self, header) -> None:
        self.abort_keys.append(header.request_key)
        self.aborted.set()

    def on_kv(self, header, payload) -> None:
        self.kv_keys.append(header.request_key)


def test_a_failed_transfer_is_followed_by_an_abort_on_a_fresh_channel():
    decode = StallingDecode()
    receiver = KVReceiver("127.0.0.1", 0, LAYOUT, "cpu", on_kv=decode.on_kv, timeout_s=60.0,
                          is_wanted=decode.is_wanted, on_abort=decode.on_abort)
    # The sender gives up on an unread payload after 1 s; the receiver would wait 60 s.
    pool = KVSenderPool(LAYOUT, "cpu", timeout_s=1.0, peer_id="prefill")
    rid = "handoff-" + "h" * 150
    kv = torch.randn(LAYOUT.payload_shape(64))  # 2 MiB: more than the sockets buffer

    async def run() -> BaseException | None:
        handoff = KVHandoff(pool)
        outcome: list[BaseException | None] = []
        future = handoff.send(receiver.endpoint, rid, 7, 64 * 16, kv, on_done=outcome.append)
        with pytest.raises(KVChannelError):
            await asyncio.wrap_future(future)
        # The abort is sent from the event loop; the decode side learns of it at once.
        assert await asyncio.to_thread(decode.aborted.wait, 30), "no abort reached decode"
        assert handoff.num_failed == 1
        return outcome[0]

    try:
        error = asyncio.run(run())
        assert isinstance(error, KVChannelError)
        assert decode.abort_keys == [transfer_key(rid)]
        assert decode.kv_keys == []  # the stalled payload was never handed over as KV
        assert len(pool.endpoints()) == 1  # the fresh channel replaced the failed one
    finally:
        decode.aborted.set()
        pool.close(cancel_pending=True)
        receiver.close(timeout_s=2.0)
