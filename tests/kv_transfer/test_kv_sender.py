"""KVSender / KVSenderPool: refusal, validation, backpressure, dead receivers and reconnection."""

from __future__ import annotations

import socket

import pytest
import torch
from kv_harness import TIMEOUT_S, Inbox, wait_until
from kv_peer import make_kv

from kv_transfer import (
    HeaderError,
    KVChannelError,
    KVLayout,
    KVQueueFullError,
    KVReceiver,
    KVSender,
    KVSenderPool,
    LayoutMismatchError,
)

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype="float32")


@pytest.fixture
def inbox() -> Inbox:
    return Inbox()


@pytest.fixture
def receiver(inbox: Inbox):
    with KVReceiver(
        "127.0.0.1", 0, LAYOUT, "cpu", timeout_s=TIMEOUT_S, **inbox.receiver_kwargs()
    ) as r:
        yield r


def unused_endpoint() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def test_layout_mismatch_is_refused_with_every_differing_field_named(receiver, inbox):
    theirs = KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, block_size=4, dtype="bfloat16")
    sender = KVSender(receiver.endpoint, theirs, "cpu", TIMEOUT_S, peer_id="wrong-model")
    with pytest.raises(LayoutMismatchError) as refused:
        sender.wait_ready()
    message = str(refused.value)
    assert "num_layers (decode=2, prefill=3)" in message
    assert "dtype (decode='float32', prefill='bfloat16')" in message
    assert "head_dim" not in message  # only the fields that differ

    with pytest.raises(LayoutMismatchError):  # the sender stays refused
        sender.send("r", 0, 1, make_kv(theirs, "r", 1))
    assert receiver.stats.snapshot().refused == 1
    assert receiver.peers() == []
    assert inbox.errors == []  # no channel existed, so no transfer can have been lost
    sender.close()


def test_send_validates_the_payload_before_queueing_it(receiver, inbox):
    with KVSender(receiver.endpoint, LAYOUT, "cpu", TIMEOUT_S) as sender:
        good = make_kv(LAYOUT, "ok", 2)
        with pytest.raises(ValueError, match="does not match layout"):
            sender.send("shape", 0, 1, torch.zeros(2, 2, 2, 4, 2, 8))
        with pytest.raises(ValueError, match="6 dims"):
            sender.send("dims", 0, 1, torch.zeros(16))
        with pytest.raises(ValueError, match="dtype"):
            sender.send("dtype", 0, 1, good.to(torch.float16))
        with pytest.raises(ValueError, match="contiguous"):
            sender.send("strided", 0, 1, good.transpose(3, 4).contiguous().transpose(3, 4))
        with pytest.raises(HeaderError, match="at most 64"):
            sender.send("k" * 65, 0, 1, good)
        with pytest.raises(ValueError, match="does not fit"):
            sender.send("tokens", 0, 9, good)  # 2 blocks of 4 hold at most 8 tokens

        sender.send("ok", 0, 8, good).result(10)
    inbox.wait(lambda box: len(box.kv) == 1)
    header, payload = inbox.kv[0]
    assert header.request_key == "ok" and header.seq == 0  # no frame was used by a refused send
    assert torch.equal(payload, good)


def test_full_queue_rejects_at_once_instead_of_blocking_the_caller():
    # Nothing listens there, so the sender keeps trying to connect and nothing drains.
    sender = KVSender(unused_endpoint(), LAYOUT, "cpu", TIMEOUT_S, max_queued=2)
    kv = make_kv(LAYOUT, "q", 1)
    queued = [sender.send(f"q{i}", 0, 1, kv) for i in range(2)]
    with pytest.raises(KVQueueFullError):
        sender.send("q2", 0, 1, kv)
    assert sender.stats.snapshot().rejected == 1
    sender.close(cancel_pending=True, timeout_s=0)
    assert all(f.cancelled() for f in queued)
    with pytest.raises(KVChannelError, match="closed"):
        sender.send("late", 0, 1, kv)


def test_pool_fails_only_the_dead_receivers_transfers_and_reconnects_after_restart(
    spawn_peer, receiver, inbox
):
    decode = spawn_peer()
    decode.command("serve", port=0, layout=LAYOUT.to_dict(), timeout_s=TIMEOUT_S)
    endpoint = decode.expect("listening")["endpoint"]
    port = int(endpoint.rsplit(":", 1)[1])

    with KVSenderPool(LAYOUT, "cpu", TIMEOUT_S, peer_id="prefill") as pool:
        pool.send(endpoint, "before", 0, 4, make_kv(LAYOUT, "before", 1)).result(10)
        assert decode.expect(lambda e: e.get("key") == "before")["ok"]
        first = pool.sender(endpoint)

        decode.kill()
        # The idle sender learns of the death by itself (its heartbeat fails)...
        wait_until(lambda: first.error is not None, TIMEOUT_S * 4, "the sender to notice")
        # ...and transfers to that endpoint fail while it is down.
        with pytest.raises(KVChannelError):
            pool.send(endpoint, "during", 0, 4, make_kv(LAYOUT, "during", 1)).result(TIMEOUT_S * 4)

        # Other channels are unaffected.
        pool.send(receiver.endpoint, "other", 0, 4, make_kv(LAYOUT, "other", 1)).result(10)
        inbox.wait(lambda box: [h.request_key for h, _ in box.kv] == ["other"])

        restarted = spawn_peer()
        restarted.command("serve", port=port, layout=LAYOUT.to_dict(), timeout_s=TIMEOUT_S)
        restarted.expect("listening")
        pool.send(endpoint, "after", 0, 4, make_kv(LAYOUT, "after", 1)).result(10)
        assert restarted.expect(lambda e: e.get("key") == "after")["ok"]
        assert pool.sender(endpoint) is not first
        assert pool.stats.snapshot().transfers == 3
