"""The C++ CPU decode attention (kernels/cpu) against its torch reference,
kernels.attention.paged_decode_attention, and the engine's greedy output with either one."""

from __future__ import annotations

import pytest
import torch
from engine_harness import make_engine
from kernel_build import require_cpu_kernels

from engine.sampling_params import SamplingParams
from kernels.attention import paged_decode_attention

pytestmark = require_cpu_kernels()

BLOCK = 16


def _case(batch, heads, kv_heads, head_dim, seq_lens, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    widths = [-(-n // BLOCK) for n in seq_lens]
    num_blocks = sum(widths) + 3
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables, used = [], 0
    for w in widths:
        tables.append(order[used : used + w])
        used += w
    width = max(widths) + 2  # wider than any context needs, padded with a garbage block
    k_cache = torch.randn(num_blocks, BLOCK, kv_heads, head_dim, generator=generator).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK, kv_heads, head_dim, generator=generator).to(dtype)
    # A strided query, as the model passes it (a slice of the fused qkv projection).
    qkv = torch.randn(batch, heads + 2 * kv_heads, head_dim, generator=generator).to(dtype)
    query = qkv[:, :heads]
    block_tables = torch.tensor([t + [order[-1]] * (width - len(t)) for t in tables])
    return query, k_cache, v_cache, block_tables, torch.tensor(seq_lens)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [
    (9, 3, 64),  # SmolLM2: the AVX-512 head_dim 64 path
    (8, 8, 64),  # no grouping
    (8, 2, 64),  # four query heads per KV head
    (6, 2, 8),  # another head_dim: the portable path
    (4, 1, 80),
])
@pytest.mark.parametrize("seq_lens", [
    [1, 16, 17, 300, 45, 2],
    [700],  # few (sequence, KV head) pairs: each context is cut into chunks, combined after
    [1, 333],  # chunks of a one-token context stay empty
])
def test_cpp_decode_attention_matches_the_torch_reference(dtype, atol, heads, kv_heads, head_dim, seq_lens):
    query, k_cache, v_cache, tables, lens = _case(len(seq_lens), heads, kv_heads, head_dim, seq_lens, dtype)
    scale = head_dim**-0.5
    expected = paged_decode_attention(query, k_cache, v_cache, tables, lens, max(seq_lens), scale)
    out = torch.ops.splitserve_cpu.paged_decode_attention(query, k_cache, v_cache, tables, lens, scale)
    assert out.dtype == dtype and out.shape == query.shape
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=0)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (6, 2, 8)])
@pytest.mark.parametrize("window", [1, 5, 16, 64, 299, 1000])
def test_cpp_decode_attention_honours_a_sliding_window(dtype, atol, heads, kv_heads, head_dim, window):
    seq_lens = [1, 16, 17, 300, 45, 2]
    query, k_cache, v_cache, tables, lens = _case(len(seq_lens), heads, kv_heads, head_dim, seq_lens, dtype)
    scale = head_dim**-0.5
    expected = paged_decode_attention(query, k_cache, v_cache, tables, lens, max(seq_lens), scale,
                                      window=window)
    # Tokens before a window are never read: NaN there would spread into the output.
    for b, n in enumerate(seq_lens):
        for t in range(max(0, n - window)):
            k_cache[tables[b, t // BLOCK], t % BLOCK] = float("nan")
            v_cache[tables[b, t // BLOCK], t % BLOCK] = float("nan")
    out = torch.ops.splitserve_cpu.paged_decode_attention(query, k_cache, v_cache, tables, lens, scale,
                                                          window)
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=0)
    if window <= 64:  # the window changed the longest context's result
        full = paged_decode_attention(query, k_cache.nan_to_num(), v_cache.nan_to_num(), tables, lens,
                                      max(seq_lens), scale)
        assert not torch.allclose(full[3].float(), expected[3].float(), atol=atol)


def test_cpp_decode_attention_rejects_a_negative_window():
    query, k_cache, v_cache, tables, lens = _case(2, 4, 2, 8, [5, 20], torch.float32)
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        torch.ops.splitserve_cpu.paged_decode_attention(query, k_cache, v_cache, tables, lens, 1.0, -1)


def test_cpp_decode_attention_rejects_a_context_longer_than_its_table():
    query, k_cache, v_cache, tables, lens = _case(2, 4, 2, 8, [5, 20], torch.float32)
    with pytest.raises(RuntimeError, match="longer than its block table"):
        torch.ops.splitserve_cpu.paged_decode_attention(
            query, k_cache, v_cache, tables[:, :1], lens, 1.0
        )


def test_engine_greedy_output_is_the_same_with_either_decode_attention(tiny_llama_dir):
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 40, 9)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    outputs = {}
    for choice in ("torch", "cpp"):
        engine = make_engine(tiny_llama_dir, cpu_attention=choice)
        assert engine.runner.native_decode == (choice == "cpp")
        outputs[choice] = [r.token_ids for r in engine.generate(prompts, params)]
    assert outputs["cpp"] == outputs["torch"]
