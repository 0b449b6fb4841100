"""The chart lints clean under `helm lint --strict` and refuses contradictory values with a message
that names what to change."""

from __future__ import annotations

import helm_python as helm
import pytest
from chart_render import CHART_DIR, KUBE_VERSIONS, NAMESPACE, SCENARIOS, render, render_scenario

# helm lint severities: 1 info, 2 warning, 3 error. Strict mode makes warnings fail too; the one
# info Helm still prints is "icon is recommended" (the chart ships no icon).
WARNING = 2


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_strict_lint_is_clean(scenario: str, kube_version: str) -> None:
    report = helm.lint(CHART_DIR, SCENARIOS[scenario], strict=True, namespace=NAMESPACE,
                       kube_version=f"v{kube_version}")
    problems = [m for m in report["messages"] if m["severity"] >= WARNING]
    assert report["errors"] == [] and problems == [], (report["errors"], problems)
    assert report["total_charts_linted"] == 1


def test_lint_would_catch_a_broken_template(tmp_path) -> None:
    # Guards the test above: the same call must report a template error when there is one.
    broken = tmp_path / "splitserve"
    with helm.Chart.load(CHART_DIR) as chart:
        chart.save_dir(tmp_path)
    (broken / "templates" / "broken.yaml").write_text("{{ .Values.nope.deeper }}\n")
    report = helm.lint(broken, {}, strict=True, namespace=NAMESPACE)
    assert report["errors"] or any(m["severity"] >= WARNING for m in report["messages"])


def _render_error(values: dict) -> str:
    with pytest.raises(helm.HelmError) as caught:
        render(values)
    return str(caught.value)


@pytest.mark.parametrize(
    "scalers",
    [("hpa", "keda"), ("autoscaler", "hpa"), ("autoscaler", "keda"), ("autoscaler", "hpa", "keda")],
)
def test_two_scalers_for_the_same_pools_fail_rendering(scalers: tuple[str, ...]) -> None:
    values = {name: {"enabled": name in scalers} for name in ("autoscaler", "hpa", "keda")}
    message = _render_error(values)
    assert "enable at most one" in message
    assert f"enabled now: {','.join(scalers)}" in message


def test_hpa_alone_or_keda_alone_renders() -> None:
    for scaler in ("hpa", "keda"):
        values = {"autoscaler": {"enabled": False}, scaler: {"enabled": True}}
        assert render(values).objects


def test_redis_must_be_bundled_or_external_not_neither_nor_both() -> None:
    assert "discovers workers through Redis" in _render_error({"redis": {"enabled": False}})
    both = {"redis": {"enabled": True, "external": {"url": "redis://cache:6379/0"}}}
    assert "set redis.enabled=false" in _render_error(both)


def test_grace_period_must_cover_prestop_and_drain() -> None:
    message = _render_error({"worker": {"terminationGracePeriodSeconds": 20}})
    assert "worker.terminationGracePeriodSeconds (20)" in message and "(40)" in message
    message = _render_error({"gateway": {"terminationGracePeriodSeconds": 10}})
    assert "gateway.terminationGracePeriodSeconds (10)" in message


def test_gpus_with_the_cpu_image_fail() -> None:
    message = _render_error({"image": {"variant": "cpu"}})
    assert "prefill.gpus=1" in message and "image.variant=cuda" in message


def test_model_path_outside_the_mount_fails() -> None:
    assert "must lie under model.mountPath" in _render_error({"model": {"path": "/weights/x"}})


def test_min_above_max_replicas_fails() -> None:
    values = {"autoscaler": {"enabled": False},
              "keda": {"enabled": True, "decode": {"minReplicas": 5, "maxReplicas": 2}}}
    assert "keda.decode.minReplicas (5) is above maxReplicas (2)" in _render_error(values)


@pytest.mark.parametrize(
    "values, where",
    [
        ({"gateway": {"replica": 3}}, "/gateway"),
        ({"image": {"variant": "rocm"}}, "/image/variant"),
        ({"worker": {"grpcPort": 70000}}, "/worker/grpcPort"),
        ({"model": {"volume": {"type": "nfs"}}}, "/model/volume/type"),
        ({"prefill": {"kvCacheMemory": "lots"}}, "/prefill/kvCacheMemory"),
        ({"gateway": {"apiKeys": {"keys": ["a,b"]}}}, "/gateway/apiKeys/keys/0"),
        ({"redis": {"enabled": False, "external": {"url": "cache:6379"}}}, "/redis/external/url"),
        ({"decode": {"pdb": {"enabled": True, "minAvailable": 1}}}, "/decode/pdb"),
    ],
)
def test_schema_rejects_bad_values_and_names_the_key(values: dict, where: str) -> None:
    with helm.Chart.load(CHART_DIR) as chart, pytest.raises(helm.HelmValuesError) as caught:
        chart.validate_schema(values)
    assert where in str(caught.value)


def test_every_default_value_is_described_by_the_schema() -> None:
    # additionalProperties is false throughout, so this fails if values.yaml grows a key the
    # schema does not know (or the schema drifts from values.yaml).
    with helm.Chart.load(CHART_DIR) as chart:
        chart.validate_schema(chart.values)
        assert chart.schema["additionalProperties"] is False


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_rendered_manifests_have_no_stray_whitespace(scenario: str) -> None:
    for path, text in render_scenario(scenario).manifests.items():
        for number, line in enumerate(text.splitlines(), 1):
            assert line == line.rstrip(), f"{path}:{number}: trailing whitespace"
