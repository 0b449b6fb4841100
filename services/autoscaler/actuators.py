"""Actuators turn desired replica counts into replicas. Each removes a replica only by draining
it: the worker's SIGTERM handler deregisters, refuses new work and finishes what it holds.

KubernetesActuator patches the `scale` subresource of the two worker Deployments (the chart's
RBAC allows get/patch on deployments/scale of exactly those). Kubernetes then sends SIGTERM
to the pods it removes and waits terminationGracePeriodSeconds (the chart sets it above the
workers' drain time). The local actuator lives in local_actuator.py.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

from services.common.registry import WorkerInfo

log = logging.getLogger(__name__)


class Actuator(Protocol):
    def replicas(self, role: str) -> int:
        """Replicas asked for (starting ones included, draining ones not)."""

    def scale(self, role: str, replicas: int, workers: Sequence[WorkerInfo] = ()) -> None:
        """Ask for `replicas`; `workers` (the registry's view) lets an actuator pick the
        least-loaded worker to drain."""

    def close(self) -> None: ...


class KubernetesActuator:
    """`api` is a kubernetes.client.AppsV1Api, or any object with its two scale methods."""

    def __init__(self, namespace: str, deployments: dict[str, str], api=None) -> None:
        self.namespace = namespace
        self.deployments = deployments
        self.api = api if api is not None else _apps_api()

    def replicas(self, role: str) -> int:
        scale = self.api.read_namespaced_deployment_scale(self.deployments[role], self.namespace)
        return int(scale.spec.replicas or 0)

    def scale(self, role: str, replicas: int, workers: Sequence[WorkerInfo] = ()) -> None:
        name = self.deployments[role]
        log.info("scaling deployment %s/%s to %d replicas", self.namespace, name, replicas)
        self.api.patch_namespaced_deployment_scale(
            name, self.namespace, {"spec": {"replicas": int(replicas)}})

    def close(self) -> None:
        pass


def _apps_api():
    """In a pod: the service account's token; elsewhere: ~/.kube/config (for operators)."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.AppsV1Api()


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
