"""Triton paged decode attention against the torch reference (kernels/attention.py).

Without CUDA the kernels run under Triton's interpreter on small shapes (TRITON_INTERPRET=1,
set in conftest.py); the `gpu` tests run the same checks compiled on
CUDA at real sizes and are skipped here.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # TRITON_INTERPRET is set in conftest.py without CUDA

from kernels.attention import paged_decode_attention  # noqa: E402
from kernels.triton.decode_attention import (  # noqa: E402
    num_decode_splits,
    triton_paged_decode_attention,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16_ULP = 2.0**-7  # one bfloat16 ulp relative to the output's magnitude


def make_case(seq_lens, num_heads, kv_heads, head_dim, block_size, dtype, device, seed=0):
    """A paged cache with each sequence's blocks scattered over the pool (block 0 unused),
    block tables padded with 0, and one query token per sequence."""
    gen = torch.Generator().manual_seed(seed)
    widths = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(widths) + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen)
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(seq_lens), max(widths), dtype=torch.long)
    for row, width in enumerate(widths):
        tables[row, :width] = torch.tensor([ids.pop() for _ in range(width)])
    to = dict(device=device, dtype=dtype)
    return (query.to(**to), k_cache.to(**to), v_cache.to(**to), tables.to(device),
            torch.tensor(seq_lens, dtype=torch.long, device=device))


def check_against_reference(case, max_seq_len, window, label, **kernel_args):
    """Max error of the kernel against the float32 reference, printed and bounded: float32
    inputs to 1e-5; bfloat16 inputs to one bf16 ulp of the output's magnitude."""
    query, k_cache, v_cache, tables, seq_lens = case
    scale = query.shape[-1] ** -0.5
    out = triton_paged_decode_attention(query, k_cache, v_cache, tables, seq_lens, max_seq_len,
                                        scale, window, **kernel_args)
    assert out.shape == query.shape and out.dtype == query.dtype
    ref = paged_decode_attention(query.float(), k_cache.float(), v_cache.float(), tables,
                                 seq_lens, max_seq_len, scale, window=window)
    err = (out.float() - ref).abs().max().item()
    bound = 1e-5 if query.dtype == torch.float32 else BF16_ULP * ref.abs().max().item()
    print(f"{label}: max error {err:.3g} (bound {bound:.3g})")
    assert err <= bound, f"{label}: max error {err} over {bound}"


# Block size 4: lengths 4 and 16 end on a block boundary, 5 and 13 start a new block, 1 is a
# one-token context; the rows are ragged and their blocks scattered.
RAGGED_LENS = [5, 1, 16, 4, 13]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [0, 6], ids=["full", "window6"])
@pytest.mark.parametrize("group", [1, 3, 8], ids=["gqa1", "gqa3", "gqa8"])
@pytest.mark.parametrize("splits", [1, 4], ids=["one_split", "split_k4"])
def test_decode_matches_reference_on_ragged_batch(group, window, dtype, splits):
    kv_heads, head_dim, block_size = 2, 16, 4
    case = make_case(RAGGED_LENS, kv_heads * group, kv_heads, head_dim, block_size, dtype, DEVICE)
    # block_n 4 tiles cross no page; with 4 splits a 1-token context leaves 3 splits empty
    check_against_reference(case, max(RAGGED_LENS), window,
                            f"gqa{group} window{window} {dtype} splits{splits}",
                            num_splits=splits, block_n=4)


def test_decode_tiles_spanning_several_blocks_and_odd_head_dim():
    """A tile of 8 tokens over blocks of 2 reads four pages; head_dim 12 pads to 16."""
    case = make_case([9, 2, 7], 4, 2, 12, 2, torch.float32, DEVICE, seed=1)
    check_against_reference(case, 9, 0, "block_n 8 over 2-token blocks", num_splits=2, block_n=8)


def test_decode_with_defaults_and_no_seq_lens():
    """seq_lens None means every context is max_seq_len long; default splits and tile."""
    query, k_cache, v_cache, tables, _ = make_case([7, 7], 6, 2, 16, 4, torch.float32, DEVICE)
    scale = 0.25
    out = triton_paged_decode_attention(query, k_cache, v_cache, tables, None, 7, scale)
    ref = paged_decode_attention(query, k_cache, v_cache, tables, None, 7, scale)
    print(f"defaults: max error {(out - ref).abs().max().item():.3g}")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_split_count_follows_the_visible_context():
    assert num_decode_splits(1) == 1
    assert num_decode_splits(512) == 1
    assert num_decode_splits(513) == 2
    assert num_decode_splits(3000) == 8
    assert num_decode_splits(10**6) == 16
    assert num_decode_splits(10**6, window=512) == 1


def test_decode_refuses_bad_shapes_clearly():
    query, k_cache, v_cache, tables, lens = make_case([3], 5, 2, 16, 4, torch.float32, DEVICE)
    with pytest.raises(ValueError, match="share 2 KV heads"):
        triton_paged_decode_attention(query, k_cache, v_cache, tables, lens, 3, 0.25)
    query = query[:, :4]
    with pytest.raises(ValueError, match="power of two"):
        triton_paged_decode_attention(query, k_cache, v_cache, tables, lens, 3, 0.25, num_splits=3)
    with pytest.raises(ValueError, match="1 blocks of 4 cannot hold a context of 5 tokens"):
        triton_paged_decode_attention(query, k_cache, v_cache, tables, lens, 5, 0.25)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [0, 1024], ids=["full", "window1024"])
@pytest.mark.parametrize(("num_heads", "kv_heads"), [(32, 32), (24, 8), (32, 4)],
                         ids=["gqa1", "gqa3", "gqa8"])
def test_decode_matches_reference_at_real_sizes_on_cuda(num_heads, kv_heads, window):
    """64 ragged contexts up to 4096 tokens (block boundaries and a 1-token one included),
    head_dim 128, blocks of 16, bfloat16, the default split-K (up to 8 splits here)."""
    gen = torch.Generator().manual_seed(3)
    lens = torch.randint(1, 4097, (58,), generator=gen).tolist() + [1, 16, 17, 4096, 4095, 2048]
    case = make_case(lens, num_heads, kv_heads, 128, 16, torch.bfloat16, "cuda")
    check_against_reference(case, max(lens), window, f"cuda {num_heads}/{kv_heads} w{window}")
