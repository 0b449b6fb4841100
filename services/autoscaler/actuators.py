"""Actuators turn desired replica counts into replicas. Each removes a replica only by draining
it: the worker's SIGTERM handler deregisters, refuses new work and finishes what it holds.

KubernetesActuator patches the `scale` subresource of the two worker Deployments (the chart's
RBAC allows get/patch on deployments/scale of exactly those, and patch on pods, which a
ValidatingAdmissionPolicy holds to the annotation below on worker pods). Before a
scale-down it sets each registered worker pod's `controller.kubernetes.io/pod-deletion-cost`
from its live load, so the ReplicaSet removes the idlest pods first. Kubernetes then sends
SIGTERM to the pods it removes and waits terminationGracePeriodSeconds (the chart sets it above
the workers' drain time). The local actuator lives in local_actuator.py.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

from services.common.registry import WorkerInfo

log = logging.getLogger(__name__)

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
_MAX_COST = 2**31 - 1  # the annotation is an int32


class Actuator(Protocol):
    def replicas(self, role: str) -> int:
        """Replicas asked for (starting ones included, draining ones not)."""

    def scale(self, role: str, replicas: int, workers: Sequence[WorkerInfo] = ()) -> None:
        """Ask for `replicas`; `workers` (the registry's view) lets an actuator pick the
        least-loaded worker to drain."""

    def close(self) -> None: ...


class KubernetesActuator:
    """`api` is a kubernetes.client.AppsV1Api and `core_api` a CoreV1Api, or any objects with
    their scale and pod-patch methods. Worker ids are pod names (the chart sets
    SPLITSERVE_WORKER_ID to the pod's name)."""

    def __init__(self, namespace: str, deployments: dict[str, str], api=None,
                 core_api=None) -> None:
        self.namespace = namespace
        self.deployments = deployments
        self.api = api if api is not None else _apps_api()
        self._core_api = core_api  # made on the first scale-down that needs it

    def replicas(self, role: str) -> int:
        scale = self.api.read_namespaced_deployment_scale(self.deployments[role], self.namespace)
        return int(scale.spec.replicas or 0)

    def scale(self, role: str, replicas: int, workers: Sequence[WorkerInfo] = ()) -> None:
        name = self.deployments[role]
        if workers and replicas < self.replicas(role):
            self.mark_deletion_costs(workers)
        log.info("scaling deployment %s/%s to %d replicas", self.namespace, name, replicas)
        self.api.patch_namespaced_deployment_scale(
            name, self.namespace, {"spec": {"replicas": int(replicas)}})

    def mark_deletion_costs(self, workers: Sequence[WorkerInfo]) -> None:
        """Annotate each live worker's pod with its load (requests held, prefill backlog in
        thousands of tokens), scaled to an int: the ReplicaSet deletes the lowest cost first.
        A pod that cannot be patched (gone, forbidden) is logged and left to Kubernetes."""
        if self._core_api is None:
            self._core_api = _core_api()
        for info in workers:
            if info.draining:
                continue
            cost = min(int(round(worker_load(info) * 1000)), _MAX_COST)
            body = {"metadata": {"annotations": {DELETION_COST: str(cost)}}}
            try:
                self._core_api.patch_namespaced_pod(info.worker_id, self.namespace, body)
            except Exception as exc:  # noqa: BLE001 - the scale-down must go on regardless
                log.warning("could not set %s on pod %s/%s: %s", DELETION_COST, self.namespace,
                            info.worker_id, exc)

    def close(self) -> None:
        pass


def worker_load(info: WorkerInfo) -> float:
    """Live load from a registry entry: requests held plus the prefill backlog (per 1000 tokens)."""
    stats = info.stats
    return float(stats.get("running", 0) + stats.get("waiting", 0) + stats.get("waiting_for_kv", 0)
                 + stats.get("queued_prefill_tokens", 0) / 1000)


def _apps_api():
    from kubernetes import client

    _load_kube_config()
    return client.AppsV1Api()


def _core_api():
    from kubernetes import client

    _load_kube_config()
    return client.CoreV1Api()


def _load_kube_config() -> None:
    """In a pod: the service account's token; elsewhere: ~/.kube/config (for operators)."""
    from kubernetes import config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()


class DryRunActuator:
    """Logs decisions and changes nothing; replicas are whatever was last asked for."""

    def __init__(self, initial: dict[str, int]) -> None:
        self.counts = dict(initial)

    def replicas(self, role: str) -> int:
        return self.counts[role]

    def scale(self, role: str, replicas: int, workers: Sequence[WorkerInfo] = ()) -> None:
        log.info("dry run: would scale %s to %d", role, replicas)
        self.counts[role] = replicas

    def close(self) -> None:
        pass
