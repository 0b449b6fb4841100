"""Tenants and the prefix cache: each tenant's cached blocks are its own (the gateway salts
every request's block hashes with its tenant) unless the tenants file puts tenants in one
`cache_group`. Checked on the tenants file, on the router's index, and end to end on real
prefill and decode workers through the cache hit counts (never timing)."""

from __future__ import annotations

import random
import time

import httpx
import pytest
from gateway_processes import worker_stats
from synthetic_workers import StaticPool, worker
from tenant_load import tenants_file

from engine.block_pool import hash_prompt_blocks
from services.gateway.admission.tenants import ANONYMOUS, Tenant, key_digest, load_tenants
from services.gateway.routing.prefix_index import PrefixIndex
from services.gateway.routing.router import ScoringRouter
from tests.metrics_text import scrape

SYSTEM = list(range(1000, 1256))  # 16 blocks of 16 tokens


def test_tenants_are_private_by_default_and_a_cache_group_is_shared(tmp_path):
    path = tenants_file(tmp_path, {"a": {}, "b": {}, "g1": {"cache_group": "common"},
                                   "g2": {"cache_group": "common"}})
    directory = load_tenants(path)
    salts = {name: directory.authenticate(f"Bearer sk-{name}").cache_salt
             for name in ("a", "b", "g1", "g2")}
    assert salts == {"a": "tenant:a", "b": "tenant:b", "g1": "group:common",
                     "g2": "group:common"}
    # A group named like a tenant is still not that tenant's private cache.
    assert Tenant("x", cache_group="a").cache_salt != Tenant("a").cache_salt
    # No keys at all: one anonymous tenant, the one unsalted cache everyone shared before.
    assert load_tenants().authenticate(None).cache_salt == "" == Tenant(ANONYMOUS).cache_salt


def test_with_the_cluster_secret_salts_are_keyed_and_agree_across_gateways(tmp_path):
    path = tenants_file(tmp_path, {"a": {}, "g1": {"cache_group": "common"},
                                   "g2": {"cache_group": "common"}})
    one, other = (load_tenants(path, salt_key=b"s" * 32) for _ in range(2))
    rotated = load_tenants(path, salt_key=b"t" * 32)

    def salt(directory, name: str) -> str:
        return directory.cache_salt(directory.authenticate(f"Bearer sk-{name}"))

    keyed = salt(one, "a")
    assert len(keyed) == 64 and "tenant:a" != keyed != salt(rotated, "a")
    assert keyed == salt(other, "a")  # two gateways with one secret share one cache
    assert salt(one, "g1") == salt(one, "g2") != keyed
    assert load_tenants(salt_key=b"s" * 32).cache_salt(Tenant()) == ""  # anonymous: shared
    hash_prompt_blocks(SYSTEM, 16, keyed)  # a salt the workers accept


def test_a_requests_own_cache_salt_splits_its_tenants_cache_and_joins_no_other(tmp_path):
    path = tenants_file(tmp_path, {"a": {}, "b": {}})
    for key in (None, b"s" * 32):
        directory = load_tenants(path, salt_key=key)
        a, b = (directory.authenticate(f"Bearer sk-{name}") for name in ("a", "b"))
        salts = {directory.cache_salt(a), directory.cache_salt(a, "x"),
                 directory.cache_salt(a, "y"), directory.cache_salt(b, "x")}
        assert len(salts) == 4
        assert directory.cache_salt(a, "x") == directory.cache_salt(a, "x")
        anonymous = load_tenants(salt_key=key)
        assert anonymous.cache_salt(Tenant(), "x") not in ("", directory.cache_salt(a))
        assert anonymous.cache_salt(Tenant(), "\ud800")  # any string the JSON can carry
    # No tenant or group name can spell a tenant's salt with a request's salt after it.
    plain = load_tenants(path)
    assert "/" in plain.cache_salt(plain.authenticate("Bearer sk-a"), "x")
    with pytest.raises(ValueError):
        Tenant("a/salt:x")


@pytest.mark.parametrize("group, message", [("no spaces", "cache_group"), (7, "must be a string"),
                                            ("x" * 65, "cache_group")])
def test_a_bad_cache_group_is_refused_at_start_up(tmp_path, group, message):
    path = tmp_path / "tenants.yaml"
    path.write_text(f"tenants:\n  a:\n    api_key_sha256: '{key_digest('sk-a')}'\n"
                    f"    cache_group: {group!r}\n")
    with pytest.raises(ValueError, match=message):
        load_tenants(str(path))


def test_the_routing_index_uses_salted_hashes():
    prompt = SYSTEM + [7] * 32
    a, b = hash_prompt_blocks(prompt, 16, "tenant:a"), hash_prompt_blocks(prompt, 16, "tenant:b")
    assert len(a) == len(b) == 18 and not set(a) & set(b)
    index = PrefixIndex()
    warm, cold = worker("warm", "prefill"), worker("cold", "prefill")
    # The warm worker's events carry tenant a's salted hashes, as its engine computed them.
    index.apply_event(warm.worker_id, "stored", hash_prompt_blocks(SYSTEM, 16, "tenant:a"))
    router = ScoringRouter(StaticPool(worker("d"), warm, cold), index)
    mine = router.route(prompt, 8, cache_salt="tenant:a")
    assert mine.prefill is warm and mine.cached_tokens == 256
    theirs = router.route(prompt, 8, cache_salt="tenant:b")
    assert theirs.cached_tokens == 0
    assert router.route(prompt, 8).cached_tokens == 0  # nor the unsalted (anonymous) chain


@pytest.fixture(params=["unkeyed", "keyed"])
def cache_gateway(request, gateway_factory, disagg_workers, tmp_path):
    """A gateway over the session's workers; "keyed": with a cluster secret (keyed salts)."""
    prefill, decode = disagg_workers
    path = tenants_file(tmp_path, {"a": {}, "b": {}, "g1": {"cache_group": "common"},
                                   "g2": {"cache_group": "common"}})
    extra = []
    if request.param == "keyed":
        secret = tmp_path / "cluster-secret"
        secret.write_text(f"{random.getrandbits(256):064x}\n")
        extra = ["--cluster-secret-file", str(secret)]
    return gateway_factory("--prefill", prefill.address, "--decode", decode.address,
                           "--tenants-file", path, *extra)


def _cached_tokens(gateway, model: str, tenant: str, prompt: list[int], **body) -> int:
    response = httpx.post(
        f"http://{gateway.address}/v1/completions", timeout=60,
        headers={"Authorization": f"Bearer sk-{tenant}"},
        json={"model": model, "prompt": prompt, "max_tokens": 1, "ignore_eos": True, **body})
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] == len(prompt)
    return usage["prompt_tokens_details"]["cached_tokens"]


def _hits(disagg_workers) -> tuple[int, int]:
    prefill, decode = disagg_workers
    return (worker_stats(prefill.address, "prefill").prefix_hits,
            worker_stats(decode.address).prefix_hits)


def test_another_tenants_cached_prefix_gives_no_cached_tokens_and_no_hits(
        cache_gateway, disagg_workers, tiny_llama_dir):
    model = tiny_llama_dir.name
    # A prompt no other test sends (the workers are shared by the session), 5 blocks + 3.
    prompt = random.Random().sample(range(100, 400), 83)
    assert _cached_tokens(cache_gateway, model, "a", prompt) == 0
    assert _cached_tokens(cache_gateway, model, "a", prompt) == 80  # a's blocks are cached
    before = _hits(disagg_workers)
    # Tenant b: nothing of a's counts, in its usage or in any worker's hit counters (the
    # numbers /metrics exports), so neither tells b what a has sent.
    assert _cached_tokens(cache_gateway, model, "b", prompt) == 0
    assert _hits(disagg_workers) == before
    assert _cached_tokens(cache_gateway, model, "b", prompt) == 80  # b's own second time
    # A shared cache group shares: g2 reuses what g1 cached, a's stays apart from both.
    assert _cached_tokens(cache_gateway, model, "g1", prompt) == 0
    assert _cached_tokens(cache_gateway, model, "g2", prompt) == 80


def test_a_cache_salt_in_the_body_shares_blocks_only_with_the_same_salt(
        cache_gateway, disagg_workers, tiny_llama_dir):
    """vLLM's cache_salt, end to end: within one tenant, only requests with the same salt
    read each other's cached blocks; another tenant with that salt reads none of them."""
    model = tiny_llama_dir.name
    prompt = random.Random().sample(range(100, 400), 83)
    assert _cached_tokens(cache_gateway, model, "a", prompt, cache_salt="x") == 0
    assert _cached_tokens(cache_gateway, model, "a", prompt, cache_salt="x") == 80
    assert _cached_tokens(cache_gateway, model, "a", prompt, cache_salt="y") == 0
    assert _cached_tokens(cache_gateway, model, "a", prompt) == 0  # the unsalted tenant cache
    assert _cached_tokens(cache_gateway, model, "b", prompt, cache_salt="x") == 0
    refused = httpx.post(f"http://{cache_gateway.address}/v1/completions", timeout=60,
                         headers={"Authorization": "Bearer sk-a"},
                         json={"model": model, "prompt": prompt, "cache_salt": ""})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "cache_salt"


def _kv_bytes_sent(prefill, before: float | None = None) -> float:
    """The prefill worker's KV bytes sent so far; with `before`, waits (up to 10 s) for the
    count to move past it: a sender counts a transfer once its last byte is written."""
    url = f"http://{prefill.field('metrics')}"
    deadline = time.monotonic() + 10
    while True:
        sent = scrape(url)['splitserve_kv_transfer_bytes_total{role="prefill"}']
        if before is None or sent > before or time.monotonic() > deadline:
            return sent
        time.sleep(0.02)


def test_the_decode_workers_cached_prefix_is_not_sent_again_but_never_across_tenants(
        cache_gateway, disagg_workers, tiny_llama_dir):
    """Through the gateway: tenant a's repeat ships only the block after the 5 the decode
    worker holds; tenant b's first send of the same prompt ships all 6 (a's blocks are not
    b's); usage's cached tokens stay the prefill worker's."""
    prefill, _ = disagg_workers
    model = tiny_llama_dir.name
    prompt = random.Random().sample(range(100, 400), 83)  # 5 blocks + 3
    sent = [_kv_bytes_sent(prefill)]
    for tenant, cached in (("a", 0), ("a", 80), ("b", 0)):
        assert _cached_tokens(cache_gateway, model, tenant, prompt) == cached
        sent.append(_kv_bytes_sent(prefill, sent[-1]))
    first, repeat, other = (b - a for a, b in zip(sent, sent[1:], strict=False))
    assert repeat * 6 == first
    assert other == first


def test_gateway_metrics_carry_no_cache_salt_or_block_hash(cache_gateway, tiny_llama_dir):
    prompt = random.Random().sample(range(100, 400), 40)
    for tenant in ("a", "b"):
        _cached_tokens(cache_gateway, tiny_llama_dir.name, tenant, prompt)
    metrics = httpx.get(f"http://{cache_gateway.admin_address}/metrics", timeout=10).text
    assert "tenant:" not in metrics and "group:" not in metrics
    for salt in ("tenant:a", "tenant:b"):
        assert not any(str(h) in metrics for h in hash_prompt_blocks(prompt, 16, salt))
    assert "cache" not in "".join(line for line in metrics.splitlines()
                                  if 'tenant="' in line and not line.startswith("#"))
