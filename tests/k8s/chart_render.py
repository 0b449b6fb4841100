"""Renders the Helm chart offline (Helm's own engine via helm-python-sdk) for the k8s tests."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import helm_python as helm
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "k8s" / "splitserve"
RELEASE = "demo"
NAMESPACE = "llm"
# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest schemas at hand.
KUBE_VERSIONS = ("1.27.0", "1.37.0")

# Each values scenario the chart must render cleanly: the defaults plus every ci/*-values.yaml
# (the chart-testing convention, so `ct lint` covers the same set).
SCENARIOS: dict[str, dict] = {"default": {}}
for _path in sorted((CHART_DIR / "ci").glob("*-values.yaml")):
    SCENARIOS[_path.name.removesuffix("-values.yaml")] = yaml.safe_load(_path.read_text()) or {}


@dataclass(frozen=True)
class Rendered:
    """One scenario's output: the manifests as objects and as text, and NOTES.txt."""

    scenario: str
    objects: tuple[dict, ...]
    manifests: dict[str, str]
    notes: str

    def of_kind(self, kind: str) -> list[dict]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> dict:
        found = [o for o in self.of_kind(kind) if o["metadata"]["name"] == name]
        assert len(found) == 1, f"{self.scenario}: expected one {kind}/{name}, found {len(found)}"
        return found[0]

    def names(self, kind: str) -> set[str]:
        return {o["metadata"]["name"] for o in self.of_kind(kind)}


def render(values: dict | None = None, scenario: str = "custom") -> Rendered:
    """Render with `values` over the chart defaults; raises helm.HelmError on a template failure."""
    with helm.Chart.load(CHART_DIR) as chart:
        chart.validate_schema(values or {})
        manifests = chart.render(values=values or {}, name=RELEASE, namespace=NAMESPACE,
                                 is_install=True)
    objects, notes = [], ""
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                objects.append(doc)
    return Rendered(scenario, tuple(objects), manifests, notes)


@functools.cache
def render_scenario(name: str) -> Rendered:
    return render(SCENARIOS[name], scenario=name)


def pod_templates(rendered: Rendered) -> list[tuple[dict, dict]]:
    """(workload, pod template) for every Deployment."""
    return [(d, d["spec"]["template"]) for d in rendered.of_kind("Deployment")]


def worker_deployments(rendered: Rendered) -> dict[str, str]:
    """Worker Deployment name -> its --role: prefill and decode, or the one role-both pool."""
    workers = {}
    for deployment, pod in pod_templates(rendered):
        args = pod["spec"]["containers"][0]["args"]
        if args[:1] == ["worker"]:
            workers[deployment["metadata"]["name"]] = args[args.index("--role") + 1]
    return workers


def selects(selector: dict, labels: dict) -> bool:
    """A metav1.LabelSelector's meaning (matchLabels and matchExpressions)."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        present, value = expr["key"] in labels, labels.get(expr["key"])
        op = expr["operator"]
        if (op == "In" and value not in expr["values"]) or (op == "NotIn" and value in expr["values"]):
            return False
        if (op == "Exists" and not present) or (op == "DoesNotExist" and present):
            return False
    return True
