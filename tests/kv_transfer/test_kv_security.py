"""The KV receiver against peers that do not follow the protocol: without the cluster secret no
channel is built, a forged or injected frame never reaches the callbacks, every DATA frame is
checked before anything is allocated for it, and the receiver keeps serving honest senders.
Real TCPStore and gloo; senders run in this process (KVSender or a hand-driven RawPeer)."""

from __future__ import annotations

import pytest
import torch
from kv_harness import Inbox, wait_until
from kv_raw_peer import RawPeer, forged_frame

from kv_transfer import (
    KVAuthError,
    KVChannelError,
    KVHeader,
    KVLayout,
    KVReceiver,
    KVSender,
    KVSenderLimitError,
    KVSenderPool,
)
from kv_transfer.auth import new_nonce

pytestmark = pytest.mark.timeout(60)

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
SECRET = b"0123456789abcdef-cluster-secret"
# Generous: nothing here waits for a timeout to pass, and a loaded CI machine can stall a
# heartbeat for seconds.
TIMEOUT_S = 10.0
MAX_BLOCKS = 8


def open_receiver(inbox: Inbox, timeout_s: float = TIMEOUT_S, **kw) -> KVReceiver:
    return KVReceiver("127.0.0.1", 0, LAYOUT, "cpu", timeout_s=timeout_s,
                      max_blocks=MAX_BLOCKS, **inbox.receiver_kwargs(), **kw)


def send_ok(sender: KVSender, key: str, inbox: Inbox, num_blocks: int = 2) -> None:
    kv = torch.randn(LAYOUT.payload_shape(num_blocks))
    sender.send(key, 5, num_blocks * LAYOUT.block_size, kv).result(timeout=10)
    inbox.wait(lambda box: any(h.request_key == key for h, _ in box.kv))
    header, payload = next((h, p) for h, p in inbox.kv if h.request_key == key)
    assert torch.equal(payload, kv)


def test_a_sender_without_the_secret_is_refused_before_any_tensor_moves():
    inbox = Inbox()
    with open_receiver(inbox, secret=SECRET) as receiver:
        sender = KVSender(receiver.endpoint, LAYOUT, timeout_s=TIMEOUT_S, peer_id="nosecret")
        with pytest.raises(KVChannelError, match="requires the cluster secret"):
            sender.wait_ready()
        stats = receiver.stats.snapshot()
        assert stats.auth_failures == 1 and stats.channels_opened == 0
        # The honest sender with the secret still gets through.
        with KVSender(receiver.endpoint, LAYOUT, timeout_s=TIMEOUT_S, secret=SECRET) as good:
            send_ok(good, "after-refusal", inbox)
        assert receiver.stats.snapshot().channels_opened == 1


def test_a_wrong_secret_fails_on_both_ends():
    inbox = Inbox()
    with open_receiver(inbox, secret=SECRET) as receiver:
        sender = KVSender(receiver.endpoint, LAYOUT, timeout_s=TIMEOUT_S,
                          secret=b"another-secret-of-16-bytes")
        with pytest.raises(KVAuthError, match="did not prove the cluster secret"):
            sender.wait_ready()
        wait_until(lambda: receiver.stats.snapshot().auth_failures == 1, what="auth failure")
        wait_until(lambda: receiver.peers() == [], what="refused channel forgotten")
        assert receiver.stats.snapshot().channels_opened == 0


def test_a_forged_proof_is_refused_and_no_process_group_is_built():
    inbox = Inbox()
    with open_receiver(inbox, secret=SECRET) as receiver:
        raw = RawPeer(receiver.endpoint, LAYOUT, TIMEOUT_S)
        verdict = raw.hello(nonce=new_nonce())
        assert verdict["ok"] and "proof" in verdict  # the receiver proved itself first
        assert raw.answer("00" * 32) == b"refused"
        wait_until(raw.closed_by_receiver, what="channel closed")
        stats = receiver.stats.snapshot()
        assert stats.auth_failures == 1 and stats.channels_opened == 0


def test_a_sender_with_the_secret_refuses_a_receiver_without_it():
    inbox = Inbox()
    # Short: the receiver's half-built channel waits this long for a group that never forms.
    # Not shorter: it also bounds the receiver's store connects, which a loaded machine slows
    # (a clean-clone CI run timed out connecting to its own store after 3 s).
    with open_receiver(inbox, timeout_s=6.0) as receiver:
        sender = KVSender(receiver.endpoint, LAYOUT, timeout_s=TIMEOUT_S, secret=SECRET)
        with pytest.raises(KVAuthError, match="did not prove"):
            sender.wait_ready()


def test_a_hello_the_receiver_fails_to_admit_is_answered_not_left_waiting(monkeypatch):
    """Fault injected: the channel's store client cannot be made (what a connect timeout on a
    loaded machine does). The sender gets the reason at once, not its verdict timeout."""
    inbox = Inbox()
    with open_receiver(inbox) as receiver:
        def no_clone():
            raise RuntimeError("injected: store connect timed out")
        monkeypatch.setattr(receiver, "_clone_store", no_clone)
        sender = KVSender(receiver.endpoint, LAYOUT, timeout_s=TIMEOUT_S)
        with pytest.raises(KVChannelError, match="could not open the channel: injected"):
            sender.wait_ready(timeout_s=TIMEOUT_S / 2)
        monkeypatch.undo()
        with KVSender(receiver.endpoint, LAYOUT, timeout_s=TIMEOUT_S) as good:
            send_ok(good, "after-failure", inbox)


def test_a_frame_injected_by_another_store_client_is_dropped_and_the_channel_survives():
    inbox = Inbox()
    with open_receiver(inbox, secret=SECRET) as receiver, \
            KVSender(receiver.endpoint, LAYOUT, timeout_s=TIMEOUT_S, secret=SECRET) as sender:
        send_ok(sender, "before", inbox)
        # An attacker with its own (unauthenticated) store connection rings the honest
        # channel's doorbell with a well-formed header for the next sequence number.
        attacker = RawPeer(receiver.endpoint, LAYOUT, TIMEOUT_S)
        forged = forged_frame(KVHeader("before", 4, 1, 3, LAYOUT, seq=1))
        attacker.ring_other(sender._index, forged)
        wait_until(lambda: receiver.stats.snapshot().refused_frames == 1, what="refusal")
        send_ok(sender, "after", inbox)
        assert [h.request_key for h, _ in inbox.kv] == ["before", "after"]
        assert receiver.stats.snapshot().failures == 0


def test_a_frame_the_caller_refuses_fails_its_request_only_and_is_drained():
    refused: list[tuple[str, str]] = []
    inbox = Inbox()
    with open_receiver(
        inbox,
        check_frame=lambda h: "wrong first token" if h.first_token >= 100 else None,
        on_refused=lambda h, reason: refused.append((h.request_key, reason)),
    ) as receiver:
        raw = RawPeer(receiver.endpoint, LAYOUT, TIMEOUT_S)
        assert raw.hello()["ok"]
        raw.open_channel()
        raw.send_kv("bad-token", 8, 2, 10**9)
        raw.send_kv("good", 8, 2, 7)
        inbox.wait(lambda box: len(box.kv) == 1)
        assert [h.request_key for h, _ in inbox.kv] == ["good"]
        assert refused == [("bad-token", "wrong first token")]
        stats = receiver.stats.snapshot()
        assert stats.refused_frames == 1 and stats.failures == 0
        raw.close()


@pytest.mark.parametrize("num_blocks", [MAX_BLOCKS + 1, 2**40])
def test_a_frame_larger_than_the_cache_is_refused_before_allocation(num_blocks):
    refused: list[str] = []
    inbox = Inbox()
    with open_receiver(inbox, on_refused=lambda h, reason: refused.append(reason)) as receiver:
        raw = RawPeer(receiver.endpoint, LAYOUT, TIMEOUT_S)
        assert raw.hello()["ok"]
        raw.open_channel()
        raw.ring(forged_frame(KVHeader("huge", 1, 1, 0, LAYOUT), num_blocks=num_blocks))
        wait_until(raw.closed_by_receiver, what="channel closed")
        assert len(refused) == 1 and f"more than the {MAX_BLOCKS}" in refused[0]
        assert inbox.kv == [] and receiver.stats.snapshot().refused_frames == 1
        raw.close()
        with KVSender(receiver.endpoint, LAYOUT, timeout_s=TIMEOUT_S) as sender:
            send_ok(sender, "next", inbox)


BAD_HELLOS = [
    b"not json", b"[1, 2]", b"{}", b'{"index": 99, "peer_id": "x"}',
    b'{"index": true, "peer_id": "x"}', b'{"index": 1, "peer_id": 5}', b"{" + b" " * 8192 + b"}",
]


def test_malformed_hellos_are_ignored_and_the_receiver_keeps_accepting():
    inbox = Inbox()
    with open_receiver(inbox) as receiver:
        raw = RawPeer(receiver.endpoint, LAYOUT, TIMEOUT_S)
        raw.store.add("kv/peers", 1)
        for hello in BAD_HELLOS:
            raw.store.queue_push("kv/arrivals", hello)
        wait_until(lambda: receiver.stats.snapshot().refused == len(BAD_HELLOS),
                   what="every hello refused")
        with KVSender(receiver.endpoint, LAYOUT, timeout_s=TIMEOUT_S) as sender:
            send_ok(sender, "after-bad-hellos", inbox)


def test_channels_beyond_the_limit_are_refused():
    inbox = Inbox()
    with open_receiver(inbox, max_channels=1) as receiver, \
            KVSender(receiver.endpoint, LAYOUT, timeout_s=TIMEOUT_S) as first:
        first.wait_ready()
        second = KVSender(receiver.endpoint, LAYOUT, timeout_s=TIMEOUT_S)
        with pytest.raises(KVChannelError, match="limit"):
            second.wait_ready()
        send_ok(first, "still-served", inbox)


def test_the_sender_pool_is_bounded_and_frees_slots_of_broken_senders():
    pool = KVSenderPool(LAYOUT, "cpu", timeout_s=0.5, max_senders=2)
    try:
        # Nothing listens on these ports: each sender keeps connecting until its timeout.
        a, b = pool.sender("127.0.0.1:9"), pool.sender("127.0.0.1:11")
        with pytest.raises(KVSenderLimitError, match="limit 2"):
            pool.sender("127.0.0.1:13")
        assert pool.sender("127.0.0.1:9") is a  # a known endpoint needs no new slot
        for sender in (a, b):
            with pytest.raises(Exception):  # noqa: B017 - connect errors vary by platform
                sender.wait_ready(10)
        pool.sender("127.0.0.1:13")  # the broken ones made room
        assert len(pool.endpoints()) == 1
    finally:
        pool.close(cancel_pending=True)
