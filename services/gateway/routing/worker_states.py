"""The pool's workers by role and state, as the gateway sees them, for /metrics:
`splitserve_gateway_workers{role,state}`, every pair exported (0 included), so an alert can
read "no decode worker available" without parsing /ready."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client.core import GaugeMetricFamily

from services.gateway.routing.worker_pool import WorkerEndpoint

WORKER_ROLES = ("prefill", "decode", "both")
# What a worker in the pool is to this gateway; the first in this order that holds is taken.
WORKER_STATES = ("unreachable", "draining", "unhealthy", "breaker_open", "available")


def worker_state(endpoint: WorkerEndpoint) -> str:
    """unreachable (its Health poll fails), draining, unhealthy (answers, but not SERVING: a
    stalled step, still loading), breaker_open (requests to it failed; out of rotation until
    the cool-down ends) or available (routed to)."""
    if not endpoint.reachable:
        return "unreachable"
    if endpoint.draining:
        return "draining"
    if not endpoint.routable:
        return "unhealthy"
    if endpoint.breaker.cooling_down:
        return "breaker_open"
    return "available"


class WorkerStates:
    """A collector reading the pool at scrape time, on the event loop (the admin app serves
    /metrics there)."""

    def __init__(self, endpoints: Callable[[], Iterable[WorkerEndpoint]]) -> None:
        self.endpoints = endpoints

    def describe(self):
        return []

    def collect(self):
        counts = {(role, state): 0 for role in WORKER_ROLES for state in WORKER_STATES}
        for endpoint in self.endpoints():
            key = (endpoint.role, worker_state(endpoint))
            if key in counts:
                counts[key] += 1
        family = GaugeMetricFamily(
            "splitserve_gateway_workers", "Workers in this gateway's pool by role and state "
            "(available, breaker_open, unhealthy, draining, unreachable).",
            labels=["role", "state"])
        for (role, state), count in counts.items():
            family.add_metric([role, state], count)
        yield family
