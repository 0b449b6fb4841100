"""The CUDA path: NCCL channel between two GPUs. Skipped where there are fewer than two."""

from __future__ import annotations

import pytest
import torch
from kv_harness import Inbox
from kv_peer import make_kv

from kv_transfer import KVLayout, KVReceiver

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype="bfloat16")


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="NCCL needs two CUDA devices (one rank per GPU)",
)
def test_nccl_round_trip_between_two_gpus(spawn_peer):
    inbox = Inbox()
    with KVReceiver("127.0.0.1", 0, LAYOUT, "cuda:0", timeout_s=30, **inbox.receiver_kwargs()) as r:
        peer = spawn_peer()
        peer.command(
            "connect",
            name="gpu",
            endpoint=r.endpoint,
            layout=LAYOUT.to_dict(),
            timeout_s=30,
            device="cuda:1",
        )
        assert peer.expect(lambda e: e.get("name") == "gpu", 120)["event"] == "connected"
        peer.command("send", name="gpu", key="g1", num_blocks=8, num_tokens=120, first_token=5)
        inbox.wait(lambda box: len(box.kv) == 1, 60)
    header, payload = inbox.kv[0]
    assert payload.device == torch.device("cuda:0")
    assert torch.equal(payload.cpu(), make_kv(LAYOUT, "g1", 8))
