"""The Grafana dashboard shows the serving signals an operator watches, and the chart ships it
byte for byte in a ConfigMap Grafana's sidecar picks up."""

from __future__ import annotations

import json
import re

import pytest
from chart_render import CHART_DIR, RELEASE, render, render_scenario

DASHBOARD_FILE = CHART_DIR / "dashboards" / "splitserve.json"


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD_FILE.read_text())


def exprs(panel: dict) -> list[str]:
    return [t["expr"] for t in panel["targets"]]


def panel(dashboard: dict, title: str) -> dict:
    (found,) = [p for p in dashboard["panels"] if p["title"] == title]
    return found


@pytest.mark.parametrize(
    "title, histogram",
    [("Time to first token", "splitserve_gateway_ttft_seconds_bucket"),
     ("Inter-token latency", "splitserve_gateway_itl_seconds_bucket")],
)
def test_latency_panels_show_p50_p90_p99(dashboard: dict, title: str, histogram: str) -> None:
    shown = panel(dashboard, title)
    assert shown["fieldConfig"]["defaults"]["unit"] == "s"
    quantiles = []
    for expr in exprs(shown):
        match = re.fullmatch(
            rf"histogram_quantile\((0\.\d+), sum by \(le\) \(rate\({histogram}\{{(.*)\}}"
            r"\[\$__rate_interval\]\)\)\)", expr)
        assert match, expr
        quantiles.append(match.group(1))
    assert quantiles == ["0.5", "0.9", "0.99"]


@pytest.mark.parametrize(
    "title, needles",
    [
        ("Queue depth", ["splitserve_gateway_queued_requests", "splitserve_worker_waiting_requests"]),
        ("KV cache usage", ["splitserve_kv_blocks_used", "/", "splitserve_kv_blocks_total"]),
        ("Rejections by reason",
         ["sum by (reason)", "rate(splitserve_gateway_rejected_requests_total"]),
        ("KV transfer bandwidth", ["rate(splitserve_kv_transfer_bytes_total"]),
        ("Tokens per tenant",
         ["sum by (tenant, kind)", "rate(splitserve_gateway_served_tokens_total"]),
        ("Requests by outcome",
         ["sum by (outcome)", "rate(splitserve_gateway_requests_total"]),
    ],
)
def test_operational_panels_query_their_metrics(dashboard: dict, title: str, needles: list) -> None:
    (expr,) = exprs(panel(dashboard, title))
    for needle in needles:
        assert needle in expr


def test_queries_are_well_formed_and_filtered_by_namespace(dashboard: dict) -> None:
    for shown in dashboard["panels"]:
        assert shown["datasource"]["uid"] == "${datasource}"
        for expr in exprs(shown):
            for opening, closing in ("()", "{}", "[]"):
                assert expr.count(opening) == expr.count(closing), expr
            for selector in re.findall(r"splitserve_\w+\{([^}]*)\}", expr):
                first, *more = selector.split(", ")
                assert first == 'namespace=~"$namespace"', expr
                assert all(re.fullmatch(r'outcome="(error|rejected)"', m) for m in more), expr
            # Names the processes export (tests/gateway/test_observability.py scrapes them).
            assert set(re.findall(r"splitserve_\w+", expr)) <= {
                "splitserve_gateway_ttft_seconds_bucket", "splitserve_gateway_itl_seconds_bucket",
                "splitserve_gateway_queued_requests", "splitserve_worker_waiting_requests",
                "splitserve_kv_blocks_used", "splitserve_kv_blocks_total",
                "splitserve_gateway_rejected_requests_total",
                "splitserve_kv_transfer_bytes_total", "splitserve_gateway_served_tokens_total",
                "splitserve_gateway_requests_total"}


def test_error_ratio_divides_errors_and_rejections_by_every_request(dashboard: dict) -> None:
    shown = panel(dashboard, "Error ratio")
    assert shown["fieldConfig"]["defaults"]["unit"] == "percentunit"
    every = 'sum(rate(splitserve_gateway_requests_total{namespace=~"$namespace"}[$__rate_interval]))'
    for expr, outcome in zip(exprs(shown), ("error", "rejected"), strict=True):
        assert expr == ('sum(rate(splitserve_gateway_requests_total{namespace=~"$namespace", '
                        f'outcome="{outcome}"}}[$__rate_interval])) / {every}'), expr


def test_layout_has_unique_ids_and_no_overlapping_panels(dashboard: dict) -> None:
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for shown in dashboard["panels"]:
        g = shown["gridPos"]
        assert g["x"] + g["w"] <= 24
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, shown["title"]
        cells |= mine
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert variables == {"datasource", "namespace"}


def test_chart_ships_the_dashboard_verbatim_with_the_sidecar_label() -> None:
    rendered = render_scenario("keda")
    configmap = rendered.get("ConfigMap", f"{RELEASE}-splitserve-dashboard")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["namespace"] == "monitoring"
    assert configmap["metadata"]["annotations"] == {"grafana_folder": "LLM serving"}
    assert configmap["data"]["splitserve.json"] == DASHBOARD_FILE.read_text().rstrip("\n")


def test_dashboard_is_off_unless_enabled() -> None:
    names = render({}).names("ConfigMap")
    assert f"{RELEASE}-splitserve-dashboard" not in names
