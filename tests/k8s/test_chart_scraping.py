"""What Prometheus scrapes and what the scalers query: the ServiceMonitor reaches the workers
and the gateway's admin port (its own Service, never the client-facing one), and KEDA's queries
name this release's pools."""

from __future__ import annotations

from chart_render import NAMESPACE, RELEASE, render_scenario, selects

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

