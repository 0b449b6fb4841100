"""Which decode KV endpoints a prefill worker will push KV to: a Prefill call's
`decode_kv_endpoint` is taken only if a registered decode worker advertises it (the registry in
Redis) or the operator's allow-list names it; anything else would let a caller aim this worker
at any host:port.

Used on the gRPC event loop only.
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis

from kv_transfer.channel import parse_endpoint, split_endpoints
from services.common.registry import list_workers

log = logging.getLogger(__name__)

# With no Redis and no allow-list (one machine, `make run`), peers are local processes: they
# advertise a loopback address, or this machine's own (`splitserve up --host 0.0.0.0`).
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
# A miss re-reads the registry at most this often (misses in the meantime wait for that read),
# so a flood of bad endpoints costs Redis two scans a second, while a decode worker that just
# registered is found within one.
REGISTRY_REFRESH_S = 0.5


class KVEndpointRefused(PermissionError):
    """The endpoint is neither a registered decode worker's nor on the allow-list."""


def parse_allow_list(text: str) -> tuple[frozenset[str], frozenset[str], bool]:
    """`--kv-allowed-endpoints`: comma-separated `host:port`, `host:*` or `*` (any endpoint).
    Returns (exact endpoints, hosts with any port, any); ValueError names a bad entry."""
    exact, hosts, any_endpoint = set(), set(), False
    for entry in (part.strip() for part in text.split(",")):
        if not entry:
            continue
        if entry == "*":
            any_endpoint = True
        elif entry.endswith(":*") and entry[:-2]:
            hosts.add(entry[:-2].strip("[]"))
        else:
            try:
                host, port = parse_endpoint(entry)
            except ValueError:
                raise ValueError(f"--kv-allowed-endpoints entry {entry!r} is not host:port, "
                                 "host:* or *") from None
            exact.add(f"{host}:{port}")
    return frozenset(exact), frozenset(hosts), any_endpoint


class KVEndpointPolicy:
    """Allow-list entries always pass. With a Redis URL, so does any endpoint a live decode
    (or role-both) worker advertises; without one and with no allow-list, only this machine's
    (loopback, or `local_hosts`: the address this worker advertises)."""

    def __init__(self, allowed: str = "", redis_url: str = "", secret: bytes | None = None,
                 refresh_s: float = REGISTRY_REFRESH_S, local_hosts: tuple[str, ...] = ()) -> None:
        self.exact, self.hosts, self.any_endpoint = parse_allow_list(allowed)
        if not allowed.strip() and not redis_url:
            self.hosts = frozenset(LOOPBACK_HOSTS + tuple(local_hosts))
        self.redis_url = redis_url
        self.secret = secret
        self.refresh_s = refresh_s
        self.num_refused = 0
        self._redis = None
        self._registered: frozenset[str] = frozenset()
        self._read_at = float("-inf")
        self._reading: asyncio.Future[float] | None = None  # the registry read in flight

    def describe(self) -> str:
        if self.any_endpoint:
            return "any (--kv-allowed-endpoints '*')"
        parts = sorted(self.exact) + [f"{h}:*" for h in sorted(self.hosts)]
        if self.redis_url:
            parts.insert(0, "registered decode workers")
        return ", ".join(parts) or "none"

    async def check(self, endpoint: str) -> None:
        """Raises KVEndpointRefused (or ValueError for one that is not host:port at all)."""
        parts = split_endpoints(endpoint)
        if not parts:
            raise ValueError("decode_kv_endpoint is empty")
        for part in parts:
            parse_endpoint(part)  # ValueError with the offending text
        if self.any_endpoint or all(self._listed(part) for part in parts):
            return
        if self.redis_url and await self._registered_has(",".join(parts)):
            return
        self.num_refused += 1
        raise KVEndpointRefused(
            f"decode_kv_endpoint {endpoint[:200]!r} is not a registered decode worker's KV "
            f"endpoint nor on --kv-allowed-endpoints (allowed: {self.describe()})"
        )

    def _listed(self, part: str) -> bool:
        host, port = parse_endpoint(part)
        return f"{host}:{port}" in self.exact or host in self.hosts

    async def _registered_has(self, endpoint: str) -> bool:
        """Known, or found by a registry read that started after this check did. Checks that
        miss at once share one read (so a burst of requests for a decode worker that has just
        registered all find it), and reads are at least `refresh_s` apart (so a flood of bad
        endpoints costs Redis a few scans a second, and each bad request waits that long)."""
        asked_at = time.monotonic()
        for _ in range(2):
            if endpoint in self._registered:
                return True
            if self._reading is None:
                self._reading = asyncio.ensure_future(self._read_when_allowed())
            started = await asyncio.shield(self._reading)
            if started >= asked_at:
                break
        return endpoint in self._registered

    async def _read_when_allowed(self) -> float:
        """One registry read, no sooner than `refresh_s` after the last; returns when it began."""
        try:
            wait = self._read_at + self.refresh_s - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            self._read_at = time.monotonic()
            try:
                self._registered = await self._read_registry()
            except Exception as exc:  # Redis down: refuse what is not known already
                log.warning("cannot read the worker registry to check a KV endpoint: %s", exc)
            return self._read_at
        finally:
            self._reading = None

    async def _read_registry(self) -> frozenset[str]:
        if self._redis is None:
            self._redis = aioredis.from_url(self.redis_url, socket_timeout=2,
                                            socket_connect_timeout=2)
        workers = await list_workers(self._redis, self.secret)
        return frozenset(",".join(split_endpoints(w.kv_endpoint)) for w in workers
                         if w.role in ("decode", "both") and isinstance(w.kv_endpoint, str)
                         and w.kv_endpoint)
