"""kv_transfer between processes on one host through a shared-memory region, with real gloo for
the tokens: prefill sender processes -> an in-process decode receiver."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest
import torch
from kv_harness import TIMEOUT_S, Inbox
from kv_peer import make_kv

from kv_transfer import KVChannelError, KVLayout, KVReceiver, KVSender, shared_memory
from kv_transfer.channel import SHARED_MIN_BYTES
from kv_transfer.shared_memory import HEAD_BYTES, MIN_SLOT_BYTES, SLOTS, SharedRegion

# 32 KiB a block, so SHARED_MIN_BYTES (2 MiB) is 64 blocks.
LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, block_size=16, dtype="bfloat16")
THRESHOLD_BLOCKS = SHARED_MIN_BYTES // LAYOUT.bytes_per_block
# The smallest region: 64 KiB slots, so a 2 MiB payload crosses in 32 chunks, each slot reused.
SMALL_REGION = HEAD_BYTES + SLOTS * MIN_SLOT_BYTES


def regions() -> set[str]:
    return set(glob.glob("/dev/shm/splitserve-kv-*"))


@pytest.fixture
def inbox() -> Inbox:
    return Inbox()


def open_receiver(inbox: Inbox, **options) -> KVReceiver:
    return KVReceiver("127.0.0.1", 0, LAYOUT, "cpu", timeout_s=TIMEOUT_S,
                      **inbox.receiver_kwargs(), **options)


def send(peer, name: str, key: str, num_blocks: int) -> None:
    peer.command("send", name=name, key=key, num_blocks=num_blocks,
                 num_tokens=num_blocks * LAYOUT.block_size, first_token=7)


def assert_exact(header, payload, num_blocks: int) -> None:
    assert header.num_blocks == num_blocks
    assert torch.equal(payload, make_kv(LAYOUT, header.request_key, num_blocks))


def test_large_payloads_cross_the_shared_region_and_small_ones_go_over_gloo(
    inbox, prefill_peers
):
    before = regions()
    with open_receiver(inbox) as receiver:
        connected = prefill_peers[0].connect("shm", receiver.endpoint, LAYOUT,
                                             shared_memory_bytes=SMALL_REGION)
        assert connected["transport"] == "shared memory"
        # The sender removed the file once the receiver had mapped it: nothing to leak.
        assert regions() == before
        sizes = {"at-threshold": THRESHOLD_BLOCKS, "small": 3, "odd": THRESHOLD_BLOCKS + 3,
                 "empty": 0, "large": 4 * THRESHOLD_BLOCKS + 1}
        for key, num_blocks in sizes.items():
            send(prefill_peers[0], "shm", key, num_blocks)
        inbox.wait(lambda box: len(box.kv) == len(sizes))

        assert [h.request_key for h, _ in inbox.kv] == list(sizes)
        for header, payload in inbox.kv:
            assert_exact(header, payload, sizes[header.request_key])
        stats = receiver.stats.snapshot()
        through_region = sum(LAYOUT.payload_nbytes(n) for n in sizes.values()
                             if LAYOUT.payload_nbytes(n) >= SHARED_MIN_BYTES)
        assert stats.shared_bytes == through_region == LAYOUT.payload_nbytes(
            6 * THRESHOLD_BLOCKS + 4)
        assert stats.bytes == sum(LAYOUT.payload_nbytes(n) for n in sizes.values())
        assert stats.failures == 0 and inbox.errors == []


def test_a_receiver_that_declines_the_region_gets_every_payload_over_gloo(inbox, prefill_peers):
    before = regions()
    with open_receiver(inbox, shared_memory=False) as receiver:
        connected = prefill_peers[1].connect("declined", receiver.endpoint, LAYOUT)
        assert connected["transport"] == "gloo"
        assert regions() == before
        send(prefill_peers[1], "declined", "large", 2 * THRESHOLD_BLOCKS)
        inbox.wait(lambda box: len(box.kv) == 1)
        assert_exact(*inbox.kv[0], 2 * THRESHOLD_BLOCKS)
        assert receiver.stats.snapshot().shared_bytes == 0


def test_a_refused_sender_leaves_no_region_behind(inbox, prefill_peers):
    before = regions()
    other = KVLayout(num_layers=3, num_kv_heads=4, head_dim=64, block_size=16, dtype="bfloat16")
    with open_receiver(inbox) as receiver:
        prefill_peers[0].command("connect", name="refused", endpoint=receiver.endpoint,
                                 layout=other.to_dict(), timeout_s=TIMEOUT_S)
        event = prefill_peers[0].expect(lambda e: e.get("name") == "refused")
        assert event["event"] == "error" and event["type"] == "LayoutMismatchError"
    assert regions() == before


def test_a_sender_killed_mid_payload_fails_only_its_channel(inbox, spawn_peer):
    with open_receiver(inbox) as receiver:
        doomed = spawn_peer()
        doomed.connect("doomed", receiver.endpoint, LAYOUT, shared_memory_bytes=SMALL_REGION)
        doomed.command("stream", name="doomed", prefix="doomed",
                       num_blocks=2 * THRESHOLD_BLOCKS, count=10_000)
        inbox.wait(lambda box: len(box.kv) >= 2)
        doomed.kill()
        inbox.wait(lambda box: len(box.errors) == 1, timeout_s=TIMEOUT_S * 4)
        assert isinstance(inbox.errors[0][1], KVChannelError)
        delivered = list(inbox.kv)
        for header, payload in delivered:  # nothing torn was handed on
            assert_exact(header, payload, 2 * THRESHOLD_BLOCKS)

        replacement = spawn_peer()
        connected = replacement.connect("replacement", receiver.endpoint, LAYOUT)
        assert connected["transport"] == "shared memory"
        send(replacement, "replacement", "fresh", THRESHOLD_BLOCKS + 1)
        inbox.wait(lambda box: box.kv[-1][0].request_key == "fresh")
        assert_exact(*inbox.kv[-1], THRESHOLD_BLOCKS + 1)


def test_the_receiver_maps_only_a_region_that_holds_the_offered_token(tmp_path):
    region = SharedRegion.create(SMALL_REGION)
    try:
        offer = region.offer()
        mapped, why = SharedRegion.attach(offer)
        assert why == "" and mapped is not None
        region.slot(1)[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        assert mapped.slot(1)[:4].tolist() == [1, 2, 3, 4]  # one memory, two mappings

        link = f"/dev/shm/splitserve-kv-{os.getpid()}-{'0' * 32}"
        os.symlink(region.path, link)
        try:
            refused = [
                {**offer, "token": "00" * 32},  # another process's region
                {**offer, "path": "/etc/passwd"},
                {**offer, "path": "/dev/shm/../etc/passwd"},
                {**offer, "path": link},  # a link to a region is not one
                {**offer, "bytes": SMALL_REGION + 1},
                {**offer, "bytes": 1 << 40},
                {**offer, "token": "not hex"},
                "a string",
            ]
            for bad in refused:
                mapped, why = SharedRegion.attach(bad)
                assert mapped is None and why, bad
        finally:
            os.unlink(link)
    finally:
        region.unlink()
    assert SharedRegion.attach(offer)[0] is None  # gone once unlinked


def test_a_region_size_out_of_range_is_refused_when_the_sender_is_built():
    for nbytes in (1, SMALL_REGION - 1, (1 << 30) + 1):
        with pytest.raises(ValueError, match="shared-memory region"):
            KVSender("127.0.0.1:1", LAYOUT, shared_memory_bytes=nbytes)


def test_a_sender_without_a_usable_shm_folder_falls_back_to_gloo(inbox, monkeypatch):
    """In-process sender: /dev/shm cannot be redirected for a peer process."""
    monkeypatch.setattr(shared_memory, "SHM_DIR", "/nonexistent-shm")
    with open_receiver(inbox) as receiver, KVSender(receiver.endpoint, LAYOUT,
                                                    timeout_s=TIMEOUT_S) as sender:
        sender.wait_ready()
        assert sender.transport == "gloo"
        kv = make_kv(LAYOUT, "large", THRESHOLD_BLOCKS)
        sender.send("large", 0, THRESHOLD_BLOCKS * LAYOUT.block_size, kv).result(TIMEOUT_S)
        inbox.wait(lambda box: len(box.kv) == 1)
        assert_exact(*inbox.kv[0], THRESHOLD_BLOCKS)
        assert receiver.stats.snapshot().shared_bytes == 0


def test_a_new_region_removes_those_that_senders_killed_mid_connect_left(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid, live_pid = int(gone.stdout), os.getppid()
    left = [f"/dev/shm/splitserve-kv-{pid}-{'ab' * 16}" for pid in (dead_pid, live_pid)]
    for path in left:
        open(path, "wb").close()
    try:
        region = SharedRegion.create(SMALL_REGION)
        region.unlink()
        assert not os.path.exists(left[0])  # its sender is gone
        assert os.path.exists(left[1])  # its sender may still be connecting
    finally:
        for path in left:
            if os.path.exists(path):
                os.unlink(path)
