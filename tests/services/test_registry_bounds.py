"""The prefix-event stream in a real Redis is bounded in bytes, whatever a worker's event
rate: events are split into entries of at most PREFIX_EVENT_MAX_HASHES hashes and the stream
is trimmed to PREFIX_STREAM_MAXLEN entries, which fit the chart's Redis with room to spare.
(Before, one entry held every hash of a heartbeat and 200,000 entries were kept: a busy
prefill fleet filled the chart's 256 MB, and the heartbeats were then refused or evicted.)"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import redis
import yaml

from services.common import registry
from services.common.registry import (
    PREFIX_EVENT_MAX_HASHES,
    PREFIX_STREAM,
    RegistryPublisher,
    WorkerInfo,
    prefix_event_signed,
)

SECRET = b"k" * 32
VALUES = Path(__file__).resolve().parents[2] / "k8s" / "splitserve" / "values.yaml"
_UNITS = {"k": 1000, "kb": 1024, "m": 1000**2, "mb": 1024**2, "g": 1000**3, "gb": 1024**3}


def _publish(url: str, events: list[tuple[str, int]]) -> None:
    """One heartbeat of a signed prefill worker that has `events` to report."""
    info = WorkerInfo("w-1", "prefill", "127.0.0.1:1", "127.0.0.1:2", "m", 16, 2048)
    pending = [events]
    publisher = RegistryPublisher(url, lambda: info, lambda: pending.pop() if pending else [],
                                  secret=SECRET)

    async def beat() -> None:
        try:
            await publisher.publish_once()
        finally:
            await publisher.redis.aclose()

    asyncio.run(beat())


def _digests(count: int) -> list[int]:
    """Block hashes as the engine makes them: 16-byte digests, so up to 39 decimal digits."""
    rng = random.Random(count)
    return [rng.randrange(2**127, 2**128) for _ in range(count)]


def test_a_large_heartbeat_is_split_into_signed_entries_of_bounded_size(redis_server):
    stored, evicted = _digests(1000), _digests(300)
    _publish(redis_server, [("stored", h) for h in stored] + [("evicted", h) for h in evicted])
    entries = redis.Redis.from_url(redis_server).xrange(PREFIX_STREAM)
    assert len(entries) == 8 + 3  # ceil(1000 / 128) + ceil(300 / 128)
    seen: dict[str, list[int]] = {"stored": [], "evicted": []}
    for _, fields in entries:
        assert prefix_event_signed(fields, SECRET)
        hashes = [int(h) for h in fields[b"hashes"].split(b",")]
        assert len(hashes) <= PREFIX_EVENT_MAX_HASHES
        seen[fields[b"kind"].decode()] += hashes
    assert seen == {"stored": stored, "evicted": evicted}


def test_the_stream_is_trimmed_to_its_entry_limit(redis_server, monkeypatch):
    monkeypatch.setattr(registry, "PREFIX_STREAM_MAXLEN", 500)
    for _ in range(3):
        _publish(redis_server, [("stored", h) for h in _digests(500 * PREFIX_EVENT_MAX_HASHES)])
    # Trimming is approximate: Redis drops whole nodes of up to 100 entries.
    assert 500 <= redis.Redis.from_url(redis_server).xlen(PREFIX_STREAM) <= 600


def test_a_full_stream_fits_the_charts_redis_with_room_to_spare(redis_server):
    sample = 1000
    _publish(redis_server, [("stored", h) for h in _digests(sample * PREFIX_EVENT_MAX_HASHES)])
    client = redis.Redis.from_url(redis_server)
    assert client.xlen(PREFIX_STREAM) == sample
    per_entry = client.memory_usage(PREFIX_STREAM, samples=0) / sample
    full = per_entry * (registry.PREFIX_STREAM_MAXLEN + 100)  # + one node of approximate trim
    limit = yaml.safe_load(VALUES.read_text())["redis"]["maxMemory"].lower()
    number, unit = limit.rstrip("kmgb"), limit[len(limit.rstrip("kmgb")):]
    max_memory = int(number) * _UNITS[unit]
    # Heartbeats, quotas and Redis's own overhead need the rest (it evicts nothing).
    assert full < 0.3 * max_memory, (per_entry, full, max_memory)


@pytest.mark.parametrize("template", ["redis.yaml"])
def test_the_charts_redis_evicts_nothing(template):
    """Under volatile-lru a full Redis evicted the keys with a TTL first: worker heartbeats
    (every worker drops out of the registry) and quota state (a tenant's limits reset)."""
    text = (VALUES.parent / "templates" / template).read_text()
    policy = text.split("--maxmemory-policy", 1)[1].split("\n", 2)[1].strip(" -\"")
    assert policy == "noeviction"
