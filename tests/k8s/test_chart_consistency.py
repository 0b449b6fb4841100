"""The rendered objects fit together: selectors find the pods, probes and Services hit ports and
paths the containers serve, RBAC names exactly the worker Deployments, every reference resolves."""

from __future__ import annotations

import base64

import pytest
from chart_render import (
    NAMESPACE,
    RELEASE,
    SCENARIOS,
    Rendered,
    pod_templates,
    render_scenario,
    selects,
    worker_deployments,
)

FULLNAME = f"{RELEASE}-splitserve"
WORKERS = (f"{FULLNAME}-prefill", f"{FULLNAME}-decode")
SERVING = (f"{FULLNAME}-gateway", *WORKERS)

scenarios = pytest.mark.parametrize("scenario", sorted(SCENARIOS))


def pods_selected(rendered: Rendered, selector: dict) -> list[str]:
    assert selector, "an empty selector would select every pod"
    return [d["metadata"]["name"] for d, pod in pod_templates(rendered)
            if selects(selector, pod["metadata"]["labels"])]


def container_ports(pod: dict) -> dict[str | int, int]:
    """Port name and number -> number, for every container of the pod."""
    ports: dict[str | int, int] = {}
    for container in pod["spec"]["containers"]:
        for port in container.get("ports", []):
            ports[port["containerPort"]] = port["containerPort"]
            if "name" in port:
                ports[port["name"]] = port["containerPort"]
    return ports


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def env_value(container: dict, name: str) -> str:
    return env_of(container)[name]["value"]


def main_container(rendered: Rendered, name: str) -> dict:
    return rendered.get("Deployment", name)["spec"]["template"]["spec"]["containers"][0]


# the autoscaler's pod-patch policy (test_chart_autoscaler_pod_policy.py)
CLUSTER_SCOPED = ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")


@scenarios
def test_every_object_is_namespaced_and_labelled_for_the_release(scenario: str) -> None:
    rendered = render_scenario(scenario)
    for obj in rendered.objects:
        meta = obj["metadata"]
        assert meta["labels"]["app.kubernetes.io/instance"] == RELEASE, meta["name"]
        if obj["kind"] in CLUSTER_SCOPED:
            # one per namespace and release across the cluster: both in the name
            assert "namespace" not in meta and meta["name"].startswith(f"{NAMESPACE}-{RELEASE}-")
            continue
        expected_ns = "monitoring" if scenario == "keda" and obj["kind"] == "ConfigMap" \
            and meta["name"].endswith("-dashboard") else NAMESPACE
        assert meta["namespace"] == expected_ns, meta["name"]
        assert len(meta["name"]) <= 63, meta["name"]


@scenarios
def test_deployment_selectors_match_their_own_pod_labels_only(scenario: str) -> None:
    rendered = render_scenario(scenario)
    for deployment, pod in pod_templates(rendered):
        selector = deployment["spec"]["selector"]
        assert selects(selector, pod["metadata"]["labels"])
        assert pods_selected(rendered, selector) == [deployment["metadata"]["name"]]


@scenarios
def test_services_select_one_deployment_and_target_its_ports(scenario: str) -> None:
    rendered = render_scenario(scenario)
    for service in rendered.of_kind("Service"):
        name = service["metadata"]["name"]
        deployment = name.removesuffix("-metrics")  # the gateway's admin port's own Service
        selected = pods_selected(rendered, {"matchLabels": service["spec"]["selector"]})
        assert selected == [deployment], f"Service {name} selects {selected}"
        ports = container_ports(rendered.get("Deployment", deployment)["spec"]["template"])
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, f"{name}: no container port {port['targetPort']}"
    for worker in worker_deployments(rendered):
        assert rendered.get("Service", worker)["spec"]["clusterIP"] == "None"


@scenarios
def test_disruption_budgets_cover_the_gateway_and_both_pools(scenario: str) -> None:
    rendered = render_scenario(scenario)
    covered = {}
    for pdb in rendered.of_kind("PodDisruptionBudget"):
        selected = pods_selected(rendered, pdb["spec"]["selector"])
        assert len(selected) == 1, pdb["metadata"]["name"]
        covered[selected[0]] = pdb["spec"]
    workers = worker_deployments(rendered)
    assert set(covered) == {f"{FULLNAME}-gateway", *workers}
    gateways = rendered.get("Deployment", f"{FULLNAME}-gateway")["spec"]["replicas"]
    if gateways > 1:
        assert covered[f"{FULLNAME}-gateway"]["minAvailable"] == 1
    else:  # minAvailable 1 of 1 would allow no disruption: every node drain would hang
        assert covered[f"{FULLNAME}-gateway"] == {**covered[f"{FULLNAME}-gateway"],
                                                  "maxUnavailable": 1}
        assert "minAvailable" not in covered[f"{FULLNAME}-gateway"]
    for worker in workers:
        assert covered[worker]["maxUnavailable"] == 1


@scenarios
def test_probes_hit_ports_and_paths_the_containers_serve(scenario: str) -> None:
    rendered = render_scenario(scenario)
    expected_paths = {
        f"{FULLNAME}-gateway": ("metrics", "/health", "/ready/self"),
        f"{FULLNAME}-prefill": ("metrics", "/health", "/ready"),
        f"{FULLNAME}-decode": ("metrics", "/health", "/ready"),
        f"{FULLNAME}-worker": ("metrics", "/health", "/ready"),
        f"{FULLNAME}-autoscaler": ("http", "/health", "/ready"),
    }
    for deployment, pod in pod_templates(rendered):
        name = deployment["metadata"]["name"]
        ports = container_ports(pod)
        for container in pod["spec"]["containers"]:
            assert "livenessProbe" in container and "readinessProbe" in container, name
            for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
                probe = container.get(kind)
                if probe is None:
                    continue
                handler = probe.get("httpGet") or probe.get("tcpSocket")
                if handler is not None:
                    assert handler["port"] in ports, f"{name} {kind} -> {handler['port']}"
        if name in expected_paths:
            port, live, ready = expected_paths[name]
            container = pod["spec"]["containers"][0]
            for kind, path in (("livenessProbe", live), ("readinessProbe", ready)):
                assert container[kind]["httpGet"] == {"path": path, "port": port}, (name, kind)
            if "startupProbe" in container:
                assert container["startupProbe"]["httpGet"] == {"path": live, "port": port}


def test_startup_probe_allows_the_configured_model_load_time() -> None:
    for scenario, load_s in (("default", 600), ("cpu", 300)):
        rendered = render_scenario(scenario)
        for worker in WORKERS:
            probe = main_container(rendered, worker)["startupProbe"]
            budget = probe["periodSeconds"] * probe["failureThreshold"]
            assert load_s <= budget < load_s + probe["periodSeconds"], (scenario, worker, budget)


@scenarios
def test_workers_are_configured_for_their_role_and_ports(scenario: str) -> None:
    rendered = render_scenario(scenario)
    aggregated = SCENARIOS[scenario].get("mode") == "aggregated"
    expected = {f"{FULLNAME}-worker": "both"} if aggregated else {
        f"{FULLNAME}-prefill": "prefill", f"{FULLNAME}-decode": "decode"}
    assert worker_deployments(rendered) == expected
    for name, role in expected.items():
        pod = rendered.get("Deployment", name)["spec"]["template"]
        container = pod["spec"]["containers"][0]
        ports = container_ports(pod)
        assert container["command"] == ["splitserve"]
        assert container["args"] == ["worker", "--role", role]
        assert "SPLITSERVE_ROLE" not in env_of(container)  # the flag alone says it
        assert int(env_value(container, "SPLITSERVE_PORT")) == ports["grpc"]
        assert int(env_value(container, "SPLITSERVE_METRICS_PORT")) == ports["metrics"]
        assert env_value(container, "SPLITSERVE_HOST") == "0.0.0.0"
        assert env_value(container, "SPLITSERVE_ADVERTISE_HOST") == "$(POD_IP)"
        pod_spec = pod["spec"]
        drain = int(env_value(container, "SPLITSERVE_DRAIN_GRACE_S"))
        pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
        assert pre_stop + drain < pod_spec["terminationGracePeriodSeconds"]
        assert ("kv" in ports) == (role == "decode")
        if role == "decode":
            assert int(env_value(container, "SPLITSERVE_KV_PORT")) == ports["kv"]
        model = env_value(container, "SPLITSERVE_MODEL")
        mounts = [m["mountPath"] for m in container["volumeMounts"] if m["name"] == "model"]
        assert len(mounts) == 1 and model.startswith(mounts[0] + "/")
        shm = [v for v in pod["spec"]["volumes"] if v["name"] == "dshm"][0]
        assert shm["emptyDir"]["medium"] == "Memory"
        assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]


@scenarios
def test_every_mount_has_a_volume_and_every_reference_resolves(scenario: str) -> None:
    rendered = render_scenario(scenario)
    values = SCENARIOS[scenario]
    configmaps = rendered.names("ConfigMap") | (
        {values.get("autoscaler", {}).get("profile", {}).get("existingConfigMap")} - {None, ""})
    operator_secrets = {values.get("redis", {}).get("external", {}).get("existingSecret"),
                        values.get("gateway", {}).get("apiKeys", {}).get("existingSecret")}
    secrets = rendered.names("Secret") | (operator_secrets - {None, ""})
    claims = rendered.names("PersistentVolumeClaim")
    for deployment, pod in pod_templates(rendered):
        volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
        for container in pod["spec"]["containers"]:
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes, (deployment["metadata"]["name"], mount["name"])
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] in secrets, ref
                    if ref["name"] in rendered.names("Secret"):
                        assert ref["key"] in rendered.get("Secret", ref["name"])["data"]
        for volume in volumes.values():
            if "configMap" in volume:
                assert volume["configMap"]["name"] in configmaps
            if "persistentVolumeClaim" in volume and scenario == "keda":
                assert volume["persistentVolumeClaim"]["claimName"] in claims


@scenarios
def test_rollouts_never_reduce_serving_capacity(scenario: str) -> None:
    rendered = render_scenario(scenario)
    for name in (f"{FULLNAME}-gateway", *worker_deployments(rendered)):
        deployment = rendered.get("Deployment", name)
        assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
        pod = deployment["spec"]["template"]["spec"]
        sleep = pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
        assert sleep[0] == "sleep" and int(sleep[1]) < pod["terminationGracePeriodSeconds"]


@scenarios
def test_replicas_are_left_to_the_scaler_that_owns_the_pools(scenario: str) -> None:
    values = SCENARIOS[scenario]
    scaled = values.get("autoscaler", {}).get("enabled", True) or any(
        values.get(k, {}).get("enabled") for k in ("hpa", "keda"))
    rendered = render_scenario(scenario)
    for worker in worker_deployments(rendered):
        assert ("replicas" in rendered.get("Deployment", worker)["spec"]) is not scaled
    assert "replicas" in rendered.get("Deployment", f"{FULLNAME}-gateway")["spec"]


@scenarios
def test_scalers_target_exactly_the_two_worker_deployments(scenario: str) -> None:
    rendered = render_scenario(scenario)
    for kind in ("HorizontalPodAutoscaler", "ScaledObject"):
        targets = sorted(o["spec"]["scaleTargetRef"]["name"] for o in rendered.of_kind(kind))
        if targets:
            assert targets == sorted(worker_deployments(rendered))
            for target in targets:
                assert rendered.get("Deployment", target)


def test_autoscaler_rbac_names_only_the_worker_deployments() -> None:
    rendered = render_scenario("default")
    name = f"{FULLNAME}-autoscaler"
    (role,) = rendered.of_kind("Role")
    assert role["metadata"]["name"] == name
    assert role["rules"] == [{"apiGroups": ["apps"], "resources": ["deployments/scale"],
                              "resourceNames": list(WORKERS), "verbs": ["get", "patch"]},
                             {"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]}]
    assert rendered.of_kind("ClusterRole") == [] and rendered.of_kind("ClusterRoleBinding") == []
    binding = rendered.get("RoleBinding", name)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": name}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": name, "namespace": NAMESPACE}]
    assert rendered.get("ServiceAccount", name)
    pod = rendered.get("Deployment", name)["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == name and pod["automountServiceAccountToken"] is True
    args = pod["containers"][0]["args"]
    flag = {args[i]: args[i + 1] for i in range(1, len(args) - 1, 2)}
    assert flag["--prefill-deployment"] == WORKERS[0]
    assert flag["--decode-deployment"] == WORKERS[1]
    assert flag["--actuator"] == "k8s" and flag["--namespace"] == "$(POD_NAMESPACE)"


@scenarios
def test_only_the_autoscaler_mounts_an_api_token(scenario: str) -> None:
    for deployment, pod in pod_templates(render_scenario(scenario)):
        wants_token = deployment["metadata"]["name"].endswith("-autoscaler")
        assert pod["spec"]["automountServiceAccountToken"] is wants_token
        # Service links would inject SPLITSERVE_*_PORT=tcp://... into the SPLITSERVE_* settings.
        assert pod["spec"]["enableServiceLinks"] is False


@scenarios
def test_gpus_are_requested_by_workers_only(scenario: str) -> None:
    rendered = render_scenario(scenario)
    expected = {
        "default": {"prefill": 1, "decode": 1}, "hpa": {"prefill": 2, "decode": 2},
        "keda": {"prefill": 1, "decode": 1}, "cpu": {"prefill": 0, "decode": 0},
        "gpu-disaggregated-rdma": {"prefill": 2, "decode": 2},
        "gpu-disaggregated-tcp": {"prefill": 2, "decode": 2}, "gpu-aggregated": {"worker": 2},
    }[scenario]
    assert set(worker_deployments(rendered)) == {f"{FULLNAME}-{c}" for c in expected}
    for component, gpus in expected.items():
        container = main_container(rendered, f"{FULLNAME}-{component}")
        resources = container["resources"]
        if gpus:
            assert resources["requests"]["nvidia.com/gpu"] == gpus
            assert resources["limits"]["nvidia.com/gpu"] == gpus
        else:
            assert "nvidia.com/gpu" not in resources["requests"] | resources["limits"]
        # Every GPU of the pod runs a tensor-parallel rank (hpa's gpus: 2 is TP 2).
        assert env_value(container, "SPLITSERVE_TENSOR_PARALLEL_SIZE") == str(max(gpus, 1))
    for deployment, pod in pod_templates(rendered):
        if deployment["metadata"]["name"] not in worker_deployments(rendered):
            for container in pod["spec"]["containers"]:
                assert "nvidia.com/gpu" not in str(container["resources"])


@scenarios
def test_every_component_reaches_the_same_redis(scenario: str) -> None:
    rendered = render_scenario(scenario)
    urls = set()
    for deployment, pod in pod_templates(rendered):
        if deployment["metadata"]["name"].endswith("-redis"):
            continue
        env = env_of(pod["spec"]["containers"][0])["REDIS_URL"]
        urls.add(str(env.get("value") or env["valueFrom"]))
    assert len(urls) == 1
    if SCENARIOS[scenario].get("redis", {}).get("enabled", True):
        service = rendered.get("Service", f"{FULLNAME}-redis")
        assert urls == {f"redis://{FULLNAME}-redis:{service['spec']['ports'][0]['port']}/0"}


@scenarios
def test_network_policies_open_ports_that_exist(scenario: str) -> None:
    rendered = render_scenario(scenario)
    for policy in rendered.of_kind("NetworkPolicy"):
        (target,) = pods_selected(rendered, policy["spec"]["podSelector"])
        ports = container_ports(rendered.get("Deployment", target)["spec"]["template"])
        for rule in policy["spec"]["ingress"]:
            for port in rule.get("ports", []):
                assert port["port"] in ports, (policy["metadata"]["name"], port)
            for peer in rule.get("from", []):
                if "podSelector" in peer and "namespaceSelector" not in peer:
                    assert pods_selected(rendered, peer["podSelector"]), policy["metadata"]["name"]
    if SCENARIOS[scenario].get("mode") == "aggregated":
        # No KV crosses pods: workers take nothing from each other.
        policy = rendered.get("NetworkPolicy", f"{FULLNAME}-worker")
        assert all("ports" in rule for rule in policy["spec"]["ingress"])
        return
    # Workers accept KV channels from each other on any port (torch.distributed's ephemeral ones).
    decode = rendered.get("NetworkPolicy", WORKERS[1])
    peers = [r for r in decode["spec"]["ingress"] if "ports" not in r]
    assert sorted(pods_selected(rendered, peers[0]["from"][0]["podSelector"])) == sorted(WORKERS)


def test_gateway_gets_tenants_file_and_api_keys_from_their_objects() -> None:
    hpa = render_scenario("hpa")
    gateway = main_container(hpa, f"{FULLNAME}-gateway")
    assert env_value(gateway, "SPLITSERVE_TENANTS_FILE") == "/etc/splitserve/tenants/tenants.yaml"
    tenants = hpa.get("ConfigMap", f"{FULLNAME}-tenants")
    assert "acme:" in tenants["data"]["tenants.yaml"]
    # The keys as a file (re-read when the Secret changes), never in the environment.
    assert env_value(gateway, "SPLITSERVE_GATEWAY_API_KEYS_FILE") == "/etc/splitserve/api-keys/keys"
    assert "SPLITSERVE_GATEWAY_API_KEYS" not in env_of(gateway)
    pod = hpa.get("Deployment", f"{FULLNAME}-gateway")["spec"]["template"]["spec"]
    keys = {v["name"]: v for v in pod["volumes"]}["api-keys"]["secret"]
    assert keys == {"secretName": "splitserve-api-keys", "defaultMode": 0o440,
                    "items": [{"key": "api-keys", "path": "keys"}]}
    # The operator's Secret, not one the chart makes (it makes only the internal-plane ones).
    assert f"{FULLNAME}-api-keys" not in hpa.names("Secret")

    keda = render_scenario("keda")
    secret = keda.get("Secret", f"{FULLNAME}-api-keys")
    assert base64.b64decode(secret["data"]["api-keys"]).decode() == "sk-test-one,sk-test-two"

    default = render_scenario("default")
    gateway = main_container(default, f"{FULLNAME}-gateway")
    assert "SPLITSERVE_GATEWAY_API_KEYS_FILE" not in env_of(gateway)
    assert "without authentication" in default.notes


def test_image_tag_follows_the_variant_or_digest() -> None:
    def images(scenario: str) -> set[str]:
        return {c["image"] for d, pod in pod_templates(render_scenario(scenario))
                if not d["metadata"]["name"].endswith("-redis") for c in pod["spec"]["containers"]}

    assert images("default") == {"splitserve:0.1.0-cuda"}
    assert images("cpu") == {"splitserve:0.1.0-cpu"}
    (pinned,) = images("keda")
    assert pinned.startswith("splitserve:0.1.0-cuda@sha256:")

