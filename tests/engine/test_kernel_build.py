"""The C++ kernels cannot vanish silently: with CI=true a failed build fails the kernel tests
(a real build with a compiler that does not exist, in a pytest of its own), elsewhere they
skip naming why; and the engine logs one line naming the path each hot op takes."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from engine_harness import make_engine
from kernel_build import require_cpu_kernels

from engine.config import EngineConfig, cpu_has_fast_bf16
from engine.llm_engine import LLMEngine
from kernels import cpu_kernels
from kernels.linear import SMALL_M_CANDIDATES, small_m_linear_available

REPO = Path(__file__).resolve().parents[2]


def _pytest_with_a_broken_compiler(tmp_path, ci: bool) -> subprocess.CompletedProcess:
    """tests/engine/test_cpu_kernels.py where the kernels must be built (an empty extension
    cache) by a C++ compiler that does not exist."""
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env.update(CXX=str(tmp_path / "no-such-c++"), TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    if ci:
        env["CI"] = "true"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "tests/engine/test_cpu_kernels.py", "-q",
         "-p", "no:cacheprovider", "-rs"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )


def test_in_ci_a_failed_kernel_build_fails_the_kernel_tests(tmp_path):
    result = _pytest_with_a_broken_compiler(tmp_path, ci=True)
    assert result.returncode != 0, result.stdout[-2000:]
    assert "CI=true and the C++ CPU kernels did not build" in result.stdout, result.stdout[-2000:]
    assert "no-such-c++" in result.stdout  # the compiler's own complaint, not just a verdict


def test_outside_ci_a_failed_kernel_build_skips_naming_why(tmp_path):
    result = _pytest_with_a_broken_compiler(tmp_path, ci=False)
    assert result.returncode == 0, result.stdout[-2000:]
    assert "skipped" in result.stdout and "passed" not in result.stdout
    assert "the C++ CPU kernels did not build" in result.stdout


@pytest.mark.skipif(not cpu_kernels.load(), reason="needs a built library to copy")
def test_a_finished_build_loads_at_once_past_a_lock_left_by_a_killed_build(tmp_path):
    """A build folder holding the library for these very sources and an hour-old `lock` (its
    builder was killed): a fresh process loads the library without waiting on that lock and
    without a compiler. (torch's own loader waits on such a lock for ever.)"""
    library = cpu_kernels.library_path()
    folder = tmp_path / "ext" / library.parent.name
    folder.mkdir(parents=True)
    (folder / library.name).write_bytes(library.read_bytes())
    lock = folder / "lock"
    lock.touch()
    os.utime(lock, (lock.stat().st_atime - 3600, lock.stat().st_mtime - 3600))
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"),
           "CXX": str(tmp_path / "no-such-c++")}
    code = ("from kernels import cpu_kernels; import torch; "
            "print(cpu_kernels.load(), cpu_kernels.library_path(), "
            "hasattr(torch.ops.splitserve_cpu, 'prefill_attention'))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.stdout.split() == ["True", str(folder / library.name), "True"], result.stderr[-2000:]
    assert not lock.exists()


def test_require_cpu_kernels_reads_ci_from_the_environment(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_loaded", False)
    monkeypatch.setattr(cpu_kernels, "_error", "CalledProcessError: c++ exited 1")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="c\\+\\+ exited 1"):
        require_cpu_kernels()
    monkeypatch.setenv("CI", "false")
    mark = require_cpu_kernels()
    assert mark.name == "skip" and "c++ exited 1" in mark.kwargs["reason"]


def _kernel_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "engine.model_runner" and r.getMessage().startswith("kernels on ")]


def test_the_engine_logs_one_line_naming_each_path(tiny_llama_dir, caplog):
    caplog.set_level(logging.INFO, logger="engine.model_runner")
    make_engine(tiny_llama_dir, cpu_attention="torch")  # float32, head_dim 8
    (line,) = _kernel_lines(caplog)
    assert line == (
        "kernels on cpu in float32: decode attention torch SDPA reference; prefill attention "
        "torch SDPA reference; linear torch F.linear; fused decode off (per-layer modules)"
    )


@pytest.mark.skipif(not (cpu_has_fast_bf16() and cpu_kernels.load() and small_m_linear_available()),
                    reason="the shipped path here is float32 or the torch reference")
def test_the_shipped_defaults_log_every_cpp_path(smollm2_dir, caplog):
    caplog.set_level(logging.INFO, logger="engine.model_runner")
    engine = LLMEngine(EngineConfig(model=str(smollm2_dir), device="cpu", num_kv_blocks=4))
    (line,) = _kernel_lines(caplog)
    assert engine.runner.dtype == torch.bfloat16
    # Up to how many rows the small-M kernel beats torch's mm is measured at start...
    rows = engine.runner.small_m_max_rows
    assert rows in (0, *SMALL_M_CANDIDATES)
    # ...and the layout of the weights' packed copies (AMX tiles where the CPU has them).
    torch_linear = {"amx": "cpp amx_linear (AMX tiles, packed weights)",
                    "packed": "torch F.linear (oneDNN packed weights)"}.get(
                        engine.runner.weight_layout, "torch F.linear")
    linear = (f"cpp small_m_linear (AVX-512 BF16, <= {rows} rows), {torch_linear} above" if rows
              else torch_linear)
    # So is whether the C++ prefill attention beats torch's SDPA here.
    tiles = "AMX tiles" if torch.ops.splitserve_cpu.has_amx_bf16() else "AVX-512 BF16"
    prefill = (f"cpp prefill_attention ({tiles})" if engine.runner.native_prefill
               else "torch SDPA reference")
    assert line == (
        "kernels on cpu in bfloat16: decode attention cpp paged_decode_attention (AVX-512 "
        f"head_dim-64, shared prefixes once); prefill attention {prefill}; linear {linear}; "
        "fused decode cpp decode_layers"
    )


def test_splitserve_doctor_prints_the_build_the_model_and_its_paths(tiny_llama_dir, capsys):
    import argparse

    from splitserve_cli import doctor

    args = argparse.Namespace(model=str(tiny_llama_dir), dtype="float32", device="cpu")
    assert doctor.run(args) == 0
    out = capsys.readouterr().out
    built = cpu_kernels.load()
    assert ("C++ CPU kernels: built" if built else "C++ CPU kernels: NOT built") in out
    assert "LlamaForCausalLM, 2 layers, head_dim 8, rope scaling none, sliding window none" in out
    decode = ("cpp paged_decode_attention (portable, shared prefixes once)" if built
              else "torch SDPA reference")
    assert f"kernels on cpu in float32: decode attention {decode};" in out
