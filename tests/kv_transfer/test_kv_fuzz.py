"""Fuzzing a real KV receiver (TCPStore + gloo) with random, mutated and forged frames and
payloads from a hand-driven peer: no frame reaches on_kv unless every check passes, nothing
larger than max_blocks is ever allocated, a bad frame costs at most its channel, and the
receiver goes on serving. Bounded for CI (hypothesis max_examples; a few seconds)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_harness import Inbox, wait_until
from kv_raw_peer import WORDS, RawPeer, forged_frame

from kv_transfer import HeaderError, HeaderFlag, KVHeader, KVLayout, KVReceiver, KVSender
from kv_transfer.frame_check import check_data_frame
from kv_transfer.header import header_from_bytes, header_to_bytes

# `make fuzz` raises it (SPLITSERVE_FUZZ_EXAMPLES) for a longer run.
EXAMPLES = int(os.environ.get("SPLITSERVE_FUZZ_EXAMPLES", 40))
pytestmark = pytest.mark.timeout(120 + 1 * EXAMPLES)

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4, dtype="float32")
MAX_BLOCKS = 6
VOCAB = 1000
TIMEOUT_S = 10.0
INT64 = st.integers(-(2**63), 2**63 - 1)


def vocabulary_rule(header: KVHeader) -> str | None:
    return None if 0 <= header.first_token < VOCAB else "first_token outside the vocabulary"


def acceptable(header: KVHeader) -> bool:
    """What the receiver may hand to on_kv: the spec the fuzzer holds it to."""
    return (header.is_data and check_data_frame(header, LAYOUT, MAX_BLOCKS) is None
            and vocabulary_rule(header) is None)


class Target:
    """A receiver and the peer currently connected to it (replaced when its channel dies)."""

    def __init__(self) -> None:
        self.inbox = Inbox()
        self.refused: list[str] = []
        self.receiver = KVReceiver(
            "127.0.0.1", 0, LAYOUT, "cpu", timeout_s=TIMEOUT_S, max_blocks=MAX_BLOCKS,
            check_frame=vocabulary_rule,
            on_refused=lambda h, reason: self.refused.append(h.request_key),
            **self.inbox.receiver_kwargs(),
        )
        self.peer: RawPeer | None = None
        self.probes = 0

    def connected_peer(self) -> RawPeer:
        if self.peer is None:
            self.peer = RawPeer(self.receiver.endpoint, LAYOUT, TIMEOUT_S)
            assert self.peer.hello()["ok"]
            self.peer.open_channel()
        return self.peer

    def drop_peer(self) -> None:
        wait_until(self.peer.closed_by_receiver, timeout_s=TIMEOUT_S, what="channel closed")
        self.peer.close()
        self.peer = None

    def probe(self) -> None:
        """An honest transfer on the current channel must still arrive."""
        self.probes += 1
        key = f"probe-{self.probes}"
        self.connected_peer().send_kv(key, 4, 1, 1)
        self.inbox.wait(lambda box: any(h.request_key == key for h, _ in box.kv),
                        timeout_s=TIMEOUT_S)


@pytest.fixture(scope="module")
def target():
    t = Target()
    yield t
    if t.peer is not None:
        t.peer.close()
    t.receiver.close(timeout_s=2.0)


def base_header(key: str, seq: int) -> KVHeader:
    return KVHeader(key, 8, 2, 7, LAYOUT, seq=seq)


field_values = st.fixed_dictionaries({}, optional={
    "flags": st.one_of(st.sampled_from([0, 1, 2, 4, 3, 8, -1]), INT64),
    "seq": st.one_of(st.integers(-1, 3), INT64),
    "num_tokens": st.one_of(st.integers(-2, 30), INT64),
    "num_blocks": st.one_of(st.integers(-2, MAX_BLOCKS + 2), INT64),
    "first_token": st.one_of(st.integers(-3, VOCAB + 3), INT64),
    "layout_version": st.integers(0, 3),
    "num_layers": st.integers(-1, 3),
    "head_dim": st.integers(0, 9),
    "block_size": st.integers(0, 9),
    "dtype": st.integers(-1, 9),
    "key_len": st.one_of(st.integers(-1, 70), INT64),
})


@st.composite
def frames(draw, seq: int) -> bytes:
    """Raw doorbell bytes: forged fields (valid checksum), bit flips of an honest frame, or
    noise."""
    # 1..16 characters fit the header's 64 bytes; key_len forges the other lengths.
    honest = base_header(draw(st.text(min_size=1, max_size=16)), seq)
    kind = draw(st.sampled_from(["fields", "flip", "noise"]))
    if kind == "fields":
        checksum = draw(st.sampled_from([True, True, True, False]))
        return forged_frame(honest, checksum=checksum, **draw(field_values))
    if kind == "flip":
        raw = bytearray(forged_frame(honest))
        for _ in range(draw(st.integers(1, 3))):
            i = draw(st.integers(0, len(raw) - 1))
            raw[i] ^= draw(st.integers(1, 255))
        return bytes(raw)
    return draw(st.binary(max_size=300))


def parse(raw: bytes) -> KVHeader | None:
    try:
        return header_from_bytes(raw)
    except HeaderError:
        return None


@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_no_frame_crashes_or_sneaks_past_the_receiver(target, data):
    peer = target.connected_peer()
    raw = data.draw(frames(peer.seq), label="frame")
    header = parse(raw)
    before = len(target.inbox.kv)
    peer.ring(raw)
    in_step = (header is not None and header.seq == peer.seq
               and (header.flags == HeaderFlag.CLOSE or header.layout == LAYOUT))
    survives = in_step and header.flags != HeaderFlag.CLOSE and (
        not header.is_data or header.num_blocks <= MAX_BLOCKS)
    if in_step:
        peer.seq += 1
    if survives and header.is_data:
        # The receiver reads the payload (to use or to discard) only up to max_blocks.
        payload = torch.randn(LAYOUT.payload_shape(header.num_blocks))
        peer.channel.send(payload)
    if survives:
        target.probe()
        delivered = [h for h, _ in target.inbox.kv[before:]]
        fuzz_delivered = [h for h in delivered if not h.request_key.startswith("probe-")]
        if header.is_data and acceptable(header):
            assert [h.request_key for h in fuzz_delivered] == [header.request_key]
        else:
            assert fuzz_delivered == []
    else:
        target.drop_peer()
    assert all(acceptable(h) for h, _ in target.inbox.kv)


def test_the_receiver_still_serves_an_honest_sender_after_the_fuzzing(target):
    with KVSender(target.receiver.endpoint, LAYOUT, timeout_s=TIMEOUT_S) as sender:
        kv = torch.randn(LAYOUT.payload_shape(3))
        sender.send("after-fuzz", 5, 12, kv).result(timeout=TIMEOUT_S)
    target.inbox.wait(lambda box: any(h.request_key == "after-fuzz" for h, _ in box.kv))
    assert target.receiver.stats.snapshot().callback_errors == 0


def test_header_bytes_of_an_honest_frame_parse_back():
    # Guards the fuzzer's own oracle: an unmutated frame is in step and acceptable.
    header = base_header("k", 0)
    assert parse(header_to_bytes(header)) == header and acceptable(header)
    assert set(WORDS) >= {"flags", "num_blocks", "first_token"}
