"""A worker's sizes and ports out of range are refused at start in one line naming the flag:
a CLI audit met a ZeroDivisionError (--block-size 0), a negative mmap length (--num-kv-blocks
-1), "one tensor per layer in every list" (--max-model-len -5, --max-num-batched-tokens 0),
and a worker that said it was ready and could run nothing (--max-num-seqs 0)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.common.worker_config import WorkerConfig


@pytest.mark.parametrize(("field", "value", "message"), [
    ("block_size", 0, "--block-size must be >= 1, got 0"),
    ("num_kv_blocks", -1, "--num-kv-blocks must be >= 0 (0: sized from memory), got -1"),
    ("max_model_len", -5, "--max-model-len must be >= 0 (0: the model's), got -5"),
    ("max_num_batched_tokens", 0, "--max-num-batched-tokens must be >= 1, got 0"),
    ("max_num_seqs", 0, "--max-num-seqs must be >= 1, got 0"),
    ("long_prefill_token_threshold", -1, "--long-prefill-token-threshold must be >= 0"),
    ("port", 70000, "--port must be in [0, 65535]"),
    ("kv_port", -1, "--kv-port must be in [0, 65535]"),
    ("metrics_port", -2, "--metrics-port must be in [0, 65535] (0: any free port), or -1"),
])
def test_out_of_range_sizes_and_ports_name_their_flag(tiny_llama_dir, field, value, message):
    with pytest.raises(ValueError) as refused:
        WorkerConfig(role="both", model=str(tiny_llama_dir), **{field: value})
    assert str(refused.value).startswith(message)


def test_the_defaults_and_the_off_values_are_accepted(tiny_llama_dir):
    WorkerConfig(role="both", model=str(tiny_llama_dir))
    WorkerConfig(role="both", model=str(tiny_llama_dir), port=0, kv_port=0, metrics_port=-1, num_kv_blocks=0,
                 max_model_len=0, long_prefill_token_threshold=0)


def test_the_cli_says_it_in_one_line(tiny_llama_dir):
    done = subprocess.run([sys.executable, "-m", "splitserve_cli.main", "worker", "--role",
                           "both", "--model", str(tiny_llama_dir), "--block-size", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == \
        "splitserve worker: --block-size must be >= 1, got 0", done.stderr[-2000:]
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("command, quiet", [("worker", True), ("prefill", True),
                                             ("decode", True), ("gateway", False)])
def test_workers_load_torch_with_its_cpp_warnings_quiet_unless_asked(monkeypatch, command,
                                                                      quiet):
    """c10d's "sendBytes failed" and its 20-frame C++ trace went into a worker's JSON log when
    a decode peer went away (a migration audit). libc10 reads TORCH_CPP_LOG_LEVEL as it loads:
    the worker commands set a default before they import anything; an operator's value wins."""
    import splitserve_cli.main as cli

    seen = {}

    def fake_import(name, command_info):
        seen["level"] = cli.os.environ.get("TORCH_CPP_LOG_LEVEL")
        raise SystemExit(0)

    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "")  # recorded, so the test leaves it as it was
    monkeypatch.delenv("TORCH_CPP_LOG_LEVEL")
    monkeypatch.setattr(cli, "_import_command", fake_import)
    with pytest.raises(SystemExit):
        cli.main([command])
    assert seen["level"] == ("ERROR" if quiet else None)
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "INFO")
    with pytest.raises(SystemExit):
        cli.main([command])
    assert seen["level"] == "INFO"
