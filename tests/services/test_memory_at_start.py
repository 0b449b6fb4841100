"""A real worker profiles its largest step at start, logs weight, peak-step and KV-pool bytes,
exports them on /metrics, and refuses to start, with the numbers and no traceback, when its KV
pool cannot hold one request of max_model_len tokens."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from splitserve_cli.processes import start_worker
from tests.metrics_text import scrape_worker

pytestmark = pytest.mark.timeout(120)


def checkpoint_elements(model_dir) -> int:
    from safetensors import safe_open

    total = 0
    for file in model_dir.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                total += f.get_tensor(name).numel()
    return total


def memory_fields(worker) -> dict[str, str]:
    """The fields of the worker's 'memory at start:' log line (JSON logs on stdout/stderr)."""
    for line in worker.lines:
        if line.startswith("{") and "memory at start:" in line:
            message = json.loads(line)["message"]
            return dict(f.split("=", 1) for f in message.split() if "=" in f)
    raise AssertionError(f"no memory line in the worker's output:\n{worker.output}")


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_worker_logs_and_exports_its_memory_figures(tiny_llama_dir, role):
    worker = start_worker(role, tiny_llama_dir, "--max-num-batched-tokens", "1024")
    try:
        fields = memory_fields(worker)
        metrics = scrape_worker(worker)
        # The default pool on a CPU: half of what is available past the step's peak, at most
        # 1 GiB (the pool before the profile step existed, on any host with 2 GiB to spare).
        assert fields["sized_by"] == "available_ram" and fields["device"] == "cpu"
        per_block = int(fields["bytes_per_block"])
        budget = min(1 << 30, (int(fields["free_bytes"]) - int(fields["peak_step_bytes"])) // 2)
        assert int(fields["kv_pool_bytes"]) == budget // per_block * per_block
        assert fields["profile_step"].startswith("1024tokens/128requests/")
        blocks = metrics[f'splitserve_kv_blocks_total{{role="{role}"}}']
        assert int(fields["kv_blocks"]) == blocks
        for gauge, field in (("weight_bytes", "weights_bytes"),
                             ("kv_pool_bytes", "kv_pool_bytes"),
                             ("peak_step_bytes", "peak_step_bytes")):
            value = metrics[f'splitserve_worker_{gauge}{{role="{role}"}}']
            assert value == int(fields[field]), gauge
        assert metrics[f'splitserve_worker_kv_pool_bytes{{role="{role}"}}'] == (
            blocks * int(fields["bytes_per_block"]))
        # Every checkpoint tensor, in the float32 the tests serve in.
        assert metrics[f'splitserve_worker_weight_bytes{{role="{role}"}}'] == (
            checkpoint_elements(tiny_llama_dir) * 4)
        assert metrics[f'splitserve_worker_peak_step_bytes{{role="{role}"}}'] >= 0
    finally:
        worker.kill()


def test_explicit_num_kv_blocks_wins_and_exports_no_peak(tiny_llama_dir):
    worker = start_worker("both", tiny_llama_dir, "--num-kv-blocks", "40")
    try:
        metrics = scrape_worker(worker)
        assert metrics['splitserve_worker_kv_pool_bytes{role="both"}'] == 40 * 8192
        assert 'splitserve_worker_peak_step_bytes{role="both"}' not in metrics
    finally:
        worker.kill()


def test_a_pool_short_of_one_max_length_request_refuses_to_start(tiny_llama_dir):
    # The tiny model's 512-token context needs 32 blocks of 8 KiB (float32); 64 KiB holds 8.
    cmd = [sys.executable, "-m", "splitserve_cli.main", "worker", "--role", "decode",
           "--model", str(tiny_llama_dir), "--port", "0", "--num-threads", "1",
           "--kv-cache-memory", "64KiB"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    assert done.returncode != 0
    out = done.stdout + done.stderr
    assert "Traceback" not in out, out
    last = out.strip().splitlines()[-1]
    assert last.startswith("splitserve worker: the KV pool holds 8 blocks (128 tokens)"), last
    assert "max_model_len=512 tokens needs 32 blocks" in last and "--max-model-len" in last
    assert "SPLITSERVE_READY" not in out
