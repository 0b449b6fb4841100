"""The chart turns the internal plane on by default: every gateway and worker pod mounts the
internal TLS Secret and the cluster secret and is pointed at their files, the Secrets exist (or
are the operator's, or cert-manager's), and the certificate the chart generates is one a real
worker serves and a client checking `serverName` accepts, while a client checking the pod's IP
refuses it (so the gateway must be, and is, given the name)."""

from __future__ import annotations

import base64

import grpc
import helm_python as helm
import pytest
from chart_render import RELEASE, SCENARIOS, render, render_scenario, worker_deployments
from splitserve.v1 import common_pb2, decode_pb2_grpc

from services.common.security import TLSFiles, sync_channel
from splitserve_cli.processes import start_worker

FULLNAME = f"{RELEASE}-splitserve"
PODS = ("gateway", "prefill", "decode")
FILES = {"SPLITSERVE_TLS_CERT": "/etc/splitserve/tls/tls.crt",
         "SPLITSERVE_TLS_KEY": "/etc/splitserve/tls/tls.key",
         "SPLITSERVE_TLS_CA": "/etc/splitserve/tls/ca.crt",
         "SPLITSERVE_CLUSTER_SECRET_FILE": "/etc/splitserve/cluster/secret"}


def _pod(rendered, component: str) -> dict:
    return rendered.get("Deployment", f"{FULLNAME}-{component}")["spec"]["template"]["spec"]


def _mounted_file(pod: dict, path: str) -> tuple[str, str]:
    """(Secret name, key) that `path` in the pod's container comes from."""
    container = pod["containers"][0]
    volumes = {v["name"]: v for v in pod["volumes"]}
    for mount in container["volumeMounts"]:
        folder = mount["mountPath"].rstrip("/") + "/"
        if path.startswith(folder):
            secret = volumes[mount["name"]]["secret"]
            item = next(i for i in secret["items"] if i["path"] == path.removeprefix(folder))
            return secret["secretName"], item["key"]
    raise AssertionError(f"{path} is not mounted")


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_pod_reads_tls_and_the_cluster_secret_from_rendered_secrets(scenario: str) -> None:
    rendered = render_scenario(scenario)
    components = ["gateway"] + [name.removeprefix(f"{FULLNAME}-")
                                for name in worker_deployments(rendered)]
    for component in components:
        pod = _pod(rendered, component)
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        for name, path in FILES.items():
            assert env[name] == path, (component, name)
            secret, key = _mounted_file(pod, path)
            assert key in rendered.get("Secret", secret)["data"], (component, secret, key)
        assert ("SPLITSERVE_TLS_SERVER_NAME" in env) == (component == "gateway")
    assert rendered.get("Secret", f"{FULLNAME}-internal-tls")["type"] == "kubernetes.io/tls"
    secret = rendered.get("Secret", f"{FULLNAME}-cluster-secret")["data"]["cluster-secret"]
    assert len(base64.b64decode(secret)) == 64


def test_operator_secrets_and_cert_manager_replace_the_generated_ones() -> None:
    rendered = render({"security": {"tls": {"existingSecret": "my-tls"},
                                    "clusterSecret": {"existingSecret": "my-secret",
                                                      "secretKey": "k"}}})
    assert not rendered.names("Secret") & {f"{FULLNAME}-internal-tls", f"{FULLNAME}-cluster-secret"}
    pod = _pod(rendered, "decode")
    assert _mounted_file(pod, FILES["SPLITSERVE_TLS_CA"]) == ("my-tls", "ca.crt")
    assert _mounted_file(pod, FILES["SPLITSERVE_CLUSTER_SECRET_FILE"]) == ("my-secret", "k")

    rendered = render({"security": {"tls": {"certManager": {
        "enabled": True, "issuerRef": {"name": "internal-ca", "kind": "ClusterIssuer",
                                       "group": "cert-manager.io"}}}}})
    certificate = rendered.get("Certificate", f"{FULLNAME}-internal-tls")["spec"]
    assert certificate["secretName"] == f"{FULLNAME}-internal-tls"
    assert {"server auth", "client auth"} <= set(certificate["usages"])
    assert "splitserve-internal" in certificate["dnsNames"]
    assert f"{FULLNAME}-internal-tls" not in rendered.names("Secret")
    with pytest.raises(helm.HelmError, match="issuerRef.name"):
        render({"security": {"tls": {"certManager": {"enabled": True}}}})


def test_the_autoscaler_reads_the_cluster_secret_and_no_tls_key() -> None:
    """It counts only registry entries the workers signed (services/autoscaler/sources.py);
    it dials no worker over gRPC, so the TLS key is not mounted there."""
    pod = _pod(render({}), "autoscaler")
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    path = FILES["SPLITSERVE_CLUSTER_SECRET_FILE"]
    assert env["SPLITSERVE_CLUSTER_SECRET_FILE"] == path
    assert _mounted_file(pod, path) == (f"{FULLNAME}-cluster-secret", "cluster-secret")
    assert not {"SPLITSERVE_TLS_KEY", "SPLITSERVE_TLS_CERT"} & set(env)
    off = _pod(render({"security": {"clusterSecret": {"enabled": False}}}), "autoscaler")
    assert "SPLITSERVE_CLUSTER_SECRET_FILE" not in {e["name"] for e in off["containers"][0]["env"]}


def test_tls_and_the_secret_can_be_turned_off() -> None:
    rendered = render({"security": {"tls": {"enabled": False},
                                    "clusterSecret": {"enabled": False}}})
    for component in PODS:
        env = {e["name"] for e in _pod(rendered, component)["containers"][0]["env"]}
        assert not env & set(FILES)


def test_the_generated_certificate_serves_a_real_worker_under_its_server_name(
        tiny_llama_dir, tmp_path) -> None:
    data = render_scenario("default").get("Secret", f"{FULLNAME}-internal-tls")["data"]
    for key in ("tls.crt", "tls.key", "ca.crt"):
        (tmp_path / key).write_bytes(base64.b64decode(data[key]))
    files = TLSFiles(str(tmp_path / "tls.crt"), str(tmp_path / "tls.key"), str(tmp_path / "ca.crt"))
    env = {"SPLITSERVE_TLS_CERT": files.cert, "SPLITSERVE_TLS_KEY": files.key,
           "SPLITSERVE_TLS_CA": files.ca}
    worker = start_worker("decode", tiny_llama_dir, "--num-kv-blocks", "32", env=env)
    try:
        named = TLSFiles(files.cert, files.key, files.ca, server_name="splitserve-internal")
        with sync_channel(worker.address, named) as channel:
            health = decode_pb2_grpc.DecodeStub(channel).Health(common_pb2.HealthRequest(),
                                                                timeout=10)
        assert health.status == common_pb2.HealthResponse.SERVING
        with sync_channel(worker.address, files) as channel, pytest.raises(grpc.RpcError):
            decode_pb2_grpc.DecodeStub(channel).Health(common_pb2.HealthRequest(), timeout=5)
    finally:
        worker.kill()


def test_the_gateways_admin_port_is_in_a_cluster_ip_service_of_its_own() -> None:
    """With the gateway Service a LoadBalancer, its admin port (/metrics, /ready with worker
    addresses) was on the internet unless networkPolicy.metricsFrom was set."""
    rendered = render({"gateway": {"service": {"type": "LoadBalancer"}}})
    public = rendered.get("Service", f"{FULLNAME}-gateway")["spec"]
    assert public["type"] == "LoadBalancer"
    assert {p["name"] for p in public["ports"]} == {"http", "grpc"}
    admin = rendered.get("Service", f"{FULLNAME}-gateway-metrics")["spec"]
    assert admin["type"] == "ClusterIP" and [p["name"] for p in admin["ports"]] == ["metrics"]

