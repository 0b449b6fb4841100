"""What Prometheus scrapes and what the scalers query: the ServiceMonitor reaches the workers
and the gateway's admin port (its own Service, never the client-facing one), and KEDA's queries
name this release's pools."""

from __future__ import annotations

import helm_python as helm
import pytest
from chart_render import NAMESPACE, RELEASE, render, render_scenario, selects

FULLNAME = f"{RELEASE}-splitserve"
WORKERS = (f"{FULLNAME}-prefill", f"{FULLNAME}-decode")
SCRAPED = (f"{FULLNAME}-gateway", f"{FULLNAME}-gateway-metrics", *WORKERS)


def test_service_monitor_scrapes_the_gateway_and_both_pools() -> None:
    rendered = render_scenario("keda")
    (monitor,) = rendered.of_kind("ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    endpoint_ports = {e["port"]: e["path"] for e in monitor["spec"]["endpoints"]}
    scraped = [s for s in rendered.of_kind("Service")
               if selects(monitor["spec"]["selector"], s["metadata"]["labels"])]
    assert sorted(s["metadata"]["name"] for s in scraped) == sorted(SCRAPED)
    with_metrics = {s["metadata"]["name"] for s in scraped
                    if {p["name"] for p in s["spec"]["ports"]} & set(endpoint_ports)}
    assert with_metrics == set(SCRAPED) - {f"{FULLNAME}-gateway"}
    assert endpoint_ports == {"metrics": "/metrics"}


def test_keda_queries_default_to_this_release_pools() -> None:
    rendered = render_scenario("keda")
    for worker in WORKERS:
        (trigger,) = rendered.get("ScaledObject", worker)["spec"]["triggers"]
        assert f'service="{worker}"' in trigger["metadata"]["query"]
        assert f'namespace="{NAMESPACE}"' in trigger["metadata"]["query"]



def test_service_monitor_scrapes_the_built_in_autoscaler() -> None:
    """Its /metrics (desired and ready replicas, demand, decisions) had no Service to be
    scraped through; its NetworkPolicy already let the scrapers in on that port."""
    rendered = render({"metrics": {"serviceMonitor": {"enabled": True}}})
    (monitor,) = rendered.of_kind("ServiceMonitor")
    service = rendered.get("Service", f"{FULLNAME}-autoscaler")
    assert selects(monitor["spec"]["selector"], service["metadata"]["labels"])
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["ports"] == [{"name": "metrics", "port": 9100, "targetPort": "http",
                                         "protocol": "TCP"}]
    pod = rendered.get("Deployment", f"{FULLNAME}-autoscaler")["spec"]["template"]
    assert selects({"matchLabels": service["spec"]["selector"]}, pod["metadata"]["labels"])
    assert [e["path"] for e in monitor["spec"]["endpoints"]] == ["/metrics"]
    without = render({"autoscaler": {"enabled": False}})
    assert f"{FULLNAME}-autoscaler" not in without.names("Service")


@pytest.mark.parametrize("component", ["gateway", "worker"])
def test_a_metrics_path_is_not_a_setting(component: str) -> None:
    """Every process serves /metrics alone; the values' metricsPath changed nothing but the
    ServiceMonitor's path, which then scraped nothing. Setting it is now a schema error."""
    with pytest.raises(helm.HelmError, match="metricsPath"):
        render({component: {"metricsPath": "/stats"}})
