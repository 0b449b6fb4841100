"""Mutual TLS on the internal plane, with real processes: TLS workers serve a TLS gateway (HTTP
and its gRPC front door with client certificates), and a plaintext caller, a caller with no
certificate and a caller (or a worker) whose certificate comes from another CA are refused,
while the workers keep serving."""

from __future__ import annotations

import os
from concurrent import futures

import grpc
import httpx
import pytest
from gateway_processes import WORKER_FLAGS, ServiceProcess
from registry_cluster import wait_until
from splitserve.v1 import (
    common_pb2,
    decode_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    prefill_pb2_grpc,
)

from services.common.security import TLSFiles, sync_channel
from splitserve_cli.dev_certs import make_pki

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pki")
    return make_pki(folder, "cluster"), make_pki(folder, "rogue")


@pytest.fixture(scope="module")
def tls_stack(tiny_llama_dir, pki):
    cluster, _ = pki
    env = {**os.environ, **cluster.env()}
    started = []
    try:
        for role in ("prefill", "decode"):
            started.append(ServiceProcess(role, [
                "worker", "--role", role, "--model", str(tiny_llama_dir), "--port", "0",
                *WORKER_FLAGS, "--log-format", "text"], env=env))
        prefill, decode = (p.wait_ready() for p in started)
        gateway = ServiceProcess("gateway", [
            "gateway", "--model", str(tiny_llama_dir), "--port", "0", "--grpc-port", "0",
            "--health-interval-s", "0.2", "--grpc-client-certs", "true",
            "--prefill", prefill.address, "--decode", decode.address], env=env)
        started.append(gateway)
        gateway.wait_ready()
        yield prefill, decode, gateway
    finally:
        for process in started:
            process.stop()


def _health(address: str, channel: grpc.Channel) -> common_pb2.HealthResponse:
    with channel:
        return decode_pb2_grpc.DecodeStub(channel).Health(common_pb2.HealthRequest(), timeout=5)


def _front_door_text(address: str, tls: TLSFiles | None) -> str:
    with sync_channel(address, tls) as channel:
        responses = gateway_pb2_grpc.GatewayStub(channel).Generate(gateway_pb2.GenerateTextRequest(
            text="The old library", sampling=common_pb2.SamplingParams(
                max_tokens=8, temperature=0.0, has_temperature=True, ignore_eos=True)),
            timeout=30)
        return "".join(r.text for r in responses)


def _complete(gateway: ServiceProcess, model: str) -> httpx.Response:
    return httpx.post(f"http://{gateway.address}/v1/completions", timeout=60, json={
        "model": model, "prompt": "The old library", "max_tokens": 8, "temperature": 0,
        "ignore_eos": True})


def _refused(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def _tls(files) -> TLSFiles:
    return TLSFiles(str(files.cert), str(files.key), str(files.ca))


def _no_cert_channel(address: str, ca) -> grpc.Channel:
    """TLS that checks the server against the cluster CA but shows no certificate of its own."""
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(ca.read_bytes()))


def test_tls_workers_serve_a_tls_gateway_over_http_and_the_grpc_front_door(tls_stack, pki,
                                                                         tiny_llama_dir):
    prefill, decode, gateway = tls_stack
    cluster, _ = pki
    response = _complete(gateway, tiny_llama_dir.name)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 8
    assert _front_door_text(gateway.field("grpc"), _tls(cluster)) == \
        response.json()["choices"][0]["text"]
    assert "tls=mtls" in decode.output() and "tls=mtls" in prefill.output()
    health = _health(decode.address, sync_channel(decode.address, _tls(cluster)))
    assert health.stats.steps > 0  # the decode worker did the work, over the TLS hop


def test_plaintext_callers_are_refused_and_the_workers_keep_serving(tls_stack, pki,
                                                                    tiny_llama_dir):
    prefill, decode, gateway = tls_stack
    cluster, _ = pki
    for worker in (prefill, decode):
        stub = prefill_pb2_grpc.PrefillStub if worker is prefill else decode_pb2_grpc.DecodeStub
        with grpc.insecure_channel(worker.address) as channel:
            assert _refused(lambda: stub(channel).Health(  # noqa: B023
                common_pb2.HealthRequest(), timeout=5)) == grpc.StatusCode.UNAVAILABLE
    assert _refused(lambda: _front_door_text(gateway.field("grpc"), None)) == \
        grpc.StatusCode.UNAVAILABLE
    assert prefill.alive() and decode.alive()
    assert _complete(gateway, tiny_llama_dir.name).status_code == 200


def test_certificates_from_another_ca_or_none_are_refused(tls_stack, pki, tiny_llama_dir):
    prefill, decode, gateway = tls_stack
    cluster, rogue = pki
    # Trusts the cluster CA (so the server's certificate checks out) but presents the rogue's.
    foreign = TLSFiles(str(rogue.cert), str(rogue.key), str(cluster.ca))
    for address in (decode.address, prefill.address):
        assert _refused(lambda: _health(address, sync_channel(address, foreign))) == \
            grpc.StatusCode.UNAVAILABLE  # noqa: B023
        assert _refused(lambda: _health(address, _no_cert_channel(address, cluster.ca))) == \
            grpc.StatusCode.UNAVAILABLE  # noqa: B023
    assert _refused(lambda: _front_door_text(gateway.field("grpc"), foreign)) == \
        grpc.StatusCode.UNAVAILABLE
    with _no_cert_channel(gateway.field("grpc"), cluster.ca) as channel:
        assert _refused(lambda: list(gateway_pb2_grpc.GatewayStub(channel).Generate(
            gateway_pb2.GenerateTextRequest(text="hi"), timeout=10))) == \
            grpc.StatusCode.UNAVAILABLE
    # A rogue trusting only its own CA cannot accept the cluster's server certificate either.
    assert _refused(lambda: _health(decode.address, sync_channel(decode.address, _tls(rogue)))) \
        == grpc.StatusCode.UNAVAILABLE
    assert _complete(gateway, tiny_llama_dir.name).status_code == 200


class _CountingDecode(decode_pb2_grpc.DecodeServicer):
    """A decode worker impostor in this process: it answers Health as SERVING and counts every
    RPC that reaches it."""

    def __init__(self) -> None:
        self.calls = 0

    def Health(self, request, context):
        self.calls += 1
        return common_pb2.HealthResponse(status=common_pb2.HealthResponse.SERVING, role="decode",
                                         model="tiny", worker_id="impostor", block_size=16,
                                         max_model_len=512, stats=common_pb2.WorkerStats(
                                             kv_blocks_total=4096, kv_blocks_free=4096))

    def Generate(self, request, context):
        self.calls += 1
        context.abort(grpc.StatusCode.INTERNAL, "an impostor got a prompt")


def test_gateway_never_routes_to_a_worker_whose_certificate_is_from_another_ca(
        tls_stack, pki, tiny_llama_dir):
    prefill, decode, _ = tls_stack
    cluster, rogue = pki
    impostor = _CountingDecode()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    decode_pb2_grpc.add_DecodeServicer_to_server(impostor, server)
    # It would even accept the gateway's certificate: only its own is wrong.
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(
        [(rogue.key.read_bytes(), rogue.cert.read_bytes())]))
    server.start()
    gateway = ServiceProcess("gateway", [
        "gateway", "--model", str(tiny_llama_dir), "--port", "0", "--health-interval-s", "0.2",
        "--prefill", prefill.address, "--decode", f"{decode.address},127.0.0.1:{port}"],
        env={**os.environ, **cluster.env()})
    try:
        gateway.wait_ready()
        ready_url = f"http://{gateway.field('admin') or gateway.address}/ready"
        workers = lambda: httpx.get(ready_url, timeout=10).json()["workers"]  # noqa: E731
        wait_until(lambda: any(w["address"] == decode.address and w["routable"] for w in workers()),
                   what="the genuine decode worker routable")
        for _ in range(6):
            assert _complete(gateway, tiny_llama_dir.name).status_code == 200
        assert not next(w for w in workers() if w["address"].endswith(f":{port}"))["routable"]
        assert impostor.calls == 0
    finally:
        gateway.stop()
        server.stop(0)


def test_a_renewed_certificate_reaches_a_running_worker(tiny_llama_dir, tmp_path):
    old, new = make_pki(tmp_path / "old", "old"), make_pki(tmp_path / "new", "new")
    live = tmp_path / "live"
    live.mkdir()

    def install(files) -> None:  # as a Secret update lands: each file replaced whole
        for source, name in ((files.cert, "tls.crt"), (files.key, "tls.key"), (files.ca, "ca.crt")):
            (live / f".{name}").write_bytes(source.read_bytes())
            os.replace(live / f".{name}", live / name)

    install(old)
    mounted = TLSFiles(str(live / "tls.crt"), str(live / "tls.key"), str(live / "ca.crt"))
    env = {**os.environ, "SPLITSERVE_TLS_CERT": mounted.cert, "SPLITSERVE_TLS_KEY": mounted.key,
           "SPLITSERVE_TLS_CA": mounted.ca}
    worker = ServiceProcess("decode", ["worker", "--role", "decode", "--model", str(tiny_llama_dir),
                                       "--port", "0", *WORKER_FLAGS], env=env).wait_ready()
    try:
        address = worker.address
        assert _health(address, sync_channel(address, _tls(old))).status == \
            common_pb2.HealthResponse.SERVING
        assert _refused(lambda: _health(address, sync_channel(address, _tls(new)))) == \
            grpc.StatusCode.UNAVAILABLE
        install(new)
        assert _health(address, sync_channel(address, _tls(new))).status == \
            common_pb2.HealthResponse.SERVING
        assert _refused(lambda: _health(address, sync_channel(address, _tls(old)))) == \
            grpc.StatusCode.UNAVAILABLE
    finally:
        worker.stop()
