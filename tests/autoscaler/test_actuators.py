"""The Kubernetes actuator against a stand-in for kubernetes.client.AppsV1Api.

No API server runs in this environment (and a kind cluster is too heavy for a unit test), so
the fake records the calls; what is checked is exactly what the API server would receive: the
scale subresource of the named Deployment in the namespace, patched with spec.replicas. The
chart's RBAC grants get/patch on deployments/scale for those two names only."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.autoscaler.actuators import DryRunActuator, KubernetesActuator


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


def test_dry_run_remembers_what_it_was_asked():
    actuator = DryRunActuator({"prefill": 1, "decode": 1})
    actuator.scale("decode", 4)
    assert (actuator.replicas("prefill"), actuator.replicas("decode")) == (1, 4)
