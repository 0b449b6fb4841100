"""The C++ CPU prefill attention (kernels/cpu/prefill_attention.cpp, and its AMX path in
prefill_attention_amx.cpp) against its torch reference, kernels.attention.prefill_attention,
and the engine's prompt logprobs with either."""

from __future__ import annotations

import pytest
import torch
from engine_harness import drive
from kernel_build import require_cpu_kernels

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from kernels.attention import calibrate_prefill_attention, prefill_attention
from kernels.linear import small_m_linear_available

pytestmark = require_cpu_kernels(small_m_linear_available(), "needs a CPU with avx512_bf16")


def _has_amx() -> bool:
    return small_m_linear_available() and torch.ops.splitserve_cpu.has_amx_bf16()


# Both paths of the op: amx=False is the AVX-512 BF16 dot-product kernel on every CPU that has
# it; amx=True takes AMX tiles where has_amx_bf16(), and is tested only there.
PATHS = pytest.mark.parametrize("amx", [
    False, pytest.param(True, marks=pytest.mark.skipif(not _has_amx(), reason="needs AMX (bf16)")),
])


def _inputs(q_len, ctx, heads, kv_heads, head_dim, seed=0):
    generator = torch.Generator().manual_seed(seed)
    # Strided query and key/value, as the model passes them (slices of the qkv projection).
    qkv = torch.randn(ctx, heads + 2 * kv_heads, head_dim, generator=generator).bfloat16()
    query = qkv[ctx - q_len:, :heads]
    key, value = qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
    return query, key, value


@pytest.mark.parametrize("q_len,ctx", [
    (1, 1), (5, 5), (64, 64), (65, 65), (513, 513),  # whole prompts, chunk edges
    (70, 200), (17, 1000), (1, 300),  # chunks of a prompt after a cached prefix
])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [
    (9, 3, 64),  # SmolLM2
    (8, 8, 64),  # no grouping
    (8, 2, 32),
    (16, 1, 128),
    (6, 2, 48),  # 3 output vectors: a short P V pass
    (4, 4, 80),  # 5 output vectors: a pass of 4 and one of 1
])
@PATHS
def test_cpp_prefill_attention_matches_the_torch_reference(q_len, ctx, heads, kv_heads, head_dim, amx):
    query, key, value = _inputs(q_len, ctx, heads, kv_heads, head_dim)
    scale = head_dim ** -0.5
    exact = prefill_attention(query.float(), key.float(), value.float(), scale)
    torch_bf16 = prefill_attention(query, key, value, scale).float()
    cpp = torch.ops.splitserve_cpu.prefill_attention(query, key, value, scale, 0, amx)
    assert cpp.shape == query.shape and cpp.dtype == torch.bfloat16
    # Both round the float32 result to bf16 once (half an ulp: 2^-9 of values up to ~4); the
    # kernel also rounds probabilities to bf16 before multiplying V, as the flash kernel does.
    error = (cpp.float() - exact).abs().max().item()
    assert error <= 1.5 * (torch_bf16 - exact).abs().max().item() + 2e-3, error


@pytest.mark.parametrize("q_len,ctx", [(64, 64), (200, 200), (70, 200), (1, 300), (130, 130)])
@pytest.mark.parametrize("window", [1, 7, 64, 65, 100, 4096])
@PATHS
def test_cpp_prefill_attention_honours_a_sliding_window(q_len, ctx, window, amx):
    query, key, value = _inputs(q_len, ctx, 9, 3, 64)
    scale = 0.125
    exact = prefill_attention(query.float(), key.float(), value.float(), scale, window)
    torch_bf16 = prefill_attention(query, key, value, scale, window).float()
    # Chunks of 64 keys wholly before every query's window are never read: NaN there would
    # spread. (Inside a chunk the kernel reads and masks; a cache holds no NaN.) The AMX path
    # starts a query block's keys at its first window rounded down to 32 keys.
    skipped = max(0, ctx - q_len + 1 - window) // 64 * 64
    key, value = key.clone(), value.clone()
    key[:skipped] = float("nan")
    value[:skipped] = float("nan")
    cpp = torch.ops.splitserve_cpu.prefill_attention(query, key, value, scale, window, amx)
    error = (cpp.float() - exact).abs().max().item()
    assert error <= 1.5 * (torch_bf16 - exact).abs().max().item() + 2e-3, error
    if window < ctx:  # the window matters: full causal attention differs
        full = prefill_attention(query.float(), key.nan_to_num().float(), value.nan_to_num().float(), scale)
        assert (full - exact).abs().max().item() > 1e-2


@pytest.mark.parametrize("length", [40, 300])
@PATHS
def test_cpp_prefill_attention_is_causal(length, amx):
    """Changing the last key and value changes only the last query's output."""
    query, key, value = _inputs(length, length, 9, 3, 64)
    before = torch.ops.splitserve_cpu.prefill_attention(query, key, value, 0.125, 0, amx)
    key, value = key.clone(), value.clone()
    key[-1] += 3
    value[-1] -= 3
    after = torch.ops.splitserve_cpu.prefill_attention(query, key, value, 0.125, 0, amx)
    assert torch.equal(before[:-1], after[:-1]) and not torch.equal(before[-1], after[-1])


@pytest.mark.parametrize("change,message", [
    (lambda q, k, v: (q.float(), k.float(), v.float()), "bfloat16 only"),
    (lambda q, k, v: (q[..., :8], k[..., :8], v[..., :8]), "multiple of 16"),
    (lambda q, k, v: (q[:, :5], k, v), "multiple of KV heads"),
    (lambda q, k, v: (torch.cat([q, q]), k, v), "q_len <= ctx"),
])
def test_cpp_prefill_attention_rejects_what_it_cannot_do(change, message):
    query, key, value = change(*_inputs(8, 8, 9, 3, 64))
    with pytest.raises(RuntimeError, match=message):
        torch.ops.splitserve_cpu.prefill_attention(query, key, value, 0.125)


def test_engine_prompt_logprobs_agree_with_either_prefill_attention(tmp_path):
    """A tiny model with head_dim 32 (the kernel's reach), bfloat16, a prompt prefilled in
    three chunks so the later ones attend over the cache too; scored by the kernel and by the
    torch path, the prompt logprobs agree within bf16 noise, and the profiler shows the kernel
    ran in one engine only."""
    from splitserve_cli.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny", arch="llama", seed=0, head_dim=32)
    prompt = [5 + (7 * i) % 300 for i in range(150)]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    logprobs, calls = {}, {}
    for choice in ("torch", "cpp"):
        from engine.scheduler import SchedulerConfig

        engine = LLMEngine(EngineConfig(
            model=str(model), dtype="bfloat16", device="cpu", num_kv_blocks=64,
            cpu_attention=choice,
            scheduler=SchedulerConfig(max_num_batched_tokens=64, long_prefill_token_threshold=64)))
        assert engine.runner.native_prefill == (choice == "cpp")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            engine.add_request("r", prompt, params)
            result = drive(engine)["r"]
        calls[choice] = sum(e.count for e in prof.key_averages() if "prefill_attention" in e.key
                            and "splitserve_cpu" in e.key)
        logprobs[choice] = torch.tensor([p.logprob for p in result.prompt_logprobs[1:]])
    assert calls["torch"] == 0 and calls["cpp"] >= 3
    torch.testing.assert_close(logprobs["cpp"], logprobs["torch"], rtol=1.6e-2, atol=2e-2)


def test_the_calibration_keeps_the_kernel_only_when_it_wins_by_the_margin():
    """Real timings of both on a small head shape; the margin decides (a kernel that may take
    any multiple of SDPA's time is kept, one that must take none is not)."""
    kept = calibrate_prefill_attention(6, 2, 32, chunk=32, chunks=2, margin=1e9)
    dropped = calibrate_prefill_attention(6, 2, 32, chunk=32, chunks=2, margin=0.0)
    assert kept.native and not dropped.native
    assert kept.cpp_s > 0 and kept.torch_s > 0
    assert "prefill attention cpp" in kept.describe()
    assert "prefill attention torch SDPA" in dropped.describe()
