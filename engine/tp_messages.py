"""What rank 0 of a tensor-parallel engine tells ranks 1..N-1, and what they tell it back.

Plain frozen dataclasses, pickled over one pipe per direction per rank. Commands are applied
in the order sent, so every rank's KV cache and request state change at the same point of the
step sequence as rank 0's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.outputs import SchedulerOutput

# -- rank 0 -> rank r ------------------------------------------------------------------------


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank process needs to start."""

    rank: int
    size: int
    config: EngineConfig
    store_port: int  # rank 0's TCPStore on 127.0.0.1: the group's rendezvous
    timeout_s: float  # every collective gives up after this long
    log_level: str


@dataclass(frozen=True)
class ExecuteModel:
    """Run this step. `draft_probs` (speculative decoding with a draft model) travel on the
    CPU, so every rank verifies the proposals exactly as rank 0 does."""

    scheduler_output: SchedulerOutput
    draft_probs: dict[str, torch.Tensor] | None = None


@dataclass(frozen=True)
class GatherKV:
    """Copy these blocks of this rank's KV cache out, and hold the copy under `handle`."""

    handle: str
    block_ids: list[int]


@dataclass(frozen=True)
class SendKV:
    """Send the shard held under `handle` to this rank's KV endpoint among `endpoint`'s."""

    handle: str
    endpoint: str  # as the decode worker advertised it: one host:port per rank, comma-separated
    request_key: str
    first_token: int
    num_tokens: int


@dataclass(frozen=True)
class ScatterKV:
    """Write the shard held under `handle` into these blocks of this rank's KV cache."""

    handle: str
    block_ids: list[int]


@dataclass(frozen=True)
class DropKV:
    """Forget the shard held under `handle`, if still held."""

    handle: str


@dataclass(frozen=True)
class OpenKVReceiver:
    """Host a KV receiver on `host` (free port); answered by KVReceiverOpened."""

    host: str
    layout: dict
    timeout_s: float
    shared_memory: bool  # map a co-located sender's region (kv_transfer.shared_memory)


@dataclass(frozen=True)
class OpenKVSenders:
    layout: dict
    timeout_s: float
    shared_memory_bytes: int  # each channel's region offer (kv_transfer.shared_memory); 0: none


@dataclass(frozen=True)
class Shutdown:
    pass


# -- rank r -> rank 0 ------------------------------------------------------------------------


@dataclass(frozen=True)
class RankReady:
    rank: int
    pid: int
    num_blocks: int


@dataclass(frozen=True)
class KVReceiverOpened:
    rank: int
    endpoint: str


@dataclass(frozen=True)
class KVArrived:
    """This rank's shard of `request_key`'s KV is held under received_handle(request_key)."""

    rank: int
    request_key: str


@dataclass(frozen=True)
class KVChannelFailed:
    rank: int
    peer_id: str
    error: str


@dataclass(frozen=True)
class RankFailed:
    """The rank hit an error it cannot recover from and exits."""

    rank: int
    error: str


def received_handle(request_key: str) -> str:
    """Where every rank holds a request's KV shard received from a prefill worker."""
    return f"recv/{request_key}"


def gathered_handle(serial: int) -> str:
    """Where every rank holds the serial-th KV shard gathered for a prefill worker to send."""
    return f"gather/{serial}"
