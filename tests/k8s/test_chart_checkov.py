"""checkov finds nothing in the rendered manifests or the Dockerfile; each finding the project
accepts is skipped where it occurs, with its reason (checkov.io/skipN annotations, or
`# checkov:skip=ID: reason` comments in the Dockerfile).

checkov's dependencies clash with the project's pins, so it is not a dev extra: the checkov test
runs when a checkov executable is found ($CHECKOV, then PATH, then /tmp/checkov-venv, where
`python3 -m venv /tmp/checkov-venv && /tmp/checkov-venv/bin/pip install checkov` puts it)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from chart_render import REPO_ROOT, SCENARIOS, render_scenario

# The only findings the project accepts, each justified where it is skipped.
ACCEPTED = {
    "CKV_K8S_43",  # image digest: set per deployment (image.digest), unknown to the chart
    "CKV_K8S_35",  # secrets as env: the processes' configuration interface is the environment
    "CKV_K8S_38",  # service account token: the autoscaler is the one pod that calls the API
    "CKV_K8S_25",  # added capability: IPC_LOCK on the workers only, with rdma.enabled
    "CKV_DOCKER_2",  # HEALTHCHECK: Kubernetes probes each process; the command differs by role
    "CKV_DOCKER_9",  # apt: gcc and libc headers for Triton in the cuda variant
}
SKIP_ANNOTATION = re.compile(r"^checkov\.io/skip\d+$")
SKIP_VALUE = re.compile(r"^(CKV2?_[A-Z0-9]+_\d+)=(.{40,})$")


def find_checkov() -> str | None:
    for candidate in (os.environ.get("CHECKOV"), shutil.which("checkov"),
                      "/tmp/checkov-venv/bin/checkov"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def test_every_skip_names_an_accepted_check_and_gives_a_reason() -> None:
    seen = set()
    for scenario in SCENARIOS:
        for obj in render_scenario(scenario).objects:
            for key, value in (obj["metadata"].get("annotations") or {}).items():
                if key.startswith("checkov.io/"):
                    assert SKIP_ANNOTATION.match(key), key
                    match = SKIP_VALUE.match(value)
                    assert match, f"{obj['metadata']['name']}: {value!r} lacks ID=reason"
                    seen.add(match.group(1))
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    for check, reason in re.findall(r"#\s*checkov:skip=(\S+?):(.*)", dockerfile):
        assert len(reason.strip()) >= 40, check
        seen.add(check)
    assert seen == ACCEPTED


def test_digest_skip_disappears_once_the_image_is_pinned() -> None:
    pinned = render_scenario("keda").get("Deployment", "demo-splitserve-prefill")
    annotations = pinned["metadata"].get("annotations") or {}
    assert not any(v.startswith("CKV_K8S_43=") for v in annotations.values())


def _run(checkov: str, *args: str) -> dict:
    env = {**os.environ, "BC_SKIP_MAPPING": "TRUE", "CHECKOV_RUN_SCA_PACKAGE_SCAN_V2": "false"}
    proc = subprocess.run([checkov, "--skip-download", "-o", "json", *args],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    return report[0] if isinstance(report, list) else report


@pytest.mark.slow
def test_checkov_finds_nothing_unjustified(tmp_path: Path) -> None:
    checkov = find_checkov()
    if checkov is None:
        pytest.skip("checkov not installed (see this module's docstring)")
    for scenario in SCENARIOS:
        objects = render_scenario(scenario).objects
        (tmp_path / f"{scenario}.yaml").write_text(yaml.safe_dump_all(objects, sort_keys=False))
    manifests = _run(checkov, "--framework", "kubernetes", "-d", str(tmp_path))
    dockerfile = _run(checkov, "--framework", "dockerfile", "-f", str(REPO_ROOT / "Dockerfile"))
    for report, min_passed in ((manifests, 1000), (dockerfile, 50)):
        failed = [(c["check_id"], c["resource"]) for c in report["results"]["failed_checks"]]
        assert failed == []
        assert report["summary"]["parsing_errors"] == 0
        assert report["summary"]["passed"] >= min_passed  # it really scanned the objects
        for skipped in report["results"]["skipped_checks"]:
            assert skipped["check_id"] in ACCEPTED
            assert skipped["check_result"]["suppress_comment"].strip()
