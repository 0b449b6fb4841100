"""End-to-end kv_transfer: prefill sender processes -> an in-process decode receiver, real gloo."""

from __future__ import annotations

import time

import pytest
import torch
from kv_harness import TIMEOUT_S, Inbox, wait_until
from kv_peer import make_kv

from kv_transfer import HeaderFlag, KVChannelError, KVLayout, KVReceiver

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype="bfloat16")


@pytest.fixture
def inbox() -> Inbox:
    return Inbox(wanted=lambda key: not key.startswith("unwanted"))


@pytest.fixture
def receiver(inbox: Inbox):
    with KVReceiver(
        "127.0.0.1", 0, LAYOUT, "cpu", timeout_s=TIMEOUT_S, **inbox.receiver_kwargs()
    ) as r:
        yield r


def assert_exact(header, payload, num_blocks: int) -> None:
    assert header.num_blocks == num_blocks
    assert payload.shape == LAYOUT.payload_shape(num_blocks)
    assert payload.dtype == torch.bfloat16 and payload.is_contiguous()
    assert torch.equal(payload, make_kv(LAYOUT, header.request_key, num_blocks))


def test_round_trip_delivers_exact_payloads_and_headers_in_send_order(
    receiver, inbox, prefill_peers
):
    peer = prefill_peers[0]
    peer.connect("rt", receiver.endpoint, LAYOUT)
    requests = [
        ("rt-a", 3, 11, 101),
        ("rt-b", 1, 4, 102),
        ("rt-empty", 0, 0, 103),
        ("rt-c", 7, 25, 104),
    ]
    for key, num_blocks, num_tokens, first_token in requests:
        peer.command(
            "send",
            name="rt",
            key=key,
            num_blocks=num_blocks,
            num_tokens=num_tokens,
            first_token=first_token,
        )
    for key, num_blocks, _, _ in requests:
        sent = peer.expect(lambda e, key=key: e.get("key") == key)
        assert sent == {"event": "sent", "key": key, "nbytes": LAYOUT.payload_nbytes(num_blocks)}
    inbox.wait(lambda box: len(box.kv) == len(requests))

    assert [h.request_key for h, _ in inbox.kv] == [r[0] for r in requests]
    for (header, payload), (_key, num_blocks, num_tokens, first_token) in zip(
        inbox.kv, requests, strict=True
    ):
        assert (header.num_tokens, header.first_token, header.flags) == (
            num_tokens,
            first_token,
            HeaderFlag.DATA,
        )
        assert header.layout == LAYOUT
        assert_exact(header, payload, num_blocks)
    stats = receiver.stats.snapshot()
    assert stats.transfers == 4 and stats.dropped == 0 and stats.failures == 0
    assert stats.bytes == sum(LAYOUT.payload_nbytes(r[1]) for r in requests)
    assert receiver.peers() == ["rt"]
    assert inbox.errors == []


def test_two_prefill_processes_feed_one_receiver_concurrently(receiver, inbox, prefill_peers):
    for i, peer in enumerate(prefill_peers):
        peer.connect(f"conc{i}", receiver.endpoint, LAYOUT)
    assert sorted(receiver.peers()) == ["conc0", "conc1"]
    for n in range(4):
        for i, peer in enumerate(prefill_peers):
            peer.command(
                "send",
                name=f"conc{i}",
                key=f"conc{i}-{n}",
                num_blocks=2 + n,
                num_tokens=5,
                first_token=n,
            )
    inbox.wait(lambda box: len(box.kv) == 8)

    for i in range(2):
        # Each channel keeps its own send order; the two channels interleave freely.
        arrived = [h.request_key for h, _ in inbox.kv if h.request_key.startswith(f"conc{i}-")]
        assert arrived == [f"conc{i}-{n}" for n in range(4)]
    for header, payload in inbox.kv:
        assert_exact(header, payload, 2 + int(header.request_key[-1]))
    assert receiver.stats.snapshot().channels_opened == 2


def test_unwanted_kv_is_received_and_dropped_and_the_channel_stays_in_sync(
    receiver, inbox, prefill_peers
):
    peer = prefill_peers[0]
    peer.connect("drop", receiver.endpoint, LAYOUT)
    for key, num_blocks in [("wanted-1", 2), ("unwanted-x", 9), ("wanted-2", 3)]:
        peer.command(
            "send", name="drop", key=key, num_blocks=num_blocks, num_tokens=1, first_token=0
        )
    inbox.wait(lambda box: len(box.kv) == 2)

    assert [h.request_key for h, _ in inbox.kv] == ["wanted-1", "wanted-2"]
    assert_exact(*inbox.kv[0], 2)
    assert_exact(*inbox.kv[1], 3)  # the frame after the dropped one is intact
    stats = receiver.stats.snapshot()
    assert (stats.transfers, stats.dropped, stats.failures) == (2, 1, 0)


def test_abort_frame_reaches_on_abort_without_a_payload(receiver, inbox, prefill_peers):
    peer = prefill_peers[1]
    peer.connect("abort", receiver.endpoint, LAYOUT)
    peer.command("abort", name="abort", key="gave-up")
    peer.command("send", name="abort", key="after-abort", num_blocks=1, num_tokens=2, first_token=9)
    inbox.wait(lambda box: len(box.kv) == 1 and len(box.aborts) == 1)

    assert inbox.aborts[0].request_key == "gave-up" and inbox.aborts[0].flags == HeaderFlag.ABORT
    assert_exact(*inbox.kv[0], 1)
    assert receiver.stats.snapshot().aborts == 1


def test_idle_channel_outlives_the_timeout_thanks_to_heartbeats(receiver, inbox, prefill_peers):
    peer = prefill_peers[1]
    peer.connect("idle", receiver.endpoint, LAYOUT)
    time.sleep(TIMEOUT_S * 2.5)
    peer.command("send", name="idle", key="late", num_blocks=1, num_tokens=1, first_token=0)
    inbox.wait(lambda box: len(box.kv) == 1)
    assert inbox.errors == []


def test_header_without_payload_is_discarded_after_timeout(receiver, inbox, prefill_peers):
    peer = prefill_peers[0]
    peer.connect("hung", receiver.endpoint, LAYOUT)
    peer.command("stall_payloads", name="hung")
    peer.expect("stalling")
    peer.command("send", name="hung", key="stuck", num_blocks=2, num_tokens=1, first_token=0)
    started = time.monotonic()
    inbox.wait(lambda box: len(box.errors) == 1, timeout_s=TIMEOUT_S * 4)

    peer_id, error = inbox.errors[0]
    assert peer_id == "hung"
    assert isinstance(error, KVChannelError) and error.request_key == "stuck"
    assert time.monotonic() - started >= TIMEOUT_S * 0.9  # noticed by the payload deadline
    assert inbox.kv == []
    assert receiver.stats.snapshot().failures == 1
    wait_until(lambda: receiver.peers() == [], what="the dead channel to be forgotten")


def test_receiver_survives_sender_killed_mid_stream_and_serves_its_replacement(
    receiver, inbox, spawn_peer
):
    doomed = spawn_peer()
    doomed.connect("doomed", receiver.endpoint, LAYOUT)
    # 64 blocks = 512 KiB each: keep the channel busy so the kill lands mid-transfer.
    doomed.command("stream", name="doomed", prefix="doomed", num_blocks=64, count=10_000)
    inbox.wait(lambda box: len(box.kv) >= 2)
    doomed.kill()
    inbox.wait(lambda box: len(box.errors) == 1, timeout_s=TIMEOUT_S * 4)

    assert inbox.errors[0][0] == "doomed"
    assert isinstance(inbox.errors[0][1], KVChannelError)
    delivered = list(inbox.kv)
    for header, payload in delivered:  # nothing torn was handed on
        assert_exact(header, payload, 64)
    assert [h.request_key for h, _ in delivered] == [f"doomed-{i}" for i in range(len(delivered))]

    replacement = spawn_peer()
    replacement.connect("replacement", receiver.endpoint, LAYOUT)
    replacement.command(
        "send", name="replacement", key="fresh", num_blocks=5, num_tokens=3, first_token=1
    )
    inbox.wait(lambda box: box.kv[-1][0].request_key == "fresh")
    assert_exact(*inbox.kv[-1], 5)
    assert receiver.peers() == ["replacement"]

    # An idle sender that dies is noticed too: its heartbeats stop.
    replacement.kill()
    inbox.wait(lambda box: len(box.errors) == 2, timeout_s=TIMEOUT_S * 4)
    assert inbox.errors[1][0] == "replacement"
    assert receiver.stats.snapshot().failures == 2
