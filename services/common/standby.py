"""The warm pool: workers started with `--standby` load the model, profile memory and open
their ports like any other, but do not join the registry. They announce themselves under
their own key space (`splitserve:standby:<id>`, same entry and signature as the registry's,
bound to that key, so no standby entry passes as a worker's) and watch for an activation key
(`splitserve:activate:<id>`). Whoever scales (the autoscaler, an operator) sets that key; the
worker then deletes both keys, writes its registry entry at once and serves. Gateways follow
the registry every half second, so an activated worker takes requests within about that.

With a cluster secret the activation carries an HMAC over the worker's key and the time it
was written, checked before the worker joins; a stale or forged one is deleted and ignored.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace

import redis
import redis.asyncio as aioredis

from services.common.registry import WorkerInfo, scan_workers
from services.common.security import hmac_sign, hmac_verify

log = logging.getLogger(__name__)

STANDBY_KEY = "splitserve:standby:"
ACTIVATE_KEY = "splitserve:activate:"
ACTIVATE_DOMAIN = b"splitserve-activate-v1"
# How often a standby worker looks for its activation: the join is at most this late.
DEFAULT_POLL_S = 0.05
# An activation written longer ago than this is a replay, not a decision.
MAX_ACTIVATION_AGE_S = 60.0


def _signed_bytes(worker_id: str, at: float) -> bytes:
    return f"{ACTIVATE_KEY}{worker_id}\n{at!r}".encode()


def activation_value(worker_id: str, secret: bytes | None, now: float | None = None) -> str:
    at = time.time() if now is None else now
    body: dict = {"at": at}
    if secret:
        body["sig"] = hmac_sign(secret, ACTIVATE_DOMAIN, _signed_bytes(worker_id, at))
    return json.dumps(body)


def activation_valid(worker_id: str, raw: str | bytes, secret: bytes | None,
                     now: float | None = None) -> bool:
    """Whether `raw` (the activation key's value) is a recent activation of this worker."""
    try:
        body = json.loads(raw)
        at = body["at"]
    except (ValueError, TypeError, KeyError):
        return False
    if isinstance(at, bool) or not isinstance(at, int | float):
        return False
    now = time.time() if now is None else now
    if not -MAX_ACTIVATION_AGE_S <= now - at <= MAX_ACTIVATION_AGE_S:
        return False
    if not secret:
        return True
    return hmac_verify(secret, ACTIVATE_DOMAIN, _signed_bytes(worker_id, at), body.get("sig"))


def activate(redis_url: str, worker_id: str, secret: bytes | None = None,
             ttl_s: float = MAX_ACTIVATION_AGE_S) -> None:
    """Tell a standby worker to join (synchronous: for the autoscaler's thread and operators)."""
    client = redis.Redis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2)
    try:
        client.set(ACTIVATE_KEY + worker_id, activation_value(worker_id, secret),
                   px=int(ttl_s * 1000))
    finally:
        client.close()


def list_standby(redis_url: str, secret: bytes | None = None) -> list[WorkerInfo]:
    """The standby workers whose announcement has not expired (synchronous)."""

    async def scan() -> list[WorkerInfo]:
        client = aioredis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2)
        try:
            return (await scan_workers(client, secret, prefix=STANDBY_KEY))[0]
        finally:
            await client.aclose()

    return asyncio.run(scan())


class StandbyWatcher:
    """Worker side, on the worker's event loop: announce, watch, and on activation call
    `on_activate()` once (which writes the registry entry) and stop."""

    def __init__(self, redis_url: str, describe: Callable[[], WorkerInfo],
                 on_activate: Callable[[], Awaitable[None]], *, ttl_s: float = 5.0,
                 poll_s: float = DEFAULT_POLL_S, secret: bytes | None = None) -> None:
        self.redis = aioredis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2)
        self.describe = describe
        self.on_activate = on_activate
        self.ttl_s = ttl_s
        self.poll_s = poll_s
        self.secret = secret
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Announce once, then watch in the background: a worker that says it is ready is in
        the pool already (a launcher that looked right after the ready line found the pool
        empty while the first announcement was still on its way)."""
        last_announce = 0.0
        try:
            await self._announce()
            last_announce = time.monotonic()
        except Exception as exc:  # Redis down: the watch loop keeps trying
            log.warning("standby announcement failed: %s", exc)
        self._task = asyncio.ensure_future(self._run(last_announce))

    async def _announce(self) -> None:
        info = self.describe()
        entry = replace(info, updated=time.time())
        await self.redis.set(STANDBY_KEY + info.worker_id,
                             entry.to_json(self.secret, prefix=STANDBY_KEY),
                             px=int(self.ttl_s * 1000))

    async def _run(self, last_announce: float) -> None:
        while True:
            try:
                info = self.describe()
                key = ACTIVATE_KEY + info.worker_id
                now = time.monotonic()
                if now - last_announce >= self.ttl_s / 5:
                    await self._announce()
                    last_announce = now
                raw = await self.redis.get(key)
                if raw is not None:
                    await self.redis.delete(key)
                    if activation_valid(info.worker_id, raw, self.secret):
                        await self.redis.delete(STANDBY_KEY + info.worker_id)
                        await self.on_activate()
                        await self.redis.aclose()
                        return
                    log.warning("ignored an activation that is stale or not signed with the "
                                "cluster secret")
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis down: stay in standby and keep trying
                log.warning("standby announcement failed: %s", exc)
                await asyncio.sleep(1.0)
            await asyncio.sleep(self.poll_s)

    async def close(self) -> None:
        """Leave the pool (drain of a standby worker)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                info = self.describe()
                await self.redis.delete(STANDBY_KEY + info.worker_id)
            except Exception as exc:
                log.warning("could not leave the standby pool: %s", exc)
            await self.redis.aclose()
