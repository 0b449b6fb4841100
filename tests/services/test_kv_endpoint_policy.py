"""Which decode_kv_endpoint a prefill worker accepts without a registry: the allow-list
syntax, this machine's addresses by default, and clear errors for bad entries. (The registry
path runs against real workers and Redis in test_worker_kv_security.py.)"""

from __future__ import annotations

import asyncio

import pytest

from services.prefill.kv_endpoints import KVEndpointPolicy, KVEndpointRefused, parse_allow_list


def accepts(policy: KVEndpointPolicy, endpoint: str) -> bool:
    try:
        asyncio.run(policy.check(endpoint))
    except KVEndpointRefused:
        return False
    return True


def test_without_registry_or_list_only_this_machine_is_accepted():
    policy = KVEndpointPolicy(local_hosts=("10.1.2.3",))
    assert accepts(policy, "127.0.0.1:5000") and accepts(policy, "[::1]:5000")
    assert accepts(policy, "10.1.2.3:5000")
    assert accepts(policy, "127.0.0.1:5000,127.0.0.1:5001")  # tensor-parallel ranks
    assert not accepts(policy, "10.9.9.9:5000")
    assert not accepts(policy, "127.0.0.1:5000,10.9.9.9:5001")  # every rank must pass
    assert policy.num_refused == 2


def test_an_allow_list_replaces_the_default_and_takes_exact_host_and_any_entries():
    policy = KVEndpointPolicy("10.0.0.5:7000, decode-0.svc:*")
    assert accepts(policy, "10.0.0.5:7000") and accepts(policy, "decode-0.svc:1")
    assert not accepts(policy, "10.0.0.5:7001") and not accepts(policy, "127.0.0.1:7000")
    assert accepts(KVEndpointPolicy("*"), "203.0.113.9:1")


@pytest.mark.parametrize("endpoint", ["", "no-port", "host:", ":80", "host:port"])
def test_a_malformed_endpoint_is_a_value_error_not_a_refusal(endpoint):
    with pytest.raises(ValueError):
        asyncio.run(KVEndpointPolicy().check(endpoint))


@pytest.mark.parametrize("entry", ["host", "host:abc", ":*"])
def test_a_bad_allow_list_entry_names_the_flag(entry):
    with pytest.raises(ValueError, match="--kv-allowed-endpoints"):
        parse_allow_list(entry)


def test_a_burst_for_a_decode_worker_that_just_registered_is_accepted_whole(redis_server):
    """Real Redis. The checks that miss share one registry read, and one that comes while the
    last read is too recent waits for the next rather than being refused; an endpoint nobody
    registered is still refused. (A new decode worker's first requests used to be refused when
    they arrived together: the autoscaler's scale-up test saw it.)"""
    import time

    import redis.asyncio as aioredis

    from services.common.registry import WORKER_KEY, WorkerInfo

    async def run():
        policy = KVEndpointPolicy(redis_url=redis_server, refresh_s=0.3)
        with pytest.raises(KVEndpointRefused):
            await policy.check("10.1.2.3:4000")  # nobody yet; this read is the last for 0.3 s
        client = aioredis.from_url(redis_server)
        info = WorkerInfo("decode-new", "decode", "10.1.2.3:5000", "10.1.2.3:4000", "m", 16,
                          2048, updated=time.time())
        await client.set(WORKER_KEY + info.worker_id, info.to_json(), px=10_000)
        await client.aclose()
        results = await asyncio.gather(*(policy.check("10.1.2.3:4000") for _ in range(20)),
                                       return_exceptions=True)
        assert results == [None] * 20
        with pytest.raises(KVEndpointRefused):
            await policy.check("10.9.9.9:4000")
        return policy.num_refused

    assert asyncio.run(run()) == 2
