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
    assert proc.returncode == 0, _failure(proc, out)
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


def _failure(proc: subprocess.CompletedProcess, out: Path) -> str:
    """What a failed run said, with each failed system's recorded error and its log's tail (a
    system that did not start leaves no line of its own in the output)."""
    text = proc.stdout[-3000:] + proc.stderr[-3000:]
    try:
        systems = json.loads((out / "results.json").read_text())["systems"]
    except (OSError, ValueError, KeyError):
        return text
    for name, info in systems.items():
        if "error" in info:
            log = out / "logs" / f"{name}.log"
            text += f"\n{name}: {info['error']}\n" + (log.read_text()[-3000:] if log.is_file()
                                                      else "(no log)")
    return text


@pytest.mark.slow
def test_interleaved_rounds_take_turns_against_real_deployments(tiny_llama_dir, tmp_path):
    """--rounds 2: both deployments up at once, each point run twice with the order rotated,
    every round recorded with its own raw file, the tables drawn from the median round."""
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.compare", "--quick", "--model", str(tiny_llama_dir),
         "--systems", "splitserve-agg,splitserve-disagg", "--workloads", "chat", "--rates", "4",
         "--duration", "2", "--rounds", "2", "--out", str(out), "--no-progress"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, _failure(proc, out)
    results = json.loads((out / "results.json").read_text())
    assert results["plan"]["rounds"] == 2
    turns = [(p["round"], p["system"]) for p in results["points"]]
    first, second = turns[0][1], turns[1][1]
    assert turns == [(1, first), (1, second), (2, second), (2, first)]
    for p in results["points"]:
        assert p["summary"]["completed"] == p["summary"]["requests"] > 0
        assert p["raw"].endswith(f"_r{p['round']}.json") and (out / p["raw"]).exists()
        assert p["cpu"]["quiet_wait_s"] >= 0
    report = (out / "report.md").read_text()
    assert "## Rounds" in report and "Interleaved: every system was up at once" in report
    for name in ("splitserve-agg", "splitserve-disagg"):
        assert "all processes stopped" in (out / results["systems"][name]["log"]).read_text()
