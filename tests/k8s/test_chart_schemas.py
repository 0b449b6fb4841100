"""Every rendered object validates against its API schema in strict mode (unknown fields fail):
Kubernetes kinds against the schemas kubernetes-validate ships, the CRD kinds (KEDA, Prometheus
Operator) against schemas written here for the fields the chart uses. A kind with no schema is
a failure, not a skip."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
from chart_render import KUBE_VERSIONS, SCENARIOS, render_scenario

CRD_SCHEMAS = {
    (path.stem.rsplit("_", 1)[0].replace("_", "/"), path.stem.rsplit("_", 1)[1]): path
    for path in (Path(__file__).parent / "schemas").glob("*.json")
}


def _crd_schema(obj: dict) -> dict | None:
    key = (obj["apiVersion"], obj["kind"].lower())
    return json.loads(CRD_SCHEMAS[key].read_text()) if key in CRD_SCHEMAS else None


# Kinds the chart renders only from this Kubernetes version (their API's GA).
NEWER_KINDS = {"ValidatingAdmissionPolicy": (1, 30), "ValidatingAdmissionPolicyBinding": (1, 30)}


def _version(kube_version: str) -> tuple[int, int]:
    major, minor = kube_version.split(".")[:2]
    return int(major), int(minor)


def validate_object(obj: dict, kube_version: str) -> None:
    """Raises on any schema violation, or when no schema exists for the object's kind."""
    crd_schema = _crd_schema(obj)
    if crd_schema is not None:
        jsonschema.Draft202012Validator(crd_schema).validate(obj)
        return
    kubernetes_validate.validate(obj, kube_version, strict=True)


def test_crd_schemas_are_found_by_api_version_and_kind() -> None:
    assert set(CRD_SCHEMAS) == {("keda.sh/v1alpha1", "scaledobject"),
                                ("monitoring.coreos.com/v1", "servicemonitor")}
    for path in CRD_SCHEMAS.values():
        jsonschema.Draft202012Validator.check_schema(json.loads(path.read_text()))


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_object_validates_strictly(scenario: str, kube_version: str) -> None:
    rendered = render_scenario(scenario)
    failures = []
    for obj in rendered.objects:
        if _version(kube_version) < NEWER_KINDS.get(obj["kind"], (0, 0)):
            # The chart renders these only on a cluster that has them (semverCompare on
            # .Capabilities.KubeVersion); the offline renderer is Helm's default version.
            continue
        try:
            validate_object(obj, kube_version)
        except kubernetes_validate.SchemaNotFoundError as exc:
            failures.append(f"{obj['kind']}/{obj['metadata']['name']}: no schema ({exc.message})")
        except jsonschema.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            failures.append(f"{obj['kind']}/{obj['metadata']['name']}: {where}: {exc.message}")
    assert not failures, "\n".join(failures)


def test_scenarios_cover_every_kind_the_chart_can_render() -> None:
    kinds = {o["kind"] for name in SCENARIOS for o in render_scenario(name).objects}
    assert kinds == {
        "ConfigMap", "Deployment", "HorizontalPodAutoscaler", "NetworkPolicy",
        "PersistentVolumeClaim", "PodDisruptionBudget", "Role", "RoleBinding", "ScaledObject",
        "Secret", "Service", "ServiceAccount", "ServiceMonitor", "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    }


def test_strict_validation_rejects_an_unknown_field() -> None:
    # The checks above could pass vacuously if strict mode ignored unknown fields.
    deployment = json.loads(json.dumps(render_scenario("default").of_kind("Deployment")[0]))
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = {}
    with pytest.raises(jsonschema.ValidationError):
        validate_object(deployment, KUBE_VERSIONS[-1])


def test_a_kind_without_a_schema_is_an_error() -> None:
    unknown = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        validate_object(unknown, KUBE_VERSIONS[-1])


@pytest.mark.parametrize(
    "mutate",
    [
        lambda so: so["spec"]["triggers"][0]["metadata"].update(threshold=8),
        lambda so: so["spec"]["triggers"][0]["metadata"].pop("query"),
        lambda so: so["spec"].update(maxReplicas=4),
    ],
    ids=["numeric-threshold", "missing-query", "misspelt-field"],
)
def test_keda_schema_rejects_mistakes(mutate) -> None:
    scaled_object = json.loads(json.dumps(render_scenario("keda").of_kind("ScaledObject")[0]))
    mutate(scaled_object)
    with pytest.raises(jsonschema.ValidationError):
        validate_object(scaled_object, KUBE_VERSIONS[-1])
