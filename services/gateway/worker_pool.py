"""The workers a gateway knows, their gRPC stubs and their last Health answer.

Owned by the gateway's event loop: the poll task and request handlers run there, so the
mutable fields below need no locks.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import grpc
from splitserve.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

log = logging.getLogger(__name__)

_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.keepalive_time_ms", 10_000),
]


@dataclass(eq=False)
class WorkerEndpoint:
    """One worker as seen from the gateway. `role` is how it was configured here."""

    address: str
    role: str  # "prefill", "decode" or "both"
    channel: grpc.aio.Channel
    prefill: prefill_pb2_grpc.PrefillStub | None = None
    decode: decode_pb2_grpc.DecodeStub | None = None
    health: common_pb2.HealthResponse | None = None
    reachable: bool = False
    outstanding: int = 0  # requests this gateway has in flight on it
    # KV blocks handed out by this gateway since the last poll (the poll's count lags).
    blocks_since_poll: int = 0
    last_error: str = ""

    @property
    def routable(self) -> bool:
        return (self.reachable and self.health is not None
                and self.health.status == common_pb2.HealthResponse.SERVING)

    @property
    def kv_blocks_free(self) -> int:
        if self.health is None:
            return 0
        return self.health.stats.kv_blocks_free - self.blocks_since_poll

    def mark_failed(self, reason: str) -> None:
        """An RPC found it unreachable: stop routing to it until a poll says otherwise."""
        self.reachable = False
        self.last_error = reason


@dataclass
class WorkerPool:
    prefill_addresses: list[str] = field(default_factory=list)
    decode_addresses: list[str] = field(default_factory=list)
    both_addresses: list[str] = field(default_factory=list)
    poll_interval_s: float = 1.0
    poll_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        self.endpoints: list[WorkerEndpoint] = []
        for role, addresses in (("prefill", self.prefill_addresses),
                                ("decode", self.decode_addresses),
                                ("both", self.both_addresses)):
            for address in addresses:
                channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
                self.endpoints.append(WorkerEndpoint(
                    address=address, role=role, channel=channel,
                    prefill=prefill_pb2_grpc.PrefillStub(channel) if role != "decode" else None,
                    decode=decode_pb2_grpc.DecodeStub(channel) if role != "prefill" else None,
                ))
        self._poll_task: asyncio.Task | None = None

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill_addresses)

    def decoders(self) -> list[WorkerEndpoint]:
        return [e for e in self.endpoints if e.role in ("decode", "both")]

    def prefillers(self) -> list[WorkerEndpoint]:
        return [e for e in self.endpoints if e.role == "prefill"]

    def ready(self) -> bool:
        """At least one decode-capable worker and, when disaggregated, one prefill worker."""
        has_decode = any(e.routable for e in self.decoders())
        if self.disaggregated:
            return has_decode and any(e.routable for e in self.prefillers())
        return has_decode

    def max_model_len(self) -> int | None:
        lengths = [e.health.max_model_len for e in self.endpoints
                   if e.health is not None and e.health.max_model_len]
        return min(lengths) if lengths else None

    def block_size(self) -> int:
        sizes = [e.health.block_size for e in self.decoders() if e.health and e.health.block_size]
        return min(sizes) if sizes else 16

    async def start(self) -> None:
        await self.poll_once()
        self._poll_task = asyncio.create_task(self._poll_forever(), name="worker-health-poll")

    async def close(self) -> None:
        if self._poll_task is not None:
            self._poll_task.cancel()
            await asyncio.gather(self._poll_task, return_exceptions=True)
        await asyncio.gather(*(e.channel.close() for e in self.endpoints), return_exceptions=True)

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(e) for e in self.endpoints))

    async def _poll(self, endpoint: WorkerEndpoint) -> None:
        stub = endpoint.decode or endpoint.prefill
        try:
            health = await stub.Health(common_pb2.HealthRequest(), timeout=self.poll_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if endpoint.reachable:
                log.warning("worker %s unreachable: %s", endpoint.address, exc.code().name)
            endpoint.mark_failed(exc.code().name)
            return
        if not endpoint.reachable:
            log.info("worker %s (%s) is %s", endpoint.address, health.role,
                     common_pb2.HealthResponse.Status.Name(health.status))
        endpoint.health = health
        endpoint.reachable = True
        endpoint.blocks_since_poll = 0

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            try:
                await self.poll_once()
            except Exception:  # a poll bug must not stop polling
                log.exception("worker health poll failed")
