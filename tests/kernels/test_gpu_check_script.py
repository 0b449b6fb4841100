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


def test_engine_steps_run_interpreted_and_the_summary_tabulates_them(tmp_path):
    """parity and engine at tiny sizes: every code path of the device run but CUDA graphs."""
    env = {"TRITON_INTERPRET": "1"}
    done = run(["parity", "--smoke", "--out", str(tmp_path)], env)
    assert done.returncode == 0, done.stdout + done.stderr
    parity = json.loads((tmp_path / "parity.json").read_text())["rows"]
    assert len(parity) == 2 and all(r["ok"] and r["compared"] == 12 for r in parity), parity
    done = run(["engine", "--smoke", "--out", str(tmp_path)], env)
    assert done.returncode == 0, done.stdout + done.stderr
    engine = json.loads((tmp_path / "engine.json").read_text())
    assert engine["batch1_ms"] > 0 and engine["batch1_eager_ms"] > 0
    assert [t["batch"] for t in engine["throughput"]] == [2, 4]
    assert engine["prefill_tok_s"] > 0 and "triton paged decode" in engine["kernels"]
    done = run(["summary", "--out", str(tmp_path)], {})
    assert done.returncode == 0, done.stderr
    text = (tmp_path / "summary.txt").read_text()
    assert text.count("tokens equal, 0 near-ties, 0 failures") == 2
    assert "batch-1 decode" in text and "offline batch 4" in text and "prefill 64 tokens" in text


def test_parity_fails_an_engine_that_rotates_nothing(monkeypatch):
    """The parity step can fail: with every rotary angle zero the engine's tokens leave
    transformers' at once, and not as near-ties."""
    import torch

    from bench.gpu.engine_check import parity_case
    from engine.layers.rotary import RotaryEmbedding

    def no_rotation(self, positions, dtype):
        ones = torch.ones(len(positions), 1, self.cos.shape[-1], dtype=dtype)
        return ones, torch.zeros_like(ones)

    monkeypatch.setattr(RotaryEmbedding, "cos_sin", no_rotation)
    row = parity_case("smollm2-135m", torch.float32, torch.device("cpu"), smoke=True)
    assert not row["ok"] and row["failures"] >= 1, row


def test_a_cut_short_engine_step_still_tabulates_what_it_measured():
    """check.sh kills a step at its time limit; the engine step saves after each figure, and
    the summary must read such a partial record."""
    from bench.gpu.engine_check import format_engine

    partial = {"shape": "llama-8b", "dtype": "bfloat16", "settings": "s", "copy_read_gbs": 2000.0,
               "sum_read_gbs": 4000.0, "read_floor_ms_copy": 7.5, "read_floor_ms_sum": 3.75,
               "engine_start_s": 30.0, "cuda_graphs": True, "graph_sizes": "1..256",
               "capture_s": 2.0, "graph_replays": 70, "batch1_ms": 4.5}
    lines = format_engine(partial)
    assert any("4.50 ms/token" in line and "0.60x" in line and "1.20x" in line for line in lines)
    assert not any("eager" in line or "prefill" in line for line in lines)
    assert "FAILED boom" in "\n".join(format_engine({**partial, "error": "boom"}))


def test_without_pytest_or_its_wheels_the_tests_step_is_recorded_as_skipped(tmp_path):
    """A Python without pytest (a fresh venv) and no wheels to install it from: every step
    still runs and fails on its own (no torch there), and the tests step says why it did not."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(REPO / "bench" / "gpu" / "check.sh"), str(out)],
                          env={**os.environ, "PYTHON": str(venv / "bin" / "python"),
                               "CHECK_WHEELS": str(tmp_path / "none"), "CHECK_BUDGET_S": "60"},
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    steps = dict(line.split("\t")[:2] for line in (out / "steps.tsv").read_text().splitlines())
    assert steps["gpu-tests"] == "skipped (no pytest)"
    assert "no pytest here and no wheels" in done.stdout
    assert set(steps) >= {"env", "engine", "parity", "kernels", "summary"}
