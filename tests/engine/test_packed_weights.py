"""Linear weights packed for oneDNN (kernels/packed_weights.py): the packed matmul against
F.linear, the start-up measurement, and the engine with packed and plain weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from engine_harness import drive, parse_worker_flags

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from kernels.packed_weights import calibrate_packing, pack_weight, packed_linear, packing_available

pytestmark = pytest.mark.skipif(not packing_available(), reason="torch built without mkldnn")


@pytest.mark.parametrize("rows", [1, 9, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows, bias):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=generator).bfloat16()
    weight = torch.randn(160, 96, generator=generator).bfloat16()
    b = torch.randn(160, generator=generator).bfloat16() if bias else None
    exact = F.linear(x.float(), weight.float(), None if b is None else b.float())
    plain = F.linear(x, weight, b).float()
    packed = packed_linear(x, pack_weight(weight), b)
    assert packed.shape == (rows, 160) and packed.dtype == torch.bfloat16
    # Both round a float32 sum to bf16; the order of the sum may differ.
    error = (packed.float() - exact).abs().max().item()
    assert error <= 1.5 * (plain - exact).abs().max().item() + 2e-2, error


def test_calibration_keeps_packing_only_when_it_wins_by_the_margin():
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(256, 128, generator=generator).bfloat16() for _ in range(3)]
    kept = calibrate_packing(weights, repeats=1, margin=1e9)
    dropped = calibrate_packing(weights, repeats=1, margin=0.0)
    assert kept.packed and not dropped.packed
    assert [rows for rows, *_ in kept.timings] == [16, 64]
    assert all(p > 0 and q > 0 for _, p, q in kept.timings)
    assert "packed vs plain" in kept.describe()


def _engine(model_dir, layout: str, **config) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), dtype="bfloat16", device="cpu",
                                  num_kv_blocks=128, cpu_weight_layout=layout, **config))


def test_the_engine_generates_the_same_with_packed_and_plain_weights(tiny_llama_dir):
    """Twelve requests decode together (past the small-M kernel's rows, so the packed weights
    are read, in the fused decode call and in the prompt steps' modules): the same greedy
    tokens, logprobs within bf16 noise, and the profiler shows oneDNN's packed matmul ran in
    one engine only."""
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 40, 9, 5, 8, 21, 30, 12, 6, 14, 25)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)
    results, calls = {}, {}
    for layout in ("plain", "packed"):
        engine = _engine(tiny_llama_dir, layout, cpu_small_m_max_rows=8)
        layers = [m for m in engine.runner.model.modules() if hasattr(m, "small_m_max_rows")]
        assert all((m.packed_weight is not None) == (layout == "packed") for m in layers)
        assert ("oneDNN packed weights" in str(engine.runner.kernel_paths)) == (layout == "packed")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for i, prompt in enumerate(prompts):
                engine.add_request(str(i), prompt, params)
            results[layout] = drive(engine)
        calls[layout] = sum(e.count for e in prof.key_averages() if "_linear_pointwise" in e.key)
    assert calls["plain"] == 0 and calls["packed"] > 0
    for rid, expected in results["plain"].items():
        got = results["packed"][rid]
        assert got.token_ids == expected.token_ids
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in got.logprobs]),
                                   torch.tensor([lp.logprob for lp in expected.logprobs]),
                                   rtol=1.6e-2, atol=1e-2)


def test_auto_measures_and_says_what_it_chose(tiny_llama_dir):
    engine = _engine(tiny_llama_dir, "auto")
    assert isinstance(engine.runner.packed_weights, bool)
    assert ("oneDNN packed weights" in str(engine.runner.kernel_paths)) == engine.runner.packed_weights


@pytest.mark.parametrize("layout,dtype,message", [
    ("bogus", "bfloat16", "unknown cpu_weight_layout"),
    ("packed", "float32", "cpu_weight_layout 'packed' needs"),
])
def test_a_layout_that_cannot_run_is_a_clear_error(tiny_llama_dir, layout, dtype, message):
    with pytest.raises(ValueError, match=message):
        LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype=dtype, device="cpu",
                               num_kv_blocks=16, cpu_weight_layout=layout))


def test_the_worker_flag_reaches_the_engine_and_bad_values_are_refused(tiny_llama_dir, monkeypatch):
    from services.common.worker_config import WorkerConfig

    def parse(*argv: str) -> WorkerConfig:
        return parse_worker_flags(tiny_llama_dir, *argv)

    assert parse().engine_config().cpu_weight_layout == "auto"  # measured at start
    assert parse("--cpu-weight-layout", "plain").engine_config().cpu_weight_layout == "plain"
    monkeypatch.setenv("SPLITSERVE_CPU_WEIGHT_LAYOUT", "packed")
    assert parse().cpu_weight_layout == "packed"
    with pytest.raises(ValueError, match="--cpu-weight-layout must be"):
        WorkerConfig(role="decode", model=str(tiny_llama_dir), cpu_weight_layout="blocked")


def test_the_memory_figures_count_the_packed_copies(tiny_llama_dir):
    figures = {}
    for layout in ("plain", "packed"):
        engine = _engine(tiny_llama_dir, layout)
        model = engine.runner.model
        params = {id(p): p for p in model.parameters()}
        figures[layout] = (engine.runner.memory.weights_bytes,
                           sum(p.numel() * p.element_size() for p in params.values()))
        packed = sum(m.weight.numel() * 2 for m in model.modules() if hasattr(m, "small_m_max_rows"))
    assert figures["plain"][0] == figures["plain"][1]
    assert figures["packed"][0] == figures["packed"][1] + packed


def test_auto_keeps_plain_weights_when_the_copies_would_crowd_memory(tiny_llama_dir, monkeypatch,
                                                                       caplog):
    """A host with little memory available (faked: a Kubernetes-free stand-in for a small
    node) keeps plain weights under auto even where packing wins, and says why; asking for
    packed still packs."""
    import logging

    from engine import kernel_choice
    from engine.memory_profile import HostMemory
    from kernels.packed_weights import PackingCalibration

    monkeypatch.setattr(kernel_choice, "calibrate_packing",
                        lambda weights: PackingCalibration(True, ((16, 1.0, 2.0),)))
    monkeypatch.setattr(HostMemory, "free_and_total", lambda self: (1 << 10, 1 << 30))
    caplog.set_level(logging.WARNING, logger="engine.model_runner")
    assert not _engine(tiny_llama_dir, "auto").runner.packed_weights
    assert "linear weights stay plain: packed copies would take" in caplog.text
    assert _engine(tiny_llama_dir, "packed").runner.packed_weights
    monkeypatch.setattr(HostMemory, "free_and_total", lambda self: (1 << 40, 1 << 40))
    monkeypatch.setattr(kernel_choice, "available_memory", lambda: 1 << 40)
    assert _engine(tiny_llama_dir, "auto").runner.packed_weights


def test_available_memory_heeds_a_container_limit(tmp_path, monkeypatch):
    """cgroup v2 files in a folder stand in for a pod's /sys/fs/cgroup (no container runtime
    here): a limit leaves less than the host's MemAvailable; "max" or no files leave it."""
    from engine import kernel_choice
    from engine.memory_profile import HostMemory

    monkeypatch.setattr(HostMemory, "free_and_total", lambda self: (8 << 30, 16 << 30))
    assert kernel_choice.available_memory(str(tmp_path)) == 8 << 30  # no cgroup files
    (tmp_path / "memory.max").write_text("4294967296\n")
    (tmp_path / "memory.current").write_text(f"{3 << 30}\n")
    assert kernel_choice.available_memory(str(tmp_path)) == 1 << 30
    (tmp_path / "memory.current").write_text(f"{5 << 30}\n")
    assert kernel_choice.available_memory(str(tmp_path)) == 0
    (tmp_path / "memory.max").write_text("max\n")
    assert kernel_choice.available_memory(str(tmp_path)) == 8 << 30
