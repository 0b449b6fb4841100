"""Triton rotary embedding + KV-cache write against the torch path it replaces:
RotaryEmbedding.rotate (engine/layers/rotary.py) then store_kv (kernels/attention.py).

Without CUDA the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set in
conftest.py) on small shapes; the `gpu` tests run the same checks compiled on CUDA at real
sizes and are skipped here.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # TRITON_INTERPRET is set in conftest.py without CUDA

from engine.layers.rotary import RotaryEmbedding  # noqa: E402
from kernels.attention import store_kv  # noqa: E402
from kernels.triton.rotary_kv import triton_rotary_kv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_case(positions, num_heads, kv_heads, head_dim, num_blocks, block_size, dtype, device,
              seed=0):
    """A step's qkv projection (q, k, v as views of one [tokens, (H + 2 KV) D] tensor, as
    LlamaAttention has them), its rotary angles, and a cache full of noise."""
    gen = torch.Generator().manual_seed(seed)
    tokens = len(positions)
    qkv = torch.randn(tokens, (num_heads + 2 * kv_heads) * head_dim, generator=gen)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)
    qkv, cache = qkv.to(device=device, dtype=dtype), cache.to(device=device, dtype=dtype)
    rotary = RotaryEmbedding(head_dim, max(positions) + 1, 10000.0)
    cos_sin = rotary.cos_sin(torch.tensor(positions), dtype)
    cos_sin = tuple(t.to(device) for t in cos_sin)
    q_end, k_end = num_heads * head_dim, (num_heads + kv_heads) * head_dim
    q = qkv[:, :q_end].view(tokens, num_heads, head_dim)
    k = qkv[:, q_end:k_end].view(tokens, kv_heads, head_dim)
    v = qkv[:, k_end:].view(tokens, kv_heads, head_dim)
    return q, k, v, cos_sin, cache[0], cache[1]


def run_both(case, slots):
    """(kernel's q, k cache, v cache), (reference's): both start from the same cache; the
    reference stores only the rows with a slot (store_kv takes no -1)."""
    q, k, v, cos_sin, k_cache, v_cache = case
    slot_mapping = torch.tensor(slots, dtype=torch.long, device=q.device)
    k_out, v_out = k_cache.clone(), v_cache.clone()
    q_out = triton_rotary_kv(q, k, v, *cos_sin, k_out, v_out, slot_mapping)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    q_ref = RotaryEmbedding.rotate(q, cos_sin)
    keep = slot_mapping >= 0
    store_kv(RotaryEmbedding.rotate(k, cos_sin)[keep], v[keep], k_ref, v_ref, slot_mapping[keep])
    return (q_out, k_out, v_out), (q_ref, k_ref, v_ref)


def assert_same(got, want, exact):
    """Bit-identical under the interpreter (the same roundings in the same order); compiled, a
    float32 multiply-add may fuse (one rounding fewer), so 1e-6 relative there."""
    for name, a, b in zip(("query", "k cache", "v cache"), got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        if exact:
            assert torch.equal(a, b), f"{name}: max error {(a.float() - b.float()).abs().max()}"
        else:
            torch.testing.assert_close(a, b, rtol=1e-6 if a.dtype == torch.float32 else 2**-7,
                                       atol=1e-6, msg=name)


EXACT = DEVICE == "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group", [1, 3, 8], ids=["gqa1", "gqa3", "gqa8"])
def test_rotary_kv_matches_rotate_then_store(group, dtype):
    """Two sequences in a step: a 6-token prefill chunk from position 3 whose last block is
    partial (blocks of 4: slots 3..8 end one token into block 2), and a decode token at
    position 13 in a scattered block."""
    positions = [3, 4, 5, 6, 7, 8, 13]
    slots = [7, 4 * 2 + 0, 4 * 2 + 1, 4 * 2 + 2, 4 * 2 + 3, 4 * 5 + 0, 4 * 3 + 1]
    case = make_case(positions, 2 * group, 2, 16, 6, 4, dtype, DEVICE, seed=group)
    got, want = run_both(case, slots)
    assert_same(got, want, EXACT)


def test_padding_rows_rotate_the_query_and_leave_the_cache_alone():
    """A slot of -1 (a padded row of a captured batch) stores nothing: the cache keeps its
    noise there, and the real rows land where they should."""
    case = make_case([0, 5, 2, 9], 4, 2, 8, 4, 4, torch.float32, DEVICE)
    got, want = run_both(case, [3, -1, 6, -1])
    assert_same(got, want, EXACT)
    untouched = [s for s in range(16) if s not in (3, 6)]
    for cache, before in zip(got[1:], case[4:], strict=True):
        assert torch.equal(cache.view(16, -1)[untouched], before.view(16, -1)[untouched])


def test_odd_head_dim_and_one_token():
    """head_dim 12 pads to 16 (the partner of a dimension is head_dim // 2 away, not 8); one
    token at a block's last slot."""
    case = make_case([7], 6, 3, 12, 3, 2, torch.bfloat16, DEVICE, seed=5)
    got, want = run_both(case, [5])
    assert_same(got, want, EXACT)


def test_no_tokens_is_a_no_op():
    q, k, v, cos_sin, k_cache, v_cache = make_case([1], 2, 1, 8, 2, 4, torch.float32, DEVICE)
    before = k_cache.clone()
    slots = torch.empty(0, dtype=torch.long, device=q.device)
    out = triton_rotary_kv(q[:0], k[:0], v[:0], cos_sin[0][:0], cos_sin[1][:0], k_cache, v_cache,
                           slots)
    assert out.shape == (0, 2, 8) and torch.equal(k_cache, before)


def test_rotary_kv_refuses_mismatched_inputs():
    q, k, v, (cos, sin), k_cache, v_cache = make_case([0, 1], 4, 2, 8, 2, 4, torch.float32,
                                                      DEVICE)
    slots = torch.tensor([0, 1], device=q.device)
    with pytest.raises(ValueError, match="do not match"):
        triton_rotary_kv(q, k[:, :1], v, cos, sin, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="multiple of"):
        triton_rotary_kv(q[:, :3], k, v, cos, sin, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="does not hold"):
        triton_rotary_kv(q, k, v, cos, sin, k_cache[:, :, :1], v_cache[:, :, :1], slots)
    with pytest.raises(ValueError, match="cache dtype"):
        triton_rotary_kv(q, k, v, cos, sin, k_cache.double(), v_cache.double(), slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        triton_rotary_kv(q, k, v, cos, sin, k_cache, v_cache, slots[:1])


# --- compiled on CUDA at real sizes (skipped without a GPU) --------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", [(9, 3), (32, 8), (64, 8)], ids=["smollm2", "8b", "70b"])
@pytest.mark.parametrize("tokens", [1, 256, 4096])
def test_gpu_rotary_kv_matches_reference(tokens, heads, dtype):
    num_heads, kv_heads = heads
    head_dim = 64 if num_heads == 9 else 128
    gen = torch.Generator().manual_seed(tokens)
    positions = torch.randint(0, 8192, (tokens,), generator=gen).tolist()
    num_blocks = tokens // 16 + 8
    slots = torch.randperm(num_blocks * 16, generator=gen)[:tokens].tolist()
    case = make_case(positions, num_heads, kv_heads, head_dim, num_blocks, 16, dtype, "cuda")
    got, want = run_both(case, slots)
    assert_same(got, want, exact=False)
