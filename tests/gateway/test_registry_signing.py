"""Signed registry entries, with a real Redis and real processes: workers holding the cluster
secret sign their entries; a gateway holding it routes only to them and ignores (and counts)
an unsigned real worker, entries forged with a wrong or reused signature, a stale replay, junk,
and unsigned prefix events. A gateway without the secret, shown the same Redis, would route
to the unsigned worker: the forgery is real."""

from __future__ import annotations

import json
import time

import pytest
import redis
from registry_cluster import known, routable, wait_until
from test_registry_discovery import complete, distinct_prompts

from services.common.registry import (
    PREFIX_STREAM,
    WORKER_KEY,
    RejectedEntry,
    WorkerInfo,
    decode_entry,
    prefix_event_fields,
    prefix_event_signed,
)
from tests.metrics_text import scrape

pytestmark = pytest.mark.timeout(240)
SECRET = b"0123456789abcdef-cluster-secret"


def _rejected(gateway, kind: str, reason: str) -> float:
    metrics = scrape(f"http://{gateway.field('admin') or gateway.address}")
    return metrics.get(f'splitserve_gateway_registry_rejected_total{{kind="{kind}",reason="{reason}"}}',
                       0.0)


def test_gateway_with_the_secret_never_routes_to_unsigned_or_forged_workers(
        cluster, tiny_llama_dir, tmp_path, redis_server):
    secret_file = tmp_path / "cluster-secret"
    secret_file.write_bytes(SECRET + b"\n")
    flags = ("--cluster-secret-file", str(secret_file))
    cluster.start(flags, p1="prefill", d1="decode")
    cluster.start(rogue="decode")  # a real worker without the secret: registers unsigned
    p1, d1, rogue = (cluster.workers[n] for n in ("p1", "d1", "rogue"))
    r = redis.Redis.from_url(redis_server)
    d1_key = WORKER_KEY + d1.health().worker_id
    wait_until(lambda: r.get(d1_key) and r.get(WORKER_KEY + rogue.health().worker_id),
               what="both decode workers registered")
    genuine = json.loads(r.get(d1_key))
    assert len(genuine["signature"]) == 64  # HMAC-SHA256, hex

    def forge(name: str, value: bytes | str) -> None:
        r.set(WORKER_KEY + name, value, px=120_000)

    # d1's signature on an entry that now points at the rogue.
    forge("forged-moved", json.dumps({**genuine, "worker_id": "forged-moved",
                                      "address": rogue.address}))
    # Signed, but with another secret.
    rogue_info = WorkerInfo(**{**{k: v for k, v in genuine.items() if k != "signature"},
                               "worker_id": "forged-key", "address": rogue.address,
                               "updated": time.time()})
    forge("forged-key", rogue_info.to_json(b"not-the-cluster-secret-at-all"))
    # A genuine signed entry of d1 copied under another key.
    forge("forged-copy", json.dumps(genuine))
    # Correctly signed, long ago: a replay.
    stale = WorkerInfo(**{**rogue_info.__dict__, "worker_id": "forged-stale",
                          "updated": time.time() - 3600})
    forge("forged-stale", stale.to_json(SECRET))
    forge("junk", b"{not json")
    r.xadd(PREFIX_STREAM, {"worker": "forged-key", "kind": "stored", "hashes": "1,2,3"})

    gateway = cluster.gateway(*flags)
    wait_until(lambda: routable(gateway) == {p1.address, d1.address},
               what="the gateway routing to the signed workers")
    statuses = complete(f"http://{gateway.address}", tiny_llama_dir.name, distinct_prompts(8, 100))
    assert statuses == [200] * 8, gateway.output()
    assert rogue.address not in known(gateway)
    assert rogue.health().stats.steps == 0, "the unsigned worker got a request"
    wait_until(lambda: _rejected(gateway, "prefix_event", "unsigned") >= 1, timeout=10,
               what="the forged prefix event counted")
    assert _rejected(gateway, "worker", "unsigned") == 1
    assert _rejected(gateway, "worker", "bad_signature") == 3
    assert _rejected(gateway, "worker", "stale") == 1
    assert _rejected(gateway, "worker", "malformed") == 1

    trusting = cluster.gateway()  # no secret: everything in Redis is believed
    wait_until(lambda: rogue.address in routable(trusting),
               what="a gateway without the secret routing to the unsigned worker")


def _entry(**changes) -> WorkerInfo:
    return WorkerInfo(**{"worker_id": "d1", "role": "decode", "address": "10.0.0.7:50051",
                         "kv_endpoint": "10.0.0.7:50052", "model": "m", "block_size": 16,
                         "max_model_len": 2048, "updated": time.time(), **changes})


def test_a_signed_entry_verifies_only_unchanged_under_its_own_key_and_secret():
    key = WORKER_KEY + "d1"
    raw = _entry().to_json(SECRET)
    assert decode_entry(key, raw, SECRET) == _entry(updated=json.loads(raw)["updated"])
    assert decode_entry(key, raw, None).address == "10.0.0.7:50051"  # no secret: trusted as is
    body = json.loads(raw)
    for name, value in (("address", "10.6.6.6:50051"), ("draining", True), ("role", "both"),
                        ("stats", {"kv_blocks_free": 10**9}), ("updated", time.time() + 1)):
        with pytest.raises(RejectedEntry) as info:
            decode_entry(key, json.dumps({**body, name: value}), SECRET)
        assert info.value.reason == "bad_signature", name
    cases = [(WORKER_KEY + "d2", raw, "bad_signature"),
             (key, _entry().to_json(None), "unsigned"),
             (key, _entry(updated=float("nan")).to_json(SECRET), "stale"),
             (key, json.dumps({**body, "signature": 7}), "bad_signature"),
             (key, json.dumps({**body, "extra": 1}), "bad_signature"),  # not what was signed
             (key, json.dumps({**body, "role": "root"}), "malformed"),
             (key, b"\xff\xfe", "malformed"), (key, "[]", "malformed")]
    for entry_key, value, reason in cases:
        with pytest.raises(RejectedEntry) as info:
            decode_entry(entry_key, value, SECRET)
        assert info.value.reason == reason, (entry_key, value)


def test_prefix_events_verify_only_with_their_signature():
    fields = {k.encode(): v.encode() for k, v in
              prefix_event_fields("d1", "stored", "11,12", SECRET).items()}
    assert prefix_event_signed(fields, SECRET)
    assert not prefix_event_signed({**fields, b"hashes": b"11,13"}, SECRET)
    assert not prefix_event_signed({**fields, b"worker": b"d2"}, SECRET)
    assert not prefix_event_signed({k: v for k, v in fields.items() if k != b"sig"}, SECRET)
    assert not prefix_event_signed(fields, b"another-secret-of-enough-bytes")
    assert "sig" not in prefix_event_fields("d1", "stored", "11", None)
