"""Linear weights packed once (kernels/packed_weights.py), for the AMX kernel
(kernels/cpu/amx_linear.cpp) or for oneDNN: each packed matmul against F.linear, the AMX
kernel's refusals, the start-up choice, and the engine with packed and plain weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from engine_harness import drive, parse_worker_flags

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from kernels.packed_weights import (
    LAYOUTS,
    amx_available,
    calibrate_packing,
    pack_weight,
    packed_linear,
    packing_available,
)

pytestmark = pytest.mark.skipif(not packing_available(), reason="torch built without mkldnn")
needs_amx = pytest.mark.skipif(not amx_available(), reason="no AMX BF16 on this CPU")
LAYOUT_PARAMS = ["packed", pytest.param("amx", marks=needs_amx)]


@pytest.mark.parametrize("layout", LAYOUT_PARAMS)
@pytest.mark.parametrize("rows,out_features", [(1, 160), (9, 150), (17, 160), (33, 7), (64, 160),
                                               (65, 96), (300, 150)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(layout, rows, out_features, bias):
    """Row counts on both sides of the AMX kernel's 16-row tiles and 32-row passes, output
    widths that are not whole 32-column blocks."""
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=generator).bfloat16()
    weight = torch.randn(out_features, 96, generator=generator).bfloat16()
    b = torch.randn(out_features, generator=generator).bfloat16() if bias else None
    exact = F.linear(x.float(), weight.float(), None if b is None else b.float())
    plain = F.linear(x, weight, b).float()
    packed = packed_linear(x, pack_weight(weight, layout), b, out_features)
    assert packed.shape == (rows, out_features) and packed.dtype == torch.bfloat16
    # Both round a float32 sum to bf16; the order of the sum may differ.
    error = (packed.float() - exact).abs().max().item()
    assert error <= 1.5 * (plain - exact).abs().max().item() + 2e-2, error


@pytest.mark.parametrize("layout", LAYOUT_PARAMS)
def test_prefill_sized_inputs_take_the_plain_weights(layout):
    """Past PACKED_MAX_ROWS rows the layer's matmul is torch's F.linear on the plain weight
    (faster there, kernels/linear.py); up to it, the packed copy."""
    from kernels.linear import PACKED_MAX_ROWS, linear

    weight = torch.randn(64, 96).bfloat16()
    packed = pack_weight(weight, layout)
    op = "amx_linear" if layout == "amx" else "_linear_pointwise"
    for rows, used in ((PACKED_MAX_ROWS, True), (PACKED_MAX_ROWS + 1, False)):
        x = torch.randn(rows, 96).bfloat16()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = linear(x, weight, None, 0, packed)
        assert any(op in e.key for e in prof.key_averages()) == used, rows
        assert torch.equal(out, packed_linear(x, packed, None, 64) if used else F.linear(x, weight))


@needs_amx
@pytest.mark.parametrize("rows", [20, 100])
def test_the_amx_kernel_reads_strided_rows_and_no_rows(rows):
    """x as the engine hands it: a view whose rows are further apart than K (a slice of a
    wider tensor), on both paths (our loop up to 64 rows, oneDNN's micro-kernel past), and a
    step with no rows."""
    generator = torch.Generator().manual_seed(0)
    wide = torch.randn(rows, 160, generator=generator).bfloat16()
    weight = torch.randn(64, 128, generator=generator).bfloat16()
    packed = pack_weight(weight, "amx")
    x = wide[:, 16:144]
    assert x.stride(0) == 160
    got = packed_linear(x, packed, None, 64)
    assert torch.equal(got, packed_linear(x.contiguous(), packed, None, 64))
    exact = F.linear(x.float(), weight.float())
    plain = F.linear(x, weight).float()
    assert (got.float() - exact).abs().max() <= 1.5 * (plain - exact).abs().max() + 2e-2
    assert packed_linear(x[:0], packed, None, 64).shape == (0, 64)


@needs_amx
def test_the_two_amx_paths_and_the_amx_attention_interleave_on_one_thread():
    """Our loop configures the tiles itself, oneDNN's micro-kernel (more than 64 rows, and the
    prefill attention) keeps its own configuration between calls: interleaved, every result
    still equals its first computation."""
    from kernels.attention import prefill_attention

    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(96, 128, generator=generator).bfloat16()
    packed = pack_weight(weight, "amx")
    xs = {rows: torch.randn(rows, 128, generator=generator).bfloat16() for rows in (7, 40, 100)}
    q = torch.randn(80, 4, 64, generator=generator).bfloat16()
    k = torch.randn(80, 2, 64, generator=generator).bfloat16()
    v = torch.randn(80, 2, 64, generator=generator).bfloat16()
    attend = torch.ops.splitserve_cpu.prefill_attention
    first = {rows: packed_linear(x, packed, None, 96) for rows, x in xs.items()}
    attention = attend(q, k, v, 0.125, 0)
    torch.testing.assert_close(attention.float(), prefill_attention(q, k, v, 0.125).float(),
                               atol=3e-2, rtol=0)
    for rows in (100, 7, 100, 40, 7, 40, 100):
        assert torch.equal(packed_linear(xs[rows], packed, None, 96), first[rows]), rows
        assert torch.equal(attend(q, k, v, 0.125, 0), attention)


@needs_amx
def test_the_amx_kernel_refuses_what_it_cannot_multiply():
    ops = torch.ops.splitserve_cpu
    weight = torch.randn(64, 96).bfloat16()
    packed = ops.amx_pack_linear_weight(weight)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.amx_pack_linear_weight(torch.randn(64, 100).bfloat16())
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.amx_pack_linear_weight(weight.float())
    with pytest.raises(RuntimeError, match="input features"):
        ops.amx_linear(torch.randn(2, 64).bfloat16(), packed, None, 64)
    with pytest.raises(RuntimeError, match="out_features"):
        ops.amx_linear(torch.randn(2, 96).bfloat16(), packed, None, 100)
    with pytest.raises(RuntimeError, match="bias"):
        ops.amx_linear(torch.randn(2, 96).bfloat16(), packed, torch.randn(32).bfloat16(), 64)
    with pytest.raises(RuntimeError, match="amx_pack_linear_weight"):
        ops.amx_linear(torch.randn(2, 96).bfloat16(), weight, None, 64)
    with pytest.raises(RuntimeError, match="x must be"):
        ops.amx_linear(torch.randn(2, 96), packed, None, 64)


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
    tokens, logprobs within bf16 noise, and the profiler shows each packed matmul ran in its
    own engine only."""
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 40, 9, 5, 8, 21, 30, 12, 6, 14, 25)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)
    layouts = ("plain", "packed", "amx") if amx_available() else ("plain", "packed")
    described = {"packed": "oneDNN packed weights", "amx": "cpp amx_linear (AMX tiles"}
    results, calls = {}, {}
    for layout in layouts:
        engine = _engine(tiny_llama_dir, layout, cpu_small_m_max_rows=8)
        assert engine.runner.weight_layout == layout
        layers = [m for m in engine.runner.model.modules() if hasattr(m, "small_m_max_rows")]
        assert all((m.packed_weight is not None) == (layout != "plain") for m in layers)
        for name, words in described.items():
            assert (words in str(engine.runner.kernel_paths)) == (layout == name)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for i, prompt in enumerate(prompts):
                engine.add_request(str(i), prompt, params)
            results[layout] = drive(engine)
        calls[layout] = {name: sum(e.count for e in prof.key_averages() if name in e.key)
                         for name in ("_linear_pointwise", "amx_linear")}
    assert calls["plain"] == {"_linear_pointwise": 0, "amx_linear": 0}
    assert calls["packed"]["_linear_pointwise"] > 0 and calls["packed"]["amx_linear"] == 0
    if "amx" in calls:
        assert calls["amx"]["amx_linear"] > 0 and calls["amx"]["_linear_pointwise"] == 0
    for layout in layouts[1:]:
        for rid, expected in results["plain"].items():
            got = results[layout][rid]
            assert got.token_ids == expected.token_ids
            torch.testing.assert_close(torch.tensor([lp.logprob for lp in got.logprobs]),
                                       torch.tensor([lp.logprob for lp in expected.logprobs]),
                                       rtol=1.6e-2, atol=1e-2)


def test_auto_chooses_and_says_what_it_chose(tiny_llama_dir):
    """Where the CPU has AMX BF16, auto takes the AMX kernel's layout (the tiny model's K are
    multiples of 32); elsewhere it measures oneDNN's packing."""
    engine = _engine(tiny_llama_dir, "auto")
    assert engine.runner.weight_layout in LAYOUTS
    if amx_available():
        assert engine.runner.weight_layout == "amx"
    assert ("oneDNN packed weights" in str(engine.runner.kernel_paths)) == (
        engine.runner.weight_layout == "packed")


def test_auto_measures_onednn_packing_where_the_amx_kernel_does_not_run(tiny_llama_dir, monkeypatch):
    from engine import kernel_choice
    from kernels.packed_weights import PackingCalibration

    monkeypatch.setattr(kernel_choice, "amx_available", lambda: False)
    for wins, layout in ((True, "packed"), (False, "plain")):
        monkeypatch.setattr(kernel_choice, "calibrate_packing",
                            lambda weights, wins=wins: PackingCalibration(wins, ((16, 1.0, 2.0),)))
        assert _engine(tiny_llama_dir, "auto").runner.weight_layout == layout


@pytest.mark.parametrize("layout,dtype,message", [
    ("bogus", "bfloat16", "unknown cpu_weight_layout"),
    ("packed", "float32", "cpu_weight_layout 'packed' needs"),
    ("amx", "float32", "cpu_weight_layout 'amx' needs"),
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
    assert parse("--cpu-weight-layout", "amx").engine_config().cpu_weight_layout == "amx"
    with pytest.raises(ValueError, match="--cpu-weight-layout must be"):
        WorkerConfig(role="decode", model=str(tiny_llama_dir), cpu_weight_layout="blocked")


@pytest.mark.parametrize("layout", LAYOUT_PARAMS)
def test_the_memory_figures_count_the_packed_copies(tiny_llama_dir, layout):
    figures = {}
    for each in ("plain", layout):
        engine = _engine(tiny_llama_dir, each)
        model = engine.runner.model
        params = {id(p): p for p in model.parameters()}
        figures[each] = (engine.runner.memory.weights_bytes,
                         sum(p.numel() * p.element_size() for p in params.values()))
        copies = sum(m.packed_weight.numel() * 2 for m in model.modules()
                     if getattr(m, "packed_weight", None) is not None)
    assert figures["plain"][0] == figures["plain"][1]
    assert copies >= sum(m.weight.numel() * 2 for m in model.modules() if hasattr(m, "small_m_max_rows"))
    assert figures[layout][0] == figures[layout][1] + copies


@pytest.mark.parametrize("amx", [False, pytest.param(True, marks=needs_amx)])
def test_auto_keeps_plain_weights_when_the_copies_would_crowd_memory(tiny_llama_dir, monkeypatch,
                                                                       caplog, amx):
    """A host with little memory available (faked: a Kubernetes-free stand-in for a small
    node) keeps plain weights under auto even where a packed layout would be taken, and says
    why; asking for the layout still packs."""
    import logging

    from engine import kernel_choice
    from engine.memory_readers import HostMemory
    from kernels.packed_weights import PackingCalibration

    layout = "amx" if amx else "packed"
    if not amx:
        monkeypatch.setattr(kernel_choice, "amx_available", lambda: False)
    monkeypatch.setattr(kernel_choice, "calibrate_packing",
                        lambda weights: PackingCalibration(True, ((16, 1.0, 2.0),)))
    monkeypatch.setattr(HostMemory, "free_and_total", lambda self: (1 << 10, 1 << 30))
    caplog.set_level(logging.WARNING, logger="engine.model_runner")
    assert _engine(tiny_llama_dir, "auto").runner.weight_layout == "plain"
    assert f"linear weights stay plain: {layout} copies would take" in caplog.text
    assert _engine(tiny_llama_dir, layout).runner.weight_layout == layout
    monkeypatch.setattr(HostMemory, "free_and_total", lambda self: (1 << 40, 1 << 40))
    monkeypatch.setattr(kernel_choice, "available_memory", lambda: 1 << 40)
    assert _engine(tiny_llama_dir, "auto").runner.weight_layout == layout


def test_available_memory_heeds_a_container_limit(tmp_path, monkeypatch):
    """cgroup v2 files in a folder stand in for a pod's /sys/fs/cgroup (no container runtime
    here): a limit leaves less than the host's MemAvailable; "max" or no files leave it."""
    from engine import kernel_choice
    from engine.memory_readers import HostMemory

    monkeypatch.setattr(HostMemory, "free_and_total", lambda self: (8 << 30, 16 << 30))
    assert kernel_choice.available_memory(str(tmp_path)) == 8 << 30  # no cgroup files
    (tmp_path / "memory.max").write_text("4294967296\n")
    (tmp_path / "memory.current").write_text(f"{3 << 30}\n")
    assert kernel_choice.available_memory(str(tmp_path)) == 1 << 30
    (tmp_path / "memory.current").write_text(f"{5 << 30}\n")
    assert kernel_choice.available_memory(str(tmp_path)) == 0
    (tmp_path / "memory.max").write_text("max\n")
    assert kernel_choice.available_memory(str(tmp_path)) == 8 << 30
