"""The worker registry in Redis: workers announce themselves with a heartbeat that expires,
gateways list who is alive. Prefix-cache events (block hashes stored / evicted) go to a
Redis stream that routers follow.

Keys: `splitserve:worker:<id>` (JSON WorkerInfo, TTL = heartbeat TTL) and the stream
`splitserve:prefix-events` (fields: worker, kind, hashes). With a cluster secret, each entry
also carries `signature` and each event `sig`: HMAC-SHA256 over the key and the canonical JSON
(or the event's fields), which a reader holding the secret checks before trusting the entry.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields

import redis.asyncio as aioredis

from services.common.security import hmac_sign, hmac_verify

log = logging.getLogger(__name__)

WORKER_KEY = "splitserve:worker:"
PREFIX_STREAM = "splitserve:prefix-events"
# The stream is bounded in bytes, not only in entries: at most this many entries (trimmed
# approximately) of at most this many block hashes each. An entry of 128 signed hashes takes
# ~6.4 KB in Redis, so the stream stays under ~52 MB however busy the workers are (the chart's
# Redis has 256 MB and evicts nothing; tests/services/test_registry_bounds.py measures it).
# Gateways replay it to rebuild their prefix index: up to 1M events reach further back than
# the index keeps (200k blocks).
PREFIX_STREAM_MAXLEN = 8_000
PREFIX_EVENT_MAX_HASHES = 128
ENTRY_DOMAIN = b"splitserve-registry-entry-v1"
EVENT_DOMAIN = b"splitserve-prefix-event-v1"
# A signed entry written longer ago than this is a replay (heartbeats rewrite entries every
# second or so); generous, so that clocks a little apart between nodes do not matter.
MAX_ENTRY_AGE_S = 120.0
REJECT_REASONS = ("malformed", "unsigned", "bad_signature", "stale")
_ROLES = ("prefill", "decode", "both")


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str
    role: str  # prefill | decode | both
    address: str  # gRPC host:port
    kv_endpoint: str
    model: str
    block_size: int
    max_model_len: int
    metrics_address: str = ""
    draining: bool = False
    stats: dict = field(default_factory=dict)
    updated: float = 0.0

    def to_json(self, secret: bytes | None = None, prefix: str = WORKER_KEY) -> str:
        """The registry value; signed (bound to this worker's key under `prefix`) when
        `secret` is given."""
        body = asdict(self)
        if secret:
            body["signature"] = hmac_sign(secret, ENTRY_DOMAIN,
                                          _signed_bytes(self.worker_id, body, prefix))
        return json.dumps(body)


_INFO_FIELDS = frozenset(f.name for f in fields(WorkerInfo))


class RejectedEntry(ValueError):
    """A registry value a reader will not use; `reason` is one of REJECT_REASONS."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def _signed_bytes(worker_id: str, body: dict, prefix: str = WORKER_KEY) -> bytes:
    unsigned = {k: v for k, v in body.items() if k != "signature"}
    canonical = json.dumps(unsigned, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return (prefix + worker_id).encode() + b"\n" + canonical.encode()


def decode_entry(key: str, raw: str | bytes, secret: bytes | None,
                 now: float | None = None, prefix: str = WORKER_KEY) -> WorkerInfo:
    """The WorkerInfo stored under `key`, or RejectedEntry. With a secret, only an entry signed
    with it for this very key, and written within MAX_ENTRY_AGE_S, is accepted. `prefix` is the
    key space (the standby pool's entries are signed for theirs, so none passes as a worker's)."""
    try:
        body = json.loads(raw)
        if not isinstance(body, dict):
            raise ValueError("not a worker entry")
        # Fields a newer worker adds are ignored (a rolling update has both versions at
        # once); the signature still covers them.
        info = WorkerInfo(**{k: v for k, v in body.items() if k in _INFO_FIELDS})
        if not all(isinstance(getattr(info, name), str) for name in ("worker_id", "address")):
            raise ValueError("worker_id and address must be strings")
        if info.role not in _ROLES:
            raise ValueError(f"role {info.role!r} is not one of {', '.join(_ROLES)}")
    except (ValueError, TypeError) as exc:  # json.JSONDecodeError is a ValueError
        raise RejectedEntry("malformed", f"{key}: {exc}") from None
    if not secret:
        return info
    if "signature" not in body:
        raise RejectedEntry("unsigned", key)
    if key != prefix + info.worker_id or not hmac_verify(
            secret, ENTRY_DOMAIN, _signed_bytes(info.worker_id, body, prefix), body["signature"]):
        raise RejectedEntry("bad_signature", key)
    now = time.time() if now is None else now
    if not isinstance(info.updated, (int, float)) or not now - info.updated <= MAX_ENTRY_AGE_S:
        raise RejectedEntry("stale", f"{key} updated={info.updated!r}, now={now:.0f}")
    return info


def prefix_event_fields(worker_id: str, kind: str, hashes: str,
                        secret: bytes | None) -> dict[str, str]:
    event = {"worker": worker_id, "kind": kind, "hashes": hashes}
    if secret:
        event["sig"] = hmac_sign(secret, EVENT_DOMAIN, _event_bytes(worker_id, kind, hashes))
    return event


def prefix_event_signed(fields: dict, secret: bytes) -> bool:
    """Whether a stream entry (bytes keys and values, as redis returns them) is signed with
    `secret`; a missing or malformed field is simply unsigned."""
    try:
        worker, kind = fields[b"worker"].decode(), fields[b"kind"].decode()
        hashes, sig = fields[b"hashes"].decode(), fields[b"sig"].decode()
    except (KeyError, AttributeError, UnicodeDecodeError):
        return False
    return hmac_verify(secret, EVENT_DOMAIN, _event_bytes(worker, kind, hashes), sig)


def _event_bytes(worker_id: str, kind: str, hashes: str) -> bytes:
    return f"{worker_id}\n{kind}\n{hashes}".encode()


class RegistryPublisher:
    """Worker side. Runs on the worker's event loop; `describe()` must be cheap and
    thread-safe (it reads snapshots), `drain_events()` pops prefix events (deque)."""

    def __init__(self, redis_url: str, describe: Callable[[], WorkerInfo],
                 drain_events: Callable[[], list[tuple[str, int]]] | None = None,
                 ttl_s: float = 5.0, interval_s: float = 1.0,
                 secret: bytes | None = None) -> None:
        self.secret = secret  # signs every entry and event when set
        self.redis = aioredis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2)
        self.describe = describe
        self.drain_events = drain_events
        self.ttl_s = ttl_s
        self.interval_s = interval_s
        self._task: asyncio.Task | None = None
        self.connected = False

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            try:
                await self.publish_once()
                if not self.connected:
                    log.info("registered in redis")
                self.connected = True
            except Exception as exc:  # Redis down: keep serving, retry next beat
                if self.connected:
                    log.warning("redis heartbeat failed: %s", exc)
                self.connected = False
            await asyncio.sleep(self.interval_s)

    async def publish_once(self) -> None:
        info = self.describe()
        info = WorkerInfo(**{**asdict(info), "updated": time.time()})
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(WORKER_KEY + info.worker_id, info.to_json(self.secret),
                 px=int(self.ttl_s * 1000))
        if self.drain_events is not None:
            events = self.drain_events()
            for kind in ("stored", "evicted"):
                hashes = [str(h) for k, h in events if k == kind]
                for start in range(0, len(hashes), PREFIX_EVENT_MAX_HASHES):
                    chunk = ",".join(hashes[start:start + PREFIX_EVENT_MAX_HASHES])
                    pipe.xadd(PREFIX_STREAM, prefix_event_fields(
                        info.worker_id, kind, chunk, self.secret),
                              maxlen=PREFIX_STREAM_MAXLEN, approximate=True)
        await pipe.execute()

    async def deregister(self, worker_id: str) -> None:
        if self._task is not None:
            self._task.cancel()
        try:
            await self.redis.delete(WORKER_KEY + worker_id)
        except Exception as exc:
            log.warning("could not deregister from redis: %s", exc)
        await self.redis.aclose()


async def scan_workers(redis: aioredis.Redis, secret: bytes | None = None,
                       prefix: str = WORKER_KEY) -> tuple[list[WorkerInfo], dict[str, str]]:
    """Every worker whose heartbeat has not expired and whose entry decode_entry accepts, and
    the rest: key -> reason. One bad entry never hides the good ones."""
    keys = [k async for k in redis.scan_iter(match=prefix + "*", count=500)]
    if not keys:
        return [], {}
    return decode_entries(keys, await redis.mget(keys), secret, prefix)


def decode_entries(keys, values, secret: bytes | None,
                   prefix: str = WORKER_KEY) -> tuple[list[WorkerInfo], dict[str, str]]:
    """Entries read with MGET (a value None: expired since the scan): those decode_entry
    accepts, and the rest: key -> reason."""
    workers, rejected = [], {}
    for key, raw in zip(keys, values, strict=True):
        if raw is None:
            continue
        name = key.decode(errors="replace") if isinstance(key, bytes) else key
        try:
            workers.append(decode_entry(name, raw, secret, prefix=prefix))
        except RejectedEntry as exc:
            rejected[name] = exc.reason
    return workers, rejected


async def list_workers(redis: aioredis.Redis, secret: bytes | None = None) -> list[WorkerInfo]:
    """Every worker whose heartbeat has not expired (and, with a secret, signed with it)."""
    return (await scan_workers(redis, secret))[0]
