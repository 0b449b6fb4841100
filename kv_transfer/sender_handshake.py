"""How a KVSender opens its channel: the hello (with a shared-memory offer on CPU), the
receiver's verdict, the mutual proof of the cluster secret, then the process group.

Runs on the sender's channel thread, once per channel.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist

from kv_transfer import auth
from kv_transfer.channel import (
    ARRIVALS_QUEUE,
    PEERS_COUNTER,
    SENDER_RANK,
    KVChannel,
    KVChannelError,
    backend_name,
    channel_key,
)
from kv_transfer.layout import LayoutMismatchError
from kv_transfer.shared_memory import SharedRegion

if TYPE_CHECKING:
    from kv_transfer.sender import KVSender

logger = logging.getLogger("kv_transfer.sender")


@dataclass(frozen=True)
class OpenedChannel:
    index: int  # this channel's number at the receiver
    channel: KVChannel
    heartbeat_s: float  # the receiver's bound on silence, a quarter of its timeout
    frame_key: bytes | None  # tags every frame, with a cluster secret


def open_channel(sender: KVSender, store: dist.Store) -> OpenedChannel:
    """Raises LayoutMismatchError, KVChannelError or auth.KVAuthError with the receiver's
    reason when it refuses this sender."""
    index = store.add(PEERS_COUNTER, 1)
    region = (SharedRegion.create_or_none(sender.shared_memory_bytes, sender.peer_id)
              if sender.device.type == "cpu" else None)
    try:
        hello = {
            "index": index,
            "peer_id": sender.peer_id,
            "layout": sender.layout.to_dict(),
            "backend": backend_name(sender.device),
            "tp_rank": sender.tp_rank,
            "tp_size": sender.tp_size,
        }
        if region is not None:
            hello["shared_memory"] = region.offer()
        if sender.secret is not None:
            hello["nonce"] = auth.new_nonce()
        store.queue_push(ARRIVALS_QUEUE, json.dumps(hello))
        verdict = json.loads(store.get(channel_key(index, "verdict")))
    finally:
        if region is not None:
            region.unlink()  # the receiver has mapped it by now, or never will
    if not verdict["ok"]:
        error_type = (
            LayoutMismatchError if verdict.get("kind") == "LayoutMismatchError" else KVChannelError
        )
        raise error_type(f"KV receiver {sender.endpoint} refused this sender: {verdict['error']}")
    if region is not None and verdict.get("shared_memory") is not True:
        logger.info("kv sender %s: %s does not share memory with this process (%s); payloads "
                    "go over %s", sender.peer_id, sender.endpoint,
                    verdict.get("shared_memory_declined", "no answer"),
                    backend_name(sender.device))
        region = None
    frame_key = None
    if sender.secret is not None:
        frame_key = _authenticate(sender, store, index, hello["nonce"], verdict)
    channel = KVChannel(store, index, SENDER_RANK, sender.device, sender.timeout_s, region)
    return OpenedChannel(index, channel, float(verdict["heartbeat_s"]), frame_key)


def _authenticate(sender: KVSender, store: dist.Store, index: int, nonce: str,
                  verdict: dict) -> bytes:
    """The receiver proved the secret in its verdict; now this end proves it in turn.
    Returns the channel's frame key."""
    theirs = verdict.get("nonce")
    if not auth.is_nonce(theirs) or not auth.proof_ok(
        auth.receiver_proof(sender.secret, index, nonce, theirs), verdict.get("proof")
    ):
        if auth.is_nonce(theirs):  # a receiver waiting for our answer: end its wait now
            store.set(channel_key(index, "auth"), b"")
        raise auth.KVAuthError(
            f"KV receiver {sender.endpoint} did not prove the cluster secret (is the decode "
            "worker started with the same --cluster-secret-file?)", peer_id=sender.peer_id
        )
    proof = auth.sender_proof(sender.secret, index, nonce, theirs, sender.peer_id)
    store.set(channel_key(index, "auth"), proof)
    if store.get(channel_key(index, "auth_verdict")) != b"ok":
        raise auth.KVAuthError(
            f"KV receiver {sender.endpoint} refused this sender's proof", peer_id=sender.peer_id
        )
    return auth.session_key(sender.secret, index, nonce, theirs)
