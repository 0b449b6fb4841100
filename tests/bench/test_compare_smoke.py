"""`python -m bench.compare --quick` end to end against a real tiny-model splitserve deployment
(`splitserve up --mode disagg`) with the shipped admission settings: it starts, serves the
workload exactly, reports (settings included), and stops."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quick_compare_runs_against_a_real_disaggregated_deployment(tiny_llama_dir, tmp_path):
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.compare", "--quick", "--model", str(tiny_llama_dir),
         "--systems", "splitserve-disagg", "--workloads", "chat", "--rates", "4",
         "--duration", "3", "--out", str(out), "--no-progress"],
        cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert "error" not in results["systems"]["splitserve-disagg"]
    [point] = results["points"]
    s = point["summary"]
    assert (point["workload"], point["rate"]) == ("chat", 4.0)
    assert s["requests"] > 0 and s["completed"] == s["requests"]
    assert s["inexact_outputs"] == 0 and s["inexact_prompts"] == 0
    assert s["ttft_s"]["p99"] is not None and s["output_throughput"] > 0
    raw = json.loads((out / point["raw"]).read_text())
    assert len(raw["requests"]) == s["requests"]
    report = (out / "report.md").read_text()
    assert "## Workload `chat`" in report
    # The shipped admission, printed and recorded: no gateway override on the default command line.
    settings = results["plan"]["settings"]
    assert [o for o in settings["overrides"] if o["process"] == "gateway"] == []
    assert settings["admission"]["ttft_target_s"] == "1"
    assert "## Settings" in report and "ttft_target_s=1 [default]" in report
    assert "gateway admission: ttft_target_s=1 [default]" in proc.stdout
    assert "chat @ 4 req/s:" in proc.stdout and " refused (429: " in proc.stdout
    assert "SPLITSERVE_GATEWAY_TTFT_TARGET_S" not in results["systems"]["splitserve-disagg"]["command"]
    # Teardown went through `splitserve up`'s own orderly stop.
    log = (out / results["systems"]["splitserve-disagg"]["log"]).read_text()
    assert "all processes stopped" in log
