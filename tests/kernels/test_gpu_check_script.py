"""bench/gpu/check.sh, the prepared device check, as far as a CPU machine can run it: the shell
script parses, its kernel step runs every case at tiny sizes under the Triton interpreter
(--smoke) and skips cleanly without CUDA, and its summary reads the steps' results. Real
processes, as check.sh runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[2]
CHECK = [sys.executable, str(REPO / "bench" / "gpu" / "check.py")]


def run(args, env_changes, timeout=120):
    env = {**os.environ, **env_changes}
    for name in [k for k, v in env_changes.items() if v is None]:
        env.pop(name)
    return subprocess.run(CHECK + args, env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def test_check_script_parses():
    done = subprocess.run(["bash", "-n", str(REPO / "bench" / "gpu" / "check.sh")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_kernel_step_runs_every_case_interpreted_and_the_summary_tabulates_it(tmp_path):
    done = run(["kernels", "--smoke", "--out", str(tmp_path)], {"TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads((tmp_path / "kernels.json").read_text())["rows"]
    assert {row["kernel"] for row in rows} == {"decode", "prefill", "rmsnorm", "rotary_kv"}
    for row in rows:
        assert "error" not in row, row
        assert row["max_error"] <= 1e-5 and row["triton_ms"] > 0 and row["reference_ms"] > 0
    (tmp_path / "steps.tsv").write_text("env\t1\t2\nkernels\t0\t9\ngpu-kernel-tests\t124\t240\n")
    (tmp_path / "half.xml").write_text("<testsuites><testsuite")  # a killed pytest's report
    done = run(["summary", "--out", str(tmp_path)], {})
    assert done.returncode == 0, done.stderr
    text = (tmp_path / "summary.txt").read_text()
    assert "gpu-kernel-tests rc 124" in text and "half.xml: 0 passed, unreadable" in text
    assert text.count("max err") == len(rows)
    assert json.loads((tmp_path / "summary.json").read_text())["kernels"]["rows"] == rows


def test_kernel_step_without_cuda_records_a_skip(tmp_path):
    done = run(["kernels", "--out", str(tmp_path)], {"CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "kernels.json").read_text()) == {"skipped": "no CUDA device",
                                                                  "rows": []}


def test_smoke_without_the_interpreter_is_refused(tmp_path):
    done = run(["kernels", "--smoke", "--out", str(tmp_path)], {"TRITON_INTERPRET": None})
    assert done.returncode == 2 and "TRITON_INTERPRET=1" in done.stdout
