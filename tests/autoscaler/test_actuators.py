"""The Kubernetes actuator against a stand-in for kubernetes.client.AppsV1Api.

No API server runs in this environment (and a kind cluster is too heavy for a unit test), so
the fakes record the calls; what is checked is exactly what the API server would receive: the
scale subresource of the named Deployment in the namespace, patched with spec.replicas, and
before a scale-down each worker pod's pod-deletion-cost annotation. The chart's RBAC grants
get/patch on deployments/scale for those two names and patch on pods."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.autoscaler.actuators import DELETION_COST, DryRunActuator, KubernetesActuator
from services.common.registry import WorkerInfo


class FakeAppsV1Api:
    def __init__(self, replicas: dict[str, int]) -> None:
        self.replicas = dict(replicas)
        self.calls: list[tuple] = []

    def read_namespaced_deployment_scale(self, name: str, namespace: str):
        self.calls.append(("read", name, namespace))
        return SimpleNamespace(spec=SimpleNamespace(replicas=self.replicas[name]))

    def patch_namespaced_deployment_scale(self, name: str, namespace: str, body: dict):
        self.calls.append(("patch", name, namespace, body))
        self.replicas[name] = body["spec"]["replicas"]
        return SimpleNamespace(spec=SimpleNamespace(replicas=self.replicas[name]))


DEPLOYMENTS = {"prefill": "demo-splitserve-prefill", "decode": "demo-splitserve-decode"}


def test_reads_and_patches_the_scale_subresource_of_the_role_deployment():
    api = FakeAppsV1Api({"demo-splitserve-prefill": 2, "demo-splitserve-decode": 3})
    actuator = KubernetesActuator("llm", DEPLOYMENTS, api=api)
    assert actuator.replicas("prefill") == 2 and actuator.replicas("decode") == 3
    actuator.scale("decode", 5)
    assert api.calls[-1] == ("patch", "demo-splitserve-decode", "llm", {"spec": {"replicas": 5}})
    assert actuator.replicas("decode") == 5
    actuator.scale("prefill", 1)  # Kubernetes SIGTERMs the pod it removes; the worker drains
    assert api.replicas == {"demo-splitserve-prefill": 1, "demo-splitserve-decode": 5}


def test_api_errors_reach_the_control_loop():
    class Failing(FakeAppsV1Api):
        def patch_namespaced_deployment_scale(self, name, namespace, body):
            raise RuntimeError("403 Forbidden")

    actuator = KubernetesActuator("llm", DEPLOYMENTS, api=Failing({}))
    with pytest.raises(RuntimeError, match="403"):
        actuator.scale("decode", 2)


def test_the_real_client_is_the_default():
    from kubernetes import client

    assert hasattr(client.AppsV1Api, "patch_namespaced_deployment_scale")
    assert hasattr(client.AppsV1Api, "read_namespaced_deployment_scale")
    assert hasattr(client.CoreV1Api, "patch_namespaced_pod")


def test_dry_run_remembers_what_it_was_asked():
    actuator = DryRunActuator({"prefill": 1, "decode": 1})
    actuator.scale("decode", 4)
    assert (actuator.replicas("prefill"), actuator.replicas("decode")) == (1, 4)


class FakeCoreV1Api:
    """Stands in for kubernetes.client.CoreV1Api (no API server here): records pod patches."""

    def __init__(self, missing: set[str] = frozenset()) -> None:
        self.patches: list[tuple[str, str, dict]] = []
        self.missing = missing

    def patch_namespaced_pod(self, name: str, namespace: str, body: dict):
        if name in self.missing:
            raise RuntimeError(f'404 pods "{name}" not found')
        self.patches.append((name, namespace, body))


def _worker(pod: str, draining: bool = False, **stats) -> WorkerInfo:
    return WorkerInfo(worker_id=pod, role="decode", address=f"{pod}:50051", kv_endpoint="",
                      model="m", block_size=16, max_model_len=2048, draining=draining, stats=stats)


def _costs(core: FakeCoreV1Api) -> dict[str, int]:
    return {name: int(body["metadata"]["annotations"][DELETION_COST])
            for name, _, body in core.patches}


def test_scale_down_marks_idle_pods_cheapest_before_patching_the_scale():
    api = FakeAppsV1Api({"demo-splitserve-decode": 3})
    core = FakeCoreV1Api()
    order = []
    core.patch_namespaced_pod = lambda n, ns, b, p=core.patch_namespaced_pod: (
        order.append("pod"), p(n, ns, b))
    api.patch_namespaced_deployment_scale = lambda n, ns, b, p=api.patch_namespaced_deployment_scale: (
        order.append("scale"), p(n, ns, b))
    actuator = KubernetesActuator("llm", DEPLOYMENTS, api=api, core_api=core)
    workers = [_worker("decode-busy", running=12, waiting=3), _worker("decode-idle"),
               _worker("decode-some", running=2, queued_prefill_tokens=500),
               _worker("decode-leaving", draining=True, running=40)]
    actuator.scale("decode", 2, workers)
    costs = _costs(core)
    assert costs == {"decode-busy": 15000, "decode-idle": 0, "decode-some": 2500}
    assert {ns for _, ns, _ in core.patches} == {"llm"}
    assert order == ["pod", "pod", "pod", "scale"]  # costs are in place before pods are chosen
    assert api.replicas["demo-splitserve-decode"] == 2


def test_scale_up_and_unchanged_sizes_leave_pods_alone():
    api = FakeAppsV1Api({"demo-splitserve-decode": 2})
    core = FakeCoreV1Api()
    actuator = KubernetesActuator("llm", DEPLOYMENTS, api=api, core_api=core)
    actuator.scale("decode", 3, [_worker("decode-a", running=1)])
    actuator.scale("decode", 3, [_worker("decode-a", running=1)])
    assert core.patches == [] and api.replicas["demo-splitserve-decode"] == 3


def test_a_pod_that_cannot_be_marked_does_not_stop_the_scale_down():
    api = FakeAppsV1Api({"demo-splitserve-decode": 2})
    core = FakeCoreV1Api(missing={"decode-gone"})
    actuator = KubernetesActuator("llm", DEPLOYMENTS, api=api, core_api=core)
    actuator.scale("decode", 1, [_worker("decode-gone"), _worker("decode-b", running=1)])
    assert _costs(core) == {"decode-b": 1000}
    assert api.replicas["demo-splitserve-decode"] == 1


def test_deletion_cost_fits_the_annotations_int32():
    api = FakeAppsV1Api({"demo-splitserve-decode": 2})
    core = FakeCoreV1Api()
    KubernetesActuator("llm", DEPLOYMENTS, api=api, core_api=core).scale(
        "decode", 1, [_worker("decode-a", queued_prefill_tokens=10**12)])
    assert _costs(core) == {"decode-a": 2**31 - 1}
