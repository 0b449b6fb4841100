"""OTel's service.name follows the standard environment: OTEL_SERVICE_NAME, else service.name in
OTEL_RESOURCE_ATTRIBUTES, else the process's own name. Each case runs setup_tracing in a fresh
Python process (the tracer provider is process-global) and a real worker process serves one
request under OTEL_SERVICE_NAME; spans are read back from the JSON-lines trace file."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from splitserve_cli.processes import start_worker
from tests.services.flows import aggregated, greedy

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]
ONE_SPAN = """
from services.common.tracing import setup_tracing, shutdown_tracing, tracer
assert setup_tracing("splitserve-decode")
with tracer("test").start_as_current_span("probe"):
    pass
shutdown_tracing()
"""


def services_of(trace_file: Path) -> set[str]:
    return {json.loads(line)["service"] for line in trace_file.read_text().splitlines()}


@pytest.mark.parametrize(("env", "expected"), [
    ({}, "splitserve-decode"),
    ({"OTEL_SERVICE_NAME": "decode-pool-a"}, "decode-pool-a"),
    ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attrs,deployment.environment=prod"},
     "from-attrs"),
    ({"OTEL_SERVICE_NAME": "wins", "OTEL_RESOURCE_ATTRIBUTES": "service.name=loses"}, "wins"),
])
def test_service_name_follows_the_environment(tmp_path, env, expected) -> None:
    trace_file = tmp_path / "spans.jsonl"
    base = {k: v for k, v in os.environ.items()
            if k not in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES")}
    subprocess.run([sys.executable, "-c", ONE_SPAN], cwd=ROOT, check=True, timeout=60,
                   env={**base, **env, "SPLITSERVE_TRACE_FILE": str(trace_file),
                        "OTEL_TRACES_EXPORTER": "none"})
    assert services_of(trace_file) == {expected}


def test_a_worker_names_its_spans_by_otel_service_name(tiny_llama_dir, tmp_path) -> None:
    trace_file = tmp_path / "spans.jsonl"
    worker = start_worker("both", tiny_llama_dir, "--num-kv-blocks", "64", env={
        "SPLITSERVE_TRACE_FILE": str(trace_file), "OTEL_SERVICE_NAME": "pool-a-worker"})
    try:
        assert len(asyncio.run(aggregated(worker.address, "traced", list(range(20, 40)),
                                          greedy(3)))) == 3
        deadline = time.monotonic() + 10
        while not (trace_file.exists() and trace_file.read_text()):
            assert time.monotonic() < deadline, "no spans written"
            time.sleep(0.1)
        assert services_of(trace_file) == {"pool-a-worker"}
    finally:
        worker.kill()
