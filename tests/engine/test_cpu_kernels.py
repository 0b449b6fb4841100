"""The C++ CPU decode attention (kernels/cpu) against its torch reference,
kernels.attention.paged_decode_attention (rows on their own and behind shared prefixes), and the
engine's greedy output with either one."""

from __future__ import annotations

import pytest
import torch
from engine_harness import make_engine
from kernel_build import require_cpu_kernels

from engine import model_runner
from engine.sampling_params import SamplingParams
from kernels.attention import find_shared_prefixes, paged_decode_attention

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


def _shared_case(dtype, heads, kv_heads, head_dim, groups, own, seed=0):
    """Rows behind shared prefixes: groups [(prefix blocks, rows)], each row then `own` tokens
    of its own blocks, plus two rows behind no prefix; rows shuffled, blocks at random."""
    generator = torch.Generator().manual_seed(seed)
    num_blocks = 400
    free = torch.randperm(num_blocks, generator=generator).tolist()
    tables, lens, prefix_of, prefix_lens = [], [], [], []
    for p, (blocks, rows) in enumerate(groups):
        prefix = [free.pop() for _ in range(blocks)]
        prefix_lens.append(blocks * BLOCK)
        for row in range(rows):
            n = blocks * BLOCK + own[row % len(own)]
            tables.append(prefix + [free.pop() for _ in range(-(-n // BLOCK) - blocks)])
            lens.append(n)
            prefix_of.append(p)
    for n in (7, 90):
        tables.append([free.pop() for _ in range(-(-n // BLOCK))])
        lens.append(n)
        prefix_of.append(-1)
    order = torch.randperm(len(lens), generator=generator).tolist()
    width = max(map(len, tables)) + 1
    block_tables = torch.tensor([tables[i] + [free[0]] * (width - len(tables[i])) for i in order])
    k_cache = torch.randn(num_blocks, BLOCK, kv_heads, head_dim, generator=generator).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK, kv_heads, head_dim, generator=generator).to(dtype)
    qkv = torch.randn(len(lens), heads + 2 * kv_heads, head_dim, generator=generator).to(dtype)
    return (qkv[:, :heads], k_cache, v_cache, block_tables, torch.tensor([lens[i] for i in order]),
            torch.tensor([prefix_of[i] for i in order]), torch.tensor(prefix_lens))


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [
    (9, 3, 64),  # SmolLM2: the bf16 matrix-product path (3 query heads per KV head)
    (8, 1, 64),  # eight per KV head: row blocks of 16 query rows, partly filled
    (8, 8, 64),  # one per KV head
    (6, 2, 8),  # another head_dim: the portable path
])
@pytest.mark.parametrize("groups,own", [
    ([(5, 3), (9, 2)], [1, 40, 17]),  # two prefixes, rows of different lengths after them
    ([(20, 7)], [0, 3]),  # 320 tokens: three chunks; a row with nothing after its prefix
    ([(4, 2), (1, 2)], [33]),  # a 16-token prefix: below any chunk, odd rows
])
def test_shared_prefix_attention_matches_the_torch_reference(dtype, atol, heads, kv_heads, head_dim,
                                                              groups, own):
    """Rows behind a shared prefix, that prefix attended once for all of them: the same output
    as the reference reading every row's context, and as the kernel doing so."""
    query, k_cache, v_cache, tables, lens, prefix_of, prefix_lens = _shared_case(
        dtype, heads, kv_heads, head_dim, groups, own)
    scale = head_dim**-0.5
    expected = paged_decode_attention(query, k_cache, v_cache, tables, lens, int(lens.max()), scale)
    per_row = torch.ops.splitserve_cpu.paged_decode_attention(query, k_cache, v_cache, tables, lens, scale)
    shared = torch.ops.splitserve_cpu.paged_decode_attention(
        query, k_cache, v_cache, tables, lens, scale, 0, prefix_of, prefix_lens)
    torch.testing.assert_close(shared.float(), expected.float(), atol=atol, rtol=0)
    # bf16: the prefix's weights are rounded to bf16 for its P.V product, as on GPUs.
    torch.testing.assert_close(shared.float(), per_row.float(), atol=atol / 2, rtol=0)


def test_shared_prefix_attention_on_one_thread_and_a_sliding_window():
    """One thread takes every task; a sliding-window layer reads each row's window alone."""
    query, k_cache, v_cache, tables, lens, prefix_of, prefix_lens = _shared_case(
        torch.bfloat16, 9, 3, 64, [(6, 4)], [5, 30])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = paged_decode_attention(query, k_cache, v_cache, tables, lens, int(lens.max()), 0.125)
        shared = torch.ops.splitserve_cpu.paged_decode_attention(
            query, k_cache, v_cache, tables, lens, 0.125, 0, prefix_of, prefix_lens)
        torch.testing.assert_close(shared.float(), expected.float(), atol=2e-2, rtol=0)
        windowed = paged_decode_attention(query, k_cache, v_cache, tables, lens, int(lens.max()), 0.125,
                                          window=40)
        out = torch.ops.splitserve_cpu.paged_decode_attention(
            query, k_cache, v_cache, tables, lens, 0.125, 40, prefix_of, prefix_lens)
        torch.testing.assert_close(out.float(), windowed.float(), atol=2e-2, rtol=0)
    finally:
        torch.set_num_threads(threads)


def test_shared_prefix_attention_rejects_inconsistent_prefixes():
    query, k_cache, v_cache, tables, lens, prefix_of, prefix_lens = _shared_case(
        torch.float32, 4, 2, 8, [(3, 2)], [5])
    attend = torch.ops.splitserve_cpu.paged_decode_attention
    rows = (prefix_of == 0).nonzero().flatten().tolist()
    forked = tables.clone()
    forked[rows[1], 1] = forked[rows[1], 1] + 1 if forked[rows[1], 1] < 399 else 0
    with pytest.raises(RuntimeError, match="must share its blocks"):
        attend(query, k_cache, v_cache, forked, lens, 1.0, 0, prefix_of, prefix_lens)
    with pytest.raises(RuntimeError, match="no longer than each of its rows"):
        attend(query, k_cache, v_cache, tables, lens, 1.0, 0, prefix_of, prefix_lens + 100)
    with pytest.raises(RuntimeError, match="names prefix 1 of 1"):
        attend(query, k_cache, v_cache, tables, lens, 1.0, 0, prefix_of.clamp(max=0) + (prefix_of == 0), prefix_lens)
    with pytest.raises(RuntimeError, match="come together"):
        attend(query, k_cache, v_cache, tables, lens, 1.0, 0, prefix_of, None)


def test_find_shared_prefixes_groups_rows_by_the_blocks_they_all_hold():
    block = 16
    system = list(range(100, 108))  # 8 blocks, 128 tokens
    tables = [
        system + [1, 2, 3],  # conversation a
        system + [1, 2, 4, 5],  # a's later turn, forked at its third own block
        system + [9],  # another conversation under the same system prompt
        [50, 51, 52, 53, 54],  # alone
        [60, 61, 62, 63, 64, 65], [60, 61, 62, 63, 66],  # two rows sharing 4 blocks: 64 tokens
        [70, 71, 72], [70, 71, 73],  # sharing 2 blocks only: too few to bother
    ]
    lens = [8 * block + 40, 8 * block + 60, 8 * block + 5, 80, 6 * block, 5 * block - 3, 40, 41]
    prefix_of, prefix_lens = find_shared_prefixes(tables, lens, block)
    assert prefix_of == [0, 0, 0, -1, 1, 1, -1, -1]
    assert prefix_lens == [8 * block, 4 * block]
    # A row that has not filled the prefix's last block shares only the blocks it has filled.
    assert find_shared_prefixes([system, system], [8 * block, 7 * block + 1], block) == ([0, 0], [7 * block])
    assert find_shared_prefixes(tables[3:4] + tables[6:], lens[3:4] + lens[6:], block) is None


@pytest.mark.parametrize("dtype,atol", [
    ("float32", 1e-4),  # the portable kernel: float32 rounding only
    ("bfloat16", 0.05),  # the fused decode step and the bf16 matrix products
])
def test_engine_output_is_the_same_with_shared_prefix_attention(tiny_llama_dir, dtype, atol, monkeypatch):
    """Prompts behind one 96-token prefix, decoded together: the same greedy tokens and
    logprobs with the prefix attended once as with every row reading its own, and the shared
    path taken."""
    prefix = [(7 * i) % 200 + 3 for i in range(96)]
    prompts = [prefix + list(range(5, 5 + n)) for n in (3, 17, 40, 9)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    outputs = {}
    seen: list = []

    def spy(*args):
        seen.append(find_shared_prefixes(*args))
        return seen[-1]

    monkeypatch.setattr(model_runner, "find_shared_prefixes", spy)
    for on in (False, True):
        engine = make_engine(tiny_llama_dir, cpu_attention="cpp", cpu_shared_prefix_attention=on,
                             dtype=dtype)
        assert engine.runner.fused_decode == (dtype == "bfloat16")
        engine.generate([prefix + [1]], SamplingParams(max_tokens=1))  # the prefix now cached
        seen.clear()
        results = engine.generate(prompts, params)
        assert any(s and s[1] == [96] for s in seen) == on
        outputs[on] = [(r.token_ids, [lp.logprob for lp in r.logprobs]) for r in results]
    for (tokens_off, lps_off), (tokens_on, lps_on) in zip(outputs[False], outputs[True], strict=True):
        assert tokens_on == tokens_off
        assert lps_on == pytest.approx(lps_off, abs=atol)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_hands_shared_prefixes_to_the_kernel(tiny_llama_dir, dtype, monkeypatch):
    """The runner's shared prefixes reach the kernel, through the module path (float32) and
    the fused decode step (bfloat16): a prefix longer than its rows, planted, is refused."""
    prefix = list(range(3, 99))
    engine = make_engine(tiny_llama_dir, cpu_attention="cpp", dtype=dtype)
    engine.generate([prefix + [1]], SamplingParams(max_tokens=1))

    def too_long(tables, lens, block_size):
        found = find_shared_prefixes(tables, lens, block_size)
        return found and (found[0], [n + 10_000 for n in found[1]])

    monkeypatch.setattr(model_runner, "find_shared_prefixes", too_long)
    with pytest.raises(RuntimeError, match="no longer than each of its rows"):
        engine.generate([prefix + [5, 6], prefix + [7]], SamplingParams(max_tokens=4))
