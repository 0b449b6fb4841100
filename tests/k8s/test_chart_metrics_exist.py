"""Every metric name the chart's HPA, KEDA and Grafana objects query is exported by a live process
under that name and type: the chart is rendered in each scenario, the names are collected from
its PromQL and HPA metric specs, and real processes (a gateway, a prefill and a decode worker on a
tiny model, after serving one request) are scraped on their /metrics (the gateway's admin port)."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from chart_render import SCENARIOS, Rendered, render, render_scenario
from prometheus_client.parser import text_string_to_metric_families

from splitserve_cli.processes import start_worker
from tests.gateway.gateway_processes import ServiceProcess

pytestmark = pytest.mark.timeout(180)

NAME = re.compile(r"\b(?:splitserve_[a-z0-9_]+|vllm:[a-z0-9_]+)")
# A name right after one of these is read as a counter or a histogram series, never a gauge.
RATE = re.compile(r"\b(?:rate|irate|increase)\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def extra_scenarios() -> dict[str, dict]:
    """Scenarios whose queries the ci/ files do not reach (HPA on a pool of role both, etc.)."""
    return {"aggregated-hpa": {"mode": "aggregated", "autoscaler": {"enabled": False},
                               "hpa": {"enabled": True}},
            "aggregated-keda-dashboard": {"mode": "aggregated", "autoscaler": {"enabled": False},
                                          "keda": {"enabled": True},
                                          "metrics": {"dashboard": {"enabled": True}}}}


def rendered_scenarios() -> list[Rendered]:
    return [render_scenario(name) for name in sorted(SCENARIOS)] + [
        render(values, scenario=name) for name, values in extra_scenarios().items()]


def queries(rendered: Rendered) -> list[tuple[str, str]]:
    """(where, PromQL) of every dashboard panel target and KEDA trigger."""
    found = []
    for configmap in rendered.of_kind("ConfigMap"):
        for key, text in (configmap.get("data") or {}).items():
            if key.endswith(".json") and '"panels"' in text:
                for panel in json.loads(text)["panels"]:
                    for target in panel.get("targets", []):
                        found.append((f"dashboard {panel['title']!r}", target["expr"]))
    for scaled in rendered.of_kind("ScaledObject"):
        for trigger in scaled["spec"]["triggers"]:
            found.append((f"ScaledObject {scaled['metadata']['name']}",
                          trigger["metadata"]["query"]))
    return found


def hpa_metrics(rendered: Rendered) -> list[tuple[str, dict]]:
    """(role the HPA's target runs, metric spec) of every HPA metric."""
    found = []
    for hpa in rendered.of_kind("HorizontalPodAutoscaler"):
        target = rendered.get("Deployment", hpa["spec"]["scaleTargetRef"]["name"])
        args = target["spec"]["template"]["spec"]["containers"][0]["args"]
        role = args[args.index("--role") + 1]
        found.extend((role, metric) for metric in hpa["spec"]["metrics"])
    return found


def exposition(url: str) -> tuple[dict[str, str], dict[str, int]]:
    """(series name -> family type, series name -> samples) of a /metrics page, counting the
    series a declared family has even before its first labelled sample."""
    types, samples = {}, {}
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        series = {"counter": ("_total",), "histogram": HISTOGRAM_SUFFIXES,
                  "summary": ("_sum", "_count")}.get(family.type, ("",))
        for suffix in series:
            types[family.name + suffix] = family.type
        for sample in family.samples:
            types.setdefault(sample.name, family.type)
            samples[sample.name] = samples.get(sample.name, 0) + 1
    return types, samples


@pytest.fixture(scope="module")
def exported(tiny_llama_dir) -> dict[str, tuple[dict[str, str], dict[str, int]]]:
    """Each live process's exposition, by the worker role or "gateway", after one request."""
    workers = []
    gateway = None
    try:
        for role in ("decode", "prefill", "both"):
            workers.append(start_worker(role, tiny_llama_dir, "--num-kv-blocks", "64"))
        decode, prefill, _ = workers
        gateway = ServiceProcess("gateway", [
            "gateway", "--model", str(tiny_llama_dir), "--port", "0", "--grpc-port", "0",
            "--health-interval-s", "0.2", "--prefill", prefill.address,
            "--decode", decode.address]).wait_ready()
        admin = f"http://{gateway.admin_address}"
        response = httpx.post(f"http://{gateway.address}/v1/completions", timeout=60, json={
            "model": tiny_llama_dir.name, "prompt": list(range(20, 60)), "max_tokens": 4,
            "temperature": 0, "ignore_eos": True})
        assert response.status_code == 200, response.text
        result = {"gateway": exposition(admin)}
        for worker in workers:
            result[worker.role] = exposition(f"http://{worker.metrics_address}")
        return result
    finally:
        if gateway is not None:
            gateway.stop()
        for worker in workers:
            worker.kill()


def test_every_queried_name_is_exported_with_the_type_its_query_assumes(exported) -> None:
    types = {}
    for process_types, _ in exported.values():
        types.update(process_types)
    checked, problems = set(), []
    for rendered in rendered_scenarios():
        for where, expr in queries(rendered):
            rated = set(RATE.findall(expr))
            for name in NAME.findall(expr):
                checked.add(name)
                kind = types.get(name)
                if kind is None:
                    problems.append(f"{rendered.scenario}: {where}: {name} is exported by no process")
                elif name in rated and kind == "gauge":
                    problems.append(f"{rendered.scenario}: {where}: rate() of gauge {name}")
                elif name not in rated and kind != "gauge" and not name.endswith("_bucket"):
                    problems.append(f"{rendered.scenario}: {where}: {name} ({kind}) read as a value")
    assert not problems, "\n".join(problems)
    # The collection itself is not vacuous: both scaler kinds and the dashboard contributed.
    assert {"splitserve_worker_queued_prefill_tokens", "splitserve_kv_blocks_used",
            "splitserve_gateway_ttft_seconds_bucket", "splitserve_kv_transfer_bytes_total"} <= checked


def test_hpa_metrics_are_per_pod_gauges_of_the_pool_they_scale(exported) -> None:
    seen = []
    for rendered in rendered_scenarios():
        for role, metric in hpa_metrics(rendered):
            # A per-pod gauge as an External metric is summed over the pool: N pods at 0.5 read
            # as N x 0.5 and the pool grows without end. Pods metrics are averaged per pod.
            assert metric["type"] == "Pods", (rendered.scenario, metric)
            assert metric["pods"]["target"]["type"] == "AverageValue"
            name = metric["pods"]["metric"]["name"]
            types, samples = exported[role]
            assert types.get(name) == "gauge", (rendered.scenario, role, name)
            # One series per process, i.e. per pod: the adapter's average is over pods.
            assert samples.get(name) == 1, (rendered.scenario, role, name)
            seen.append((role, name))
    assert {("prefill", "splitserve_worker_queued_prefill_tokens"),
            ("decode", "splitserve_kv_usage_ratio"), ("both", "splitserve_kv_usage_ratio")} <= set(seen)


def test_name_collection_finds_a_name_no_process_exports() -> None:
    # Guards the tests above: the collector must see a custom query's names.
    values = {"autoscaler": {"enabled": False},
              "keda": {"enabled": True, "prefill": {"query": "sum(splitserve_queue_depth)"}}}
    names = {n for _, expr in queries(render(values)) for n in NAME.findall(expr)}
    assert "splitserve_queue_depth" in names
