"""Tenant quotas shared by every gateway replica through Redis. Each check-and-take is one Lua
script, so two gateways can never both spend the same tokens; time is Redis's own (TIME), so
replicas' clocks do not matter.

Keys, per tenant (one hash slot each): `splitserve:quota:{T}:tokens` (hash: tokens, at) and
`splitserve:quota:{T}:leases` (sorted set: lease id -> expiry in ms; a gateway renews its
leases on each heartbeat, so a crashed gateway's slots free themselves). The gateways
themselves: `splitserve:gateways` (sorted set: gateway id -> expiry), whose size tells each
replica its share of a limit while Redis is unreachable.
"""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from services.gateway.admission.quota_store import Decision
from services.gateway.admission.tenants import Tenant

GATEWAYS_KEY = "splitserve:gateways"
LEASE_TTL_MS = 30_000
GATEWAY_TTL_MS = 6_000

_NOW_MS = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
"""

# KEYS: tokens hash, leases zset. ARGV: tokens per ms, bucket size, cost, max concurrency
# (0: none), lease id, lease ttl ms. Returns {admitted 0/1, reason, seconds to wait}.
_ACQUIRE = _NOW_MS + """
local rate, size, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local max_concurrency, ttl = tonumber(ARGV[4]), tonumber(ARGV[6])
if max_concurrency > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  if redis.call('ZCARD', KEYS[2]) >= max_concurrency then
    return {0, 'concurrency', '1'}
  end
end
if rate > 0 then
  local state = redis.call('HMGET', KEYS[1], 'tokens', 'at')
  local tokens, at = tonumber(state[1]), tonumber(state[2])
  if tokens == nil or at == nil then tokens, at = size, now end
  tokens = math.min(size, tokens + math.max(0, now - at) * rate)
  if tokens < cost then
    return {0, 'tokens', tostring((cost - tokens) / rate / 1000)}
  end
  redis.call('HSET', KEYS[1], 'tokens', tostring(tokens - cost), 'at', tostring(now))
  redis.call('PEXPIRE', KEYS[1], math.ceil(size / rate) + 60000)
end
if max_concurrency > 0 then
  redis.call('ZADD', KEYS[2], now + ttl, ARGV[5])
  redis.call('PEXPIRE', KEYS[2], ttl * 2)
end
return {1, '', '0'}
"""

# KEYS: tokens hash, leases zset. ARGV: tokens per ms, bucket size, refund, lease id.
_RELEASE = _NOW_MS + """
redis.call('ZREM', KEYS[2], ARGV[4])
local rate, size, refund = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
if refund > 0 and rate > 0 then
  local state = redis.call('HMGET', KEYS[1], 'tokens', 'at')
  local tokens, at = tonumber(state[1]), tonumber(state[2])
  if tokens ~= nil and at ~= nil then
    tokens = math.min(size, tokens + math.max(0, now - at) * rate + refund)
    redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'at', tostring(now))
  end
end
return 1
"""

# KEYS: gateways zset, then one leases zset per lease. ARGV: gateway id, gateway ttl ms,
# lease ttl ms, then the lease ids in KEYS order. Returns the number of live gateways.
_HEARTBEAT = _NOW_MS + """
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local ttl = tonumber(ARGV[3])
for i = 2, #KEYS do
  redis.call('ZADD', KEYS[i], 'XX', now + ttl, ARGV[i + 2])
end
return redis.call('ZCARD', KEYS[1])
"""


def _keys(tenant: str) -> list[str]:
    return [f"splitserve:quota:{{{tenant}}}:tokens", f"splitserve:quota:{{{tenant}}}:leases"]


class RedisQuota:
    """The Redis side of `quota.Quotas`. Errors propagate: the caller decides the fail mode.
    `leases` (lease id -> tenant) are this gateway's live leases, renewed on heartbeat."""

    def __init__(self, url: str, gateway_id: str, timeout_s: float = 0.5) -> None:
        # One immediate retry, for a pooled connection that went stale (Redis restarted);
        # then fail fast: the fail mode takes over from there.
        self.client = aioredis.from_url(url, socket_timeout=timeout_s,
                                        socket_connect_timeout=timeout_s,
                                        retry=Retry(NoBackoff(), 1))
        self.gateway_id = gateway_id
        self.leases: dict[str, str] = {}
        self._acquire = self.client.register_script(_ACQUIRE)
        self._release = self.client.register_script(_RELEASE)
        self._heartbeat = self.client.register_script(_HEARTBEAT)

    async def acquire(self, tenant: Tenant, tokens: int, lease_id: str,
                      share: float = 1.0) -> Decision:
        admitted, reason, wait = await self._acquire(keys=_keys(tenant.name), args=[
            repr(tenant.tokens_per_s / 1000), tenant.bucket_size, tokens, tenant.max_concurrency,
            lease_id, LEASE_TTL_MS])
        reason = reason.decode() if isinstance(reason, bytes) else reason
        return Decision(bool(admitted), reason, float(wait))

    async def release(self, tenant: Tenant, lease_id: str, refund: int,
                      share: float = 1.0) -> None:
        await self._release(keys=_keys(tenant.name), args=[
            repr(tenant.tokens_per_s / 1000), tenant.bucket_size, refund, lease_id])

    async def heartbeat(self) -> int:
        """Registers this gateway, renews its leases; returns how many gateways are alive."""
        leases = list(self.leases.items())
        keys = [GATEWAYS_KEY] + [_keys(tenant)[1] for _, tenant in leases]
        args = [self.gateway_id, GATEWAY_TTL_MS, LEASE_TTL_MS] + [lease for lease, _ in leases]
        return int(await self._heartbeat(keys=keys, args=args))

    async def reconnect(self) -> None:
        """Drop pooled connections (after an outage they point at a dead server)."""
        await self.client.connection_pool.disconnect()

    async def close(self) -> None:
        try:
            await self.client.zrem(GATEWAYS_KEY, self.gateway_id)
        except Exception:  # noqa: BLE001 - leaving anyway; the entry expires
            pass
        await self.client.aclose()
