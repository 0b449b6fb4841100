"""All decoder layers of a decode step in one C++ call (kernels/cpu/fused_decode.cpp) against the
module path of engine/models/llama.py: each element-wise step on its own, a whole step of a tiny
Llama and a tiny Qwen2 (qkv bias) in bfloat16, and the engine with either path (with the fused
path, prompt steps take the kernel's RMS norm and SwiGLU in the per-layer modules)."""

from __future__ import annotations

import pytest
import torch
from engine_harness import drive
from kernel_build import require_cpu_kernels

from engine.config import EngineConfig
from engine.layers.activation import silu_and_mul
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from kernels.attention import store_kv
from kernels.packed_weights import amx_available

pytestmark = require_cpu_kernels()
ops = torch.ops.splitserve_cpu

# The float32 sum of squares of an RMS is taken in another order than torch's sum, so now and
# then its bf16-rounded output moves by one ulp (measured on SmolLM2: 23 of 2.4 million values).
BF16_ULP_RTOL = 2**-7


def _bf16(*shape, scale=1.0, seed=0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


@pytest.mark.parametrize("scale", [1.0, 40.0])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_step_matches_rmsnorm(scale, with_residual):
    hidden, residual = _bf16(9, 96, scale=scale, seed=1), _bf16(9, 96, scale=scale, seed=2)
    norm = RMSNorm(96, 1e-5).bfloat16()
    norm.weight.data = _bf16(96, seed=3)
    if with_residual:
        expected, expected_residual = norm(hidden, residual)
    else:
        expected, expected_residual = norm(hidden), hidden
    out, new_residual = ops.rms_norm_step(hidden, residual if with_residual else None, norm.weight, 1e-5)
    assert torch.equal(new_residual, expected_residual)
    torch.testing.assert_close(out, expected, rtol=BF16_ULP_RTOL, atol=0)
    assert (out != expected).float().mean() < 0.01


@pytest.mark.parametrize("rows,scale", [(5, 4.0), (64, 30.0)])
def test_silu_and_mul_step_matches_the_module_path(rows, scale):
    """The kernel's sigmoid comes from its own exp (vector_math.h), not std::exp: the same
    bf16 values but for a rounding boundary now and then."""
    gate_up = _bf16(rows, 2 * 200, scale=scale)
    got, expected = ops.silu_and_mul_step(gate_up), silu_and_mul(gate_up)
    torch.testing.assert_close(got, expected, rtol=BF16_ULP_RTOL, atol=0)
    assert (got != expected).float().mean() < 0.01


@pytest.mark.parametrize("scale", [1.0, 4.0, 30.0])
def test_silu_and_mul_step_rounds_as_torch_all_but_never(scale):
    """A million and a half SwiGLU outputs at SmolLM2's width: the kernel's division-free
    sigmoid (a reciprocal estimate, a Newton step and a residual correction) gives torch's
    bf16 values all but at a rare rounding boundary (none differed here when written), -0 where
    torch's exp(-g) overflows included."""
    gate_up = _bf16(1024, 2 * 1536, scale=scale, seed=7)
    got, expected = ops.silu_and_mul_step(gate_up), silu_and_mul(gate_up)
    assert (got != expected).sum().item() <= 15  # one in 100,000
    overflowing = gate_up[:, :1536].float() < -88.75
    assert torch.equal(got[overflowing].float().abs(), torch.zeros(int(overflowing.sum())))


def test_rotate_and_store_step_is_exactly_the_module_path():
    heads, kv_heads, dim, block = 6, 2, 16, 4
    rotary = RotaryEmbedding(dim, 128, 10000.0)
    positions = torch.tensor([3, 17, 0, 90])
    qkv = _bf16(4, (heads + 2 * kv_heads) * dim, scale=3.0)
    cos, sin = rotary.cos_sin(positions, torch.bfloat16)
    slots = torch.tensor([5, 30, 2, 11])
    k_cache, v_cache = _bf16(8, block, kv_heads, dim, seed=4), _bf16(8, block, kv_heads, dim, seed=5)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()

    qk = qkv[:, : (heads + kv_heads) * dim].view(4, heads + kv_heads, dim)
    q, k = rotary.rotate(qk, (cos, sin)).split([heads, kv_heads], dim=1)
    store_kv(k, qkv[:, (heads + kv_heads) * dim :].view(4, kv_heads, dim), expected_k, expected_v, slots)
    out = ops.rotate_and_store_step(qkv, cos.squeeze(1), sin.squeeze(1), k_cache, v_cache, slots, heads)
    assert torch.equal(out, q)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.rotate_and_store_step(qkv, cos.squeeze(1), sin.squeeze(1), k_cache, v_cache,
                                  slots - 3, heads)


def test_rotate_and_store_split_is_exactly_the_module_path_and_returns_k_and_v():
    """What a prompt step's attention gets: rotated Q and K, V, and the same cache writes."""
    heads, kv_heads, dim, block, rows = 6, 2, 16, 4, 7
    rotary = RotaryEmbedding(dim, 128, 10000.0)
    positions = torch.arange(rows) + 5
    qkv = _bf16(rows, (heads + 2 * kv_heads) * dim, scale=3.0)
    cos, sin = rotary.cos_sin(positions, torch.bfloat16)
    slots = torch.arange(rows) + 9
    k_cache, v_cache = _bf16(8, block, kv_heads, dim, seed=4), _bf16(8, block, kv_heads, dim, seed=5)
    expected_k_cache, expected_v_cache = k_cache.clone(), v_cache.clone()
    qk = qkv[:, : (heads + kv_heads) * dim].view(rows, heads + kv_heads, dim)
    q, k = rotary.rotate(qk, (cos, sin)).split([heads, kv_heads], dim=1)
    v = qkv[:, (heads + kv_heads) * dim :].view(rows, kv_heads, dim)
    store_kv(k, v, expected_k_cache, expected_v_cache, slots)
    got_q, got_k, got_v = ops.rotate_and_store_split(qkv, cos.squeeze(1), sin.squeeze(1), k_cache,
                                                     v_cache, slots, heads)
    assert torch.equal(got_q, q) and torch.equal(got_k, k) and torch.equal(got_v, v)
    assert got_k.is_contiguous() and got_v.is_contiguous()
    assert torch.equal(k_cache, expected_k_cache) and torch.equal(v_cache, expected_v_cache)
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.rotate_and_store_split(qkv, cos.squeeze(1), sin.squeeze(1), k_cache, v_cache,
                                   slots + 8 * block, heads)


def _bf16_engine(model_dir, fused: str, **config) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), dtype="bfloat16", device="cpu", block_size=4,
                                  num_kv_blocks=128, cpu_fused_decode=fused, **config))


@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_qwen2_dir"])
# torch: at::linear, or oneDNN's matmul or the AMX kernel from packed weights
@pytest.mark.parametrize("batch,linear,layout", [
    (3, "auto", "auto"), (11, "torch", "plain"), (11, "torch", "packed"),
    pytest.param(11, "torch", "amx", marks=pytest.mark.skipif(
        not amx_available(), reason="no AMX BF16 on this CPU"))])
def test_a_decode_step_matches_the_module_path(request, model, batch, linear, layout):
    """The same decode step (rows of different context lengths) through both paths, from the
    same cache: the final hidden states and every layer's cache writes agree."""
    engine = _bf16_engine(request.getfixturevalue(model), "cpp", cpu_linear=linear,
                          cpu_weight_layout=layout)
    model_ = engine.runner.model
    assert model_._fused is not None
    steps = []
    forward = model_.forward

    def compare(input_ids, positions, kv_caches, meta):
        if meta.num_decode_tokens != len(input_ids):
            return forward(input_ids, positions, kv_caches, meta)
        before = [kv.clone() for kv in kv_caches]
        fused, model_._fused = model_._fused, None
        expected = forward(input_ids, positions, kv_caches, meta)
        expected_caches = [kv.clone() for kv in kv_caches]
        for kv, saved in zip(kv_caches, before, strict=True):
            kv.copy_(saved)
        model_._fused = fused
        out = forward(input_ids, positions, kv_caches, meta)
        steps.append((out, expected, [kv.clone() for kv in kv_caches], expected_caches))
        return out

    model_.forward = compare
    # Distinct first tokens: prompts that share a block would be prefilled a step apart
    # (the later ones wait to read it from the cache), and the decode steps would be smaller.
    prompts = [[200 + i] + list(range(3, 3 + 2 * i)) for i in range(batch)]
    engine.generate(prompts, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert steps and all(len(out) == batch for out, *_ in steps)
    for out, expected, caches, expected_caches in steps:
        torch.testing.assert_close(out, expected, rtol=2**-6, atol=2**-6)
        for got, want in zip(caches, expected_caches, strict=True):
            torch.testing.assert_close(got, want, rtol=2**-6, atol=2**-6)


def test_the_engine_runs_decode_through_one_call_and_generates_the_same(tiny_llama_dir):
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 40, 9)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)
    results, calls, norm_calls = {}, {}, {}
    for choice in ("torch", "cpp"):
        engine = _bf16_engine(tiny_llama_dir, choice)
        assert engine.runner.fused_decode == (choice == "cpp")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for i, prompt in enumerate(prompts):
                engine.add_request(str(i), prompt, params)
            results[choice] = drive(engine)
        calls[choice] = sum(e.count for e in prof.key_averages() if "decode_layers" in e.key)
        norm_calls[choice] = sum(e.count for e in prof.key_averages() if "rms_norm_step" in e.key)
    assert calls["torch"] == 0 and calls["cpp"] >= 15  # one per decode step
    # The prompts' steps run the per-layer modules, with the kernel's RMS norm when fused.
    assert norm_calls["torch"] == 0 and norm_calls["cpp"] > 0
    for rid, expected in results["torch"].items():
        got = results["cpp"][rid]
        assert got.token_ids == expected.token_ids
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in got.logprobs]),
                                   torch.tensor([lp.logprob for lp in expected.logprobs]),
                                   rtol=1.6e-2, atol=1e-2)


def test_decode_layers_rejects_lists_of_the_wrong_length(tiny_llama_dir):
    engine = _bf16_engine(tiny_llama_dir, "cpp")
    f = engine.runner.model._fused
    caches = engine.runner.kv_caches
    hidden, cos = _bf16(1, f.final_norm.numel()), _bf16(1, caches[0].shape[-1])
    with pytest.raises(RuntimeError, match="one tensor per layer"):
        ops.decode_layers(
            hidden, cos, cos, f.input_norm, f.qkv_weight[:-1], f.qkv_bias, f.o_weight, f.post_norm,
            f.gate_up_weight, f.down_weight, f.final_norm, [kv[0] for kv in caches],
            [kv[1] for kv in caches], torch.tensor([0]), torch.tensor([[0]]), torch.tensor([1]),
            f.heads, f.kv_heads, f.eps, f.scale, 8, [],
        )


def test_cpu_fused_decode_cpp_in_float32_is_a_clear_error(tiny_llama_dir):
    with pytest.raises(ValueError, match="cpu_fused_decode 'cpp' needs"):
        LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu",
                               num_kv_blocks=16, cpu_fused_decode="cpp"))
