"""What the pod templates carry for a cluster's operators: labels that a chart release alone
does not change, memory requested as its limit, the serving pods' service account, the gateways'
spread over nodes, and a pool's own pod annotations (a chart audit, December 7)."""

from __future__ import annotations

import pytest
from chart_render import (
    RELEASE,
    SCENARIOS,
    pod_templates,
    render,
    render_scenario,
    selects,
    worker_deployments,
)

FULLNAME = f"{RELEASE}-splitserve"

scenarios = pytest.mark.parametrize("scenario", sorted(SCENARIOS))



@scenarios
def test_pod_templates_carry_no_chart_or_app_version(scenario: str) -> None:
    """A chart release that changes nothing in the pods must not roll them: with the chart's
    version among a pod template's labels, any new chart (its docs alone) restarted every
    worker and reloaded every model (a chart audit). The objects themselves keep both."""
    rendered = render_scenario(scenario)
    for deployment, pod in pod_templates(rendered):
        labels = pod["metadata"]["labels"]
        assert not {"helm.sh/chart", "app.kubernetes.io/version"} & set(labels), deployment
        assert "helm.sh/chart" in deployment["metadata"]["labels"]
        selector = deployment["spec"]["selector"]["matchLabels"]
        assert labels.items() >= selector.items()


@scenarios
def test_worker_memory_is_requested_as_its_limit(scenario: str) -> None:
    """values.yaml's rule (a worker grown past a lower request is among the first evicted when
    its node runs short, with every stream it decodes), which the GPU examples broke with
    64Gi requested against 96Gi (a chart audit)."""
    rendered = render_scenario(scenario)
    for deployment, pod in pod_templates(rendered):
        if deployment["metadata"]["name"] not in worker_deployments(rendered):
            continue
        resources = pod["spec"]["containers"][0]["resources"]
        assert resources["requests"]["memory"] == resources["limits"]["memory"], \
            deployment["metadata"]["name"]


def test_serving_pods_can_run_under_a_service_account_a_cloud_identity_is_bound_to():
    """values.yaml promised the model download could use the pod's own identity (IRSA, EKS Pod
    Identity), but gateway and worker pods ran as the namespace's default service account with
    no way to change it (a chart audit)."""
    plain = render({})
    assert not plain.of_kind("ServiceAccount") or all(
        sa["metadata"]["name"].endswith("-autoscaler") for sa in plain.of_kind("ServiceAccount"))
    for deployment, pod in pod_templates(plain):
        if not deployment["metadata"]["name"].endswith(("-autoscaler", "-redis")):
            assert "serviceAccountName" not in pod["spec"]
    role_arn = {"eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/weights"}
    created = render({"serviceAccount": {"create": True, "annotations": role_arn}})
    account = created.get("ServiceAccount", FULLNAME)
    assert account["metadata"]["annotations"] == role_arn
    assert account["automountServiceAccountToken"] is False
    named = render({"serviceAccount": {"name": "weights-reader"}})
    for rendered, name in ((created, FULLNAME), (named, "weights-reader")):
        for deployment, pod in pod_templates(rendered):
            if deployment["metadata"]["name"].endswith(("-autoscaler", "-redis")):
                continue  # its own account; Redis downloads nothing
            assert pod["spec"]["serviceAccountName"] == name, deployment["metadata"]["name"]
            assert pod["spec"]["automountServiceAccountToken"] is False
    assert not [sa for sa in named.of_kind("ServiceAccount") if sa["metadata"]["name"] ==
                "weights-reader"]  # named: yours, not created


def test_gateways_spread_over_nodes_unless_told_otherwise():
    """Both gateways could land on one node and go down with it (a chart audit): a soft spread
    by default; a list of the user's replaces it."""
    default = render({})
    gateway = default.get("Deployment", f"{FULLNAME}-gateway")
    (spread,) = gateway["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    assert spread["whenUnsatisfiable"] == "ScheduleAnyway"
    assert selects(spread["labelSelector"], gateway["spec"]["template"]["metadata"]["labels"])
    assert spread["labelSelector"]["matchLabels"] == gateway["spec"]["selector"]["matchLabels"]
    zones = [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
              "whenUnsatisfiable": "DoNotSchedule",
              "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "gateway"}}}]
    told = render({"gateway": {"topologySpreadConstraints": zones}})
    assert told.get("Deployment", f"{FULLNAME}-gateway")["spec"]["template"]["spec"][
        "topologySpreadConstraints"] == zones


def test_a_pool_can_annotate_its_own_pods():
    """SR-IOV RDMA needs a Multus network annotation on the worker pods alone: podAnnotations
    put it on the gateway's and autoscaler's too, whose network setup would then fail (a chart
    audit). A pool's podAnnotations go on its pods only, over the global ones."""
    network = {"k8s.v1.cni.cncf.io/networks": "sriov-rdma"}
    rendered = render({"podAnnotations": {"team": "llm", "k8s.v1.cni.cncf.io/networks": "x"},
                       "prefill": {"podAnnotations": network},
                       "decode": {"podAnnotations": network}})
    for deployment, pod in pod_templates(rendered):
        annotations = pod["metadata"].get("annotations", {})
        if deployment["metadata"]["name"] in worker_deployments(rendered):
            assert annotations == {**annotations, "team": "llm", **network}
        else:
            assert annotations.get("k8s.v1.cni.cncf.io/networks") != "sriov-rdma"
    plain = render({})
    for deployment, pod in pod_templates(plain):
        if deployment["metadata"]["name"] in worker_deployments(plain):
            assert not pod["metadata"].get("annotations")


def test_the_gateway_can_trust_the_proxy_in_front_to_name_clients():
    """Without API keys each client address is a share of the fair queue; behind an ingress
    every client is the ingress unless the gateway trusts its X-Forwarded-For, and behind a
    LoadBalancer Service of the default traffic policy every client is a node. The trusted
    proxies reach the gateway as a value its own parser takes; the policy reaches the Service."""
    from services.gateway.api.client_address import ClientAddresses

    rendered = render({"gateway": {"trustedProxies": ["10.0.0.0/8", "192.168.1.5"],
                                   "service": {"type": "LoadBalancer",
                                               "externalTrafficPolicy": "Local"}}})
    gateway = rendered.get("Deployment", f"{FULLNAME}-gateway")
    env = {e["name"]: e.get("value") for e in gateway["spec"]["template"]["spec"][
        "containers"][0]["env"]}
    trusted = env["SPLITSERVE_GATEWAY_FORWARDED_ALLOW_IPS"]
    assert trusted == "10.0.0.0/8,192.168.1.5"
    assert ClientAddresses(trusted.split(",")).client("10.2.3.4", ["203.0.113.9"]) == "203.0.113.9"
    assert rendered.get("Service", f"{FULLNAME}-gateway")["spec"][
        "externalTrafficPolicy"] == "Local"
    plain = render({})
    assert "externalTrafficPolicy" not in plain.get("Service", f"{FULLNAME}-gateway")["spec"]
    with pytest.raises(Exception, match="externalTrafficPolicy applies to NodePort and "):
        render({"gateway": {"service": {"externalTrafficPolicy": "Local"}}})  # ClusterIP
    assert "SPLITSERVE_GATEWAY_FORWARDED_ALLOW_IPS" not in str(plain.get(
        "Deployment", f"{FULLNAME}-gateway"))
