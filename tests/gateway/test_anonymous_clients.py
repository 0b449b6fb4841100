"""Fair service between clients when there are no API keys: each client address is a share of
the fair queue of its own (an IPv6 client's /64), so one client's flood leaves the others
their share as a tenant's would; X-Forwarded-For names the client only from a trusted proxy.

The spec-level tests run admission over a scripted pool (admission_harness); the last ones
run a real gateway over real workers, with clients on distinct loopback addresses
(127.0.0.1 and 127.0.0.2)."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import httpx
import pytest
from admission_harness import FakePool, spec
from splitserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

from services.gateway.admission.admission import Admission
from services.gateway.admission.capacity import CapacityRule, ClusterRoom
from services.gateway.admission.fair_queue import IDLE_COUNTERS, FairQueue
from services.gateway.admission.quota import Quotas
from services.gateway.admission.tenants import Tenant, TenantDirectory
from services.gateway.admission.ttft_estimator import TTFTEstimator
from services.gateway.api.client_address import ClientAddresses, grpc_peer_host

ANON = Tenant()


def _admission(per_client: bool = True, keys: dict | None = None, max_inflight: int = 2,
               tenants=(ANON,)) -> Admission:
    directory = TenantDirectory(tenants, keys or {})
    return Admission(directory, Quotas(), FairQueue(), ClusterRoom(
        CapacityRule(max_inflight=max_inflight), FakePool()), TTFTEstimator(), 0.0,
        per_client=per_client)


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


# -- who the client is --------------------------------------------------------------------


def test_the_peer_is_the_client_and_an_untrusted_peers_forwarded_for_is_ignored():
    clients = ClientAddresses()
    assert clients.client("10.1.2.3") == "10.1.2.3"
    assert clients.client("10.1.2.3", ["203.0.113.9"]) == "10.1.2.3"
    assert clients.client(None) == "" and clients.client("unix-socket") == ""


def test_a_trusted_proxys_forwarded_for_names_the_client_up_to_the_first_untrusted_hop():
    clients = ClientAddresses(["10.0.0.0/8", "192.168.1.5"])
    assert clients.client("10.0.0.7", ["203.0.113.9"]) == "203.0.113.9"
    # Two proxies of ours: the client is the hop before them; what it wrote itself is not.
    assert clients.client("10.0.0.7", ["6.6.6.6, 203.0.113.9, 192.168.1.5"]) == "203.0.113.9"
    assert clients.client("10.0.0.7", ["6.6.6.6", "203.0.113.9:4711"]) == "203.0.113.9"
    assert clients.client("10.0.0.7", []) == "10.0.0.7"  # no header: the proxy itself
    assert clients.client("10.0.0.7", ["not-an-address"]) == "10.0.0.7"
    assert ClientAddresses(["*"]).client("8.8.8.8", ["203.0.113.9"]) == "203.0.113.9"


def test_ipv6_clients_count_by_their_64_and_mapped_ipv4_as_ipv4():
    clients = ClientAddresses()
    assert clients.client("2001:db8:1:2::17") == "2001:db8:1:2::17"  # the log has the address
    assert clients.client("[2001:db8:1:2:ffff::1]:443") == "2001:db8:1:2:ffff::1"
    admission = _admission()
    assert admission.share_of(ANON, "2001:db8:1:2::17") == admission.share_of(
        ANON, "2001:db8:1:2:ffff::1") == "anonymous/2001:db8:1:2::/64"
    assert admission.share_of(ANON, "2001:db8:1:3::17") == "anonymous/2001:db8:1:3::/64"
    assert clients.client("::ffff:10.1.2.3") == "10.1.2.3"


def test_a_gateway_listening_on_ipv6_any_trusts_an_ipv4_proxy():
    """On "::" (the chart's listenHost) IPv4 peers arrive as ::ffff:a.b.c.d: the trusted
    IPv4 networks must still match them, and hops written so in the header too (an audit
    found the header ignored, every client behind the ingress one share)."""
    clients = ClientAddresses(["10.0.0.0/8"])
    assert clients.client("::ffff:10.0.0.5", ["1.2.3.4"]) == "1.2.3.4"
    assert clients.client("::ffff:10.0.0.5", ["1.2.3.4, ::ffff:10.0.0.9"]) == "1.2.3.4"


def test_grpc_peer_strings():
    assert grpc_peer_host("ipv4:127.0.0.1:51234") == "127.0.0.1"
    assert grpc_peer_host("ipv6:[::1]:51234") == "::1"
    assert grpc_peer_host("ipv6:%5B::1%5D:51234") == "::1"
    assert grpc_peer_host("unix:/tmp/socket") == ""


def test_a_bad_trusted_proxy_entry_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--forwarded-allow-ips: 'nope'"):
        ClientAddresses(["nope"])


# -- shares -------------------------------------------------------------------------------


def test_each_client_is_a_share_only_while_authentication_is_off():
    assert _admission().share_of(ANON, "10.1.2.3") == "anonymous/10.1.2.3"
    assert _admission().share_of(ANON, "") == "anonymous"
    assert _admission(per_client=False).share_of(ANON, "10.1.2.3") == "anonymous"
    acme = Tenant("acme")
    keyed = _admission(keys={"d" * 64: "acme"}, tenants=(acme,))
    assert keyed.share_of(acme, "10.1.2.3") == "acme"


@pytest.mark.parametrize("per_client", [True, False])
def test_a_client_crowded_out_by_anothers_flood_is_served_at_once(per_client):
    """Client A holds both in-flight slots and has more waiting; client B's one request is
    released at once, owed its share, when clients are shares (and waits behind A's backlog,
    first come first served, when all anonymous traffic is one share)."""
    async def scenario():
        admission = _admission(per_client)
        a = admission.share_of(ANON, "10.0.0.1")
        b = admission.share_of(ANON, "10.0.0.2")
        running = [await admission.admit(ANON, [spec()], 10, a) for _ in range(2)]
        waiting = [asyncio.create_task(admission.admit(ANON, [spec()], 10, a)) for _ in range(3)]
        await _settle()
        b_task = asyncio.create_task(admission.admit(ANON, [spec()], 10, b))
        await _settle()
        served_at_once = b_task.done()
        queued = admission.queue.by_tenant()["anonymous"][0]
        for task in [*waiting, b_task]:
            if task.done():
                task.result().release()
            task.cancel()
        await asyncio.gather(*waiting, b_task, return_exceptions=True)
        for ticket in running:
            ticket.release()
        return served_at_once, queued

    served_at_once, queued = asyncio.run(scenario())
    assert served_at_once is per_client
    assert queued == (3 if per_client else 4)


def test_clients_of_one_tenant_alternate_in_the_queue():
    queue = FairQueue()
    entries = [_Entry(f"anonymous/10.0.0.{1 + i // 4}", f"{i // 4}.{i % 4}") for i in range(8)]
    for entry in entries:
        queue.push(entry)
    order = []
    while len(queue):
        entry = queue.peek()
        queue.pop(entry)
        order.append(entry.name)
    assert order == ["0.0", "1.0", "0.1", "1.1", "0.2", "1.2", "0.3", "1.3"]


def test_idle_clients_counters_are_forgotten_past_a_bound():
    """Every address ever seen is a share: the counters of idle ones are kept to a bound."""
    queue = FairQueue()
    for i in range(IDLE_COUNTERS + 500):
        entry = _Entry(f"anonymous/10.{i >> 16}.{(i >> 8) & 255}.{i & 255}", "x")
        queue.push(entry)
        queue.pop(entry)
        queue.finished(entry)
    assert len(queue.counters) == IDLE_COUNTERS and not queue.running


class _Entry:
    def __init__(self, share: str, name: str) -> None:
        self.tenant, self.share, self.name = ANON, share, name
        self.prompt_tokens, self.max_output_tokens, self.slots, self.seq = 10, 10, 1, 0


# -- a real gateway -------------------------------------------------------------------------

FLOOD, LONG_TOKENS = 6, 480


async def _stream(url: str, local: str, body: dict, started: asyncio.Queue | None = None) -> dict:
    """One streamed completion from local address `local`: status, first-token and end times
    (and a put on `started` at its first token)."""
    transport = httpx.AsyncHTTPTransport(local_address=local)
    async with httpx.AsyncClient(transport=transport, timeout=60) as client:
        async with client.stream("POST", f"{url}/v1/completions",
                                 json={**body, "stream": True}) as response:
            first = None
            async for line in response.aiter_lines():
                if first is None and line.startswith("data: {"):
                    first = time.monotonic()
                    if started is not None:
                        started.put_nowait(first)
            return {"status": response.status_code, "first": first, "end": time.monotonic()}


async def _flood_then_one(url: str, model: str) -> tuple[list[dict], dict]:
    long = {"model": model, "prompt": "flood", "max_tokens": LONG_TOKENS, "ignore_eos": True}
    started: asyncio.Queue = asyncio.Queue()
    flood = [asyncio.create_task(_stream(url, "127.0.0.1", long, started))
             for _ in range(FLOOD)]
    for _ in range(2):  # the flood holds both slots, the rest of it waits
        await asyncio.wait_for(started.get(), 30)
    short = await _stream(url, "127.0.0.2", {"model": model, "prompt": "hi", "max_tokens": 4})
    return await asyncio.gather(*flood), short


@pytest.mark.parametrize("mode", ["client", "none"])
def test_one_clients_flood_leaves_another_client_served_at_once(disagg_workers, gateway_factory,
                                                                tiny_llama_dir, mode):
    """Client 127.0.0.1 opens six long streams at a gateway whose in-flight limit is two (the
    one change from the defaults: so that the flood holds every slot); then client 127.0.0.2
    asks for four tokens. As its own share it is owed a slot and done while the flood's first
    streams still run; with --anonymous-fairness none it is one more request of the flood's
    share, served after them (or refused under the TTFT target)."""
    prefill, decode = disagg_workers
    gateway = gateway_factory("--prefill", prefill.address, "--decode", decode.address,
                              "--max-inflight-per-decode", "2", "--anonymous-fairness", mode)
    flood, short = asyncio.run(_flood_then_one(f"http://{gateway.address}", tiny_llama_dir.name))
    served = [r for r in flood if r["status"] == 200]
    assert served, flood
    first_done = min(r["end"] for r in served)
    if mode == "client":
        assert short["status"] == 200 and short["end"] < first_done, (short, flood)
    else:
        assert short["status"] == 503 or short["end"] > first_done, (short, flood)


def test_the_access_log_names_the_client_a_trusted_proxy_forwarded_for(disagg_workers,
                                                                      gateway_factory,
                                                                      tiny_llama_dir):
    prefill, decode = disagg_workers
    gateways = {trust: gateway_factory("--prefill", prefill.address, "--decode", decode.address,
                                       *(["--forwarded-allow-ips", "127.0.0.1"] if trust else []))
                for trust in (True, False)}
    for trust, gateway in gateways.items():
        response = httpx.post(f"http://{gateway.address}/v1/completions", timeout=30,
                              headers={"x-forwarded-for": "203.0.113.9",
                                       "x-request-id": f"xff-{trust}"},
                              json={"model": tiny_llama_dir.name, "prompt": "hi",
                                    "max_tokens": 2})
        assert response.status_code == 200
        with grpc.insecure_channel(gateway.field("grpc")) as channel:
            list(gateway_pb2_grpc.GatewayStub(channel).Generate(gateway_pb2.GenerateTextRequest(
                text="hi", request_id=f"xff-{trust}-grpc",
                sampling=common_pb2.SamplingParams(max_tokens=2)),
                metadata=(("x-forwarded-for", "203.0.113.9"),), timeout=60))
    for trust, gateway in gateways.items():
        for api in ("http", "grpc"):
            deadline = time.monotonic() + 10
            while not (entries := [e for e in _access_log(gateway) if e["api"] == api
                                   and e["request_id"].startswith(f"xff-{trust}")]):
                assert time.monotonic() < deadline, gateway.output()
                time.sleep(0.1)
            assert entries[0]["client"] == ("203.0.113.9" if trust else "127.0.0.1"), api


def _access_log(gateway) -> list[dict]:
    entries = [json.loads(line) for line in list(gateway.lines) if line.startswith("{")]
    return [e for e in entries if e.get("logger") == "splitserve.access"]


def test_the_flags_are_read_and_bad_values_refused_at_start(tiny_llama_dir, monkeypatch):
    import argparse

    from services.gateway.config import (
        GatewayConfig,
        add_gateway_arguments,
        gateway_config_from_args,
    )

    monkeypatch.setenv("SPLITSERVE_GATEWAY_FORWARDED_ALLOW_IPS", "10.0.0.0/8, 192.168.1.5")
    parser = argparse.ArgumentParser()
    add_gateway_arguments(parser)
    config = gateway_config_from_args(parser.parse_args(
        ["--model", str(tiny_llama_dir), "--worker", "a:1", "--anonymous-fairness", "none"]))
    assert config.forwarded_allow_ips == ("10.0.0.0/8", "192.168.1.5")
    assert config.anonymous_fairness == "none"
    assert GatewayConfig(model=str(tiny_llama_dir), worker=("a:1",)).anonymous_fairness == "client"
    with pytest.raises(ValueError, match="--anonymous-fairness must be client or none"):
        GatewayConfig(model=str(tiny_llama_dir), worker=("a:1",), anonymous_fairness="ip")
    with pytest.raises(ValueError, match="--forwarded-allow-ips: '10.0.0.300'"):
        GatewayConfig(model=str(tiny_llama_dir), worker=("a:1",),
                      forwarded_allow_ips=("10.0.0.300",))


@pytest.mark.parametrize("policy", ["vtc", "round_robin", "fcfs"])
def test_the_one_pass_owed_scan_answers_as_within_share_head_by_head(policy):
    """FairQueue.owed replaced a within_share call per waiting head, each a pass over every
    share (N² a drain: 1 s at 2,000 clients); it must say yes to exactly the same heads."""
    import random

    rng = random.Random(7)
    tenants = [Tenant("anonymous"), Tenant("gold", weight=2.0, priority=1),
               Tenant("lite", weight=0.5)]
    for _ in range(200):
        queue = FairQueue(policy)
        for i in range(rng.randint(1, 30)):
            tenant = rng.choice(tenants)
            share = f"{tenant.name}/10.0.0.{i % 12}" if tenant.name == "anonymous" else tenant.name
            entry = _Entry(share, str(i))
            entry.tenant, entry.slots = tenant, rng.choice((1, 1, 2))
            queue.push(entry)
            if rng.random() < 0.4:  # released, and some of it charged and finished
                queue.pop(entry)
                queue.charge_output(entry, rng.randint(0, 50))
                if rng.random() < 0.3:
                    queue.finished(entry)
        limit = rng.choice((0, 2, 8, 64))
        expected = [h for h in queue.heads() if queue.within_share(h, limit)]
        assert queue.owed(limit) == expected
