"""worker.openaiPort: in mode aggregated every role-both worker pod serves the OpenAI API on its
own port (--openai-port by environment), named `openai` on the container, the headless Service
and the NetworkPolicy; off by default; refused in mode disaggregated."""

from __future__ import annotations

import helm_python as helm
import pytest
from chart_render import RELEASE, render

FULLNAME = f"{RELEASE}-splitserve"
AGGREGATED = {"mode": "aggregated", "autoscaler": {"enabled": False}}


def worker_container(rendered) -> dict:
    deployment = rendered.get("Deployment", f"{FULLNAME}-worker")
    return deployment["spec"]["template"]["spec"]["containers"][0]


def test_openai_port_reaches_the_worker_its_service_and_network_policy() -> None:
    rendered = render({**AGGREGATED, "worker": {"openaiPort": 8000}})
    container = worker_container(rendered)
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["SPLITSERVE_OPENAI_PORT"] == "8000"
    assert {"name": "openai", "containerPort": 8000, "protocol": "TCP"} in container["ports"]
    service = rendered.get("Service", f"{FULLNAME}-worker")
    assert {"name": "openai", "port": 8000, "targetPort": "openai",
            "protocol": "TCP"} in service["spec"]["ports"]
    policy = rendered.get("NetworkPolicy", f"{FULLNAME}-worker")
    # Open like the gateway's API port: the endpoint picker's proxy is not a pod of this release.
    assert {"ports": [{"port": "openai", "protocol": "TCP"}]} in policy["spec"]["ingress"]


def test_a_workers_openai_port_holds_clients_to_the_gateways_api_keys_and_tenants() -> None:
    """The worker's endpoint is a gateway of its own, configured from SPLITSERVE_GATEWAY_*:
    without the keys and tenants there it served anyone who reached the pod, past the API
    keys, quotas and fair share the gateway holds clients to."""
    tenants = {"acme": {"keys": ["sk-acme"], "weight": 2}}
    rendered = render({**AGGREGATED, "worker": {"openaiPort": 8000},
                       "gateway": {"apiKeys": {"existingSecret": "keys"}, "tenants": tenants}})
    container = worker_container(rendered)
    env = {e["name"]: e for e in container["env"]}
    assert env["SPLITSERVE_GATEWAY_API_KEYS_FILE"]["value"] == "/etc/splitserve/api-keys/keys"
    assert env["SPLITSERVE_TENANTS_FILE"]["value"] == "/etc/splitserve/tenants/tenants.yaml"
    for name in ("tenants", "api-keys"):
        assert {"name": name, "mountPath": f"/etc/splitserve/{name}",
                "readOnly": True} in container["volumeMounts"]
    pod = rendered.get("Deployment", f"{FULLNAME}-worker")["spec"]["template"]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["tenants"]["configMap"]["name"] == f"{FULLNAME}-tenants"
    assert volumes["api-keys"]["secret"]["secretName"] == "keys"
    # Both are re-read in place (tests/gateway/test_tenants_reload.py): a rotated key or an
    # edited quota restarts no GPU worker.
    assert not any(a.startswith("checksum/")
                   for a in pod["metadata"].get("annotations", {}))
    # Without its own port a worker gets neither.
    quiet = worker_container(render({**AGGREGATED, "gateway": {
        "apiKeys": {"existingSecret": "keys"}, "tenants": tenants}}))
    names = {e["name"] for e in quiet["env"]}
    assert not names & {"SPLITSERVE_GATEWAY_API_KEYS_FILE", "SPLITSERVE_TENANTS_FILE"}
    assert not {"api-keys", "tenants"} & {m["name"] for m in quiet["volumeMounts"]}


@pytest.mark.parametrize("values", [AGGREGATED, {}])
def test_openai_port_is_off_by_default(values: dict) -> None:
    rendered = render(values)
    assert "SPLITSERVE_OPENAI_PORT" not in str(rendered.objects)
    assert "openai" not in str([o["spec"].get("ports") for o in rendered.of_kind("Service")])


def test_openai_port_is_refused_without_aggregated_workers() -> None:
    with pytest.raises(helm.HelmError, match="worker.openaiPort serves whole requests"):
        render({"worker": {"openaiPort": 8000}})


@pytest.mark.parametrize("port", [-1, 70000, "8000"])
def test_schema_rejects_a_bad_openai_port(port) -> None:
    with pytest.raises(helm.HelmError):
        render({**AGGREGATED, "worker": {"openaiPort": port}})
