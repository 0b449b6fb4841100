"""The AMX prefill attention over the paged cache (prefill_attention_paged in
kernels/cpu/prefill_attention.cpp, prefill_attention_amx_paged in prefill_attention_amx.cpp):
prompts after cached prefixes, all of a step's in one call, against the one-prompt op over each
gathered context, and through the engine."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_harness import absorb, drive
from kernel_build import require_cpu_kernels
from test_prefill_attention_kernel import AMX_ONLY, _cpp_prefill_engine

from engine.sampling_params import SamplingParams
from kernels.attention import prefill_attention
from kernels.linear import small_m_linear_available

pytestmark = require_cpu_kernels(small_m_linear_available(), "needs a CPU with avx512_bf16")


def _paged_case(heads, kv_heads, head_dim, block_size=16, seed=0):
    """A random paged cache and prompts over it: (query, caches, seqs, tables). The prompts
    share blocks as prefix hits do (a system prompt's three blocks, one prompt's whole context
    inside another's), their own blocks lie elsewhere in the cache, one context crosses a
    256-key block of the kernel at a run boundary (272 shared keys, then its own), one has a
    partial last block, and one nothing cached (context = query)."""
    generator = torch.Generator().manual_seed(seed)
    blocks = 96
    shape = (blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).bfloat16()
    v_cache = torch.randn(shape, generator=generator).bfloat16()
    system = [9, 3, 40]
    long_prefix = list(range(50, 67))  # 17 blocks: 272 keys
    cases = [  # (query length, context length, the context's blocks)
        (10, 58, system + [20]),
        (5, 53, system + [21]),
        (40, 88, system + [22, 23, 24]),
        (1, 48, system),
        (30, 300, long_prefix + [70, 71]),
        (16, 272, long_prefix),
        (70, 70, [80, 81, 82, 83, 84]),
    ]
    rows, tables, start = [], torch.zeros(len(cases) + 1, 24, dtype=torch.long), 0
    for row, (q_len, ctx, table) in enumerate(cases):
        tables[row + 1, :len(table)] = torch.tensor(table)  # row 0 unused: rows are looked up
        rows.append((start, q_len, ctx, row + 1))
        start += q_len + 2  # rows between prompts are no prompt's
    query = torch.randn(start, heads, head_dim, generator=generator).bfloat16()
    return query, k_cache, v_cache, torch.tensor(rows, dtype=torch.long), tables


@AMX_ONLY
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 32), (16, 1, 128)])
def test_prefill_attention_paged_equals_the_one_prompt_op_over_each_gathered_context(
        heads, kv_heads, head_dim):
    """The step's prompts after a cached prefix in one call reading the paged cache: each
    prompt's rows equal, bit for bit, the one-prompt AMX op over its context gathered from the
    cache (so a prefix hit reads the same numbers whether or not other prompts share its
    blocks), are near the float32 reference, and rows outside every prompt keep what out held."""
    from kernels.attention import gather_blocks

    query, k_cache, v_cache, seqs, tables = _paged_case(heads, kv_heads, head_dim)
    scale = head_dim ** -0.5
    out = torch.full(query.shape, 7.0, dtype=torch.bfloat16)
    torch.ops.splitserve_cpu.prefill_attention_paged(out, query, k_cache, v_cache, seqs, tables,
                                                     scale)
    covered = torch.zeros(len(query), dtype=torch.bool)
    for start, q_len, ctx, row in seqs.tolist():
        table = tables[row, :-(-ctx // k_cache.shape[1])]
        k = gather_blocks(k_cache, table).flatten(0, 1)[:ctx]
        v = gather_blocks(v_cache, table).flatten(0, 1)[:ctx]
        rows = slice(start, start + q_len)
        alone = torch.ops.splitserve_cpu.prefill_attention(query[rows], k, v, scale, 0, True)
        assert torch.equal(out[rows], alone), (start, q_len, ctx)
        exact = prefill_attention(query[rows].float(), k.float(), v.float(), scale)
        assert (out[rows].float() - exact).abs().max().item() < 3e-2
        covered[rows] = True
    assert (out[~covered] == 7.0).all()


@AMX_ONLY
@pytest.mark.parametrize("change,message", [
    (lambda q, kc, vc, s, t: (q, kc, vc, s, t.masked_fill(t == 40, 500)), "outside the cache"),
    (lambda q, kc, vc, s, t: (q, kc, vc, s, t[:, :3]), "missing or too short"),
    (lambda q, kc, vc, s, t: (q, kc, vc, s.index_fill(1, torch.tensor([3]), 99), t),
     "missing or too short"),
    (lambda q, kc, vc, s, t: (q, kc, vc, s.index_fill(1, torch.tensor([1]), 0), t), "not within"),
    (lambda q, kc, vc, s, t: (q, kc, vc, s.int(), t), "int64"),
    (lambda q, kc, vc, s, t: (q, kc[:, :8].contiguous(), vc[:, :8].contiguous(), s, t),
     "multiple of 16"),
    (lambda q, kc, vc, s, t: (q, kc.float(), vc.float(), s, t), "bfloat16"),
])
def test_prefill_attention_paged_refuses_what_it_cannot_read(change, message):
    query, k_cache, v_cache, seqs, tables = change(*_paged_case(9, 3, 64))
    out = torch.empty(query.shape, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.splitserve_cpu.prefill_attention_paged(out, query, k_cache, v_cache, seqs,
                                                         tables, 0.125)


@AMX_ONLY
def test_engine_attends_prompts_after_cached_prefixes_in_one_call_as_it_did_one_by_one(tmp_path):
    """A tiny bf16 model (head_dim 32); a system prompt is cached, then one step prefills six
    chats behind it (their own tokens only) beside a decoding request and a fresh prompt. With
    the cached spans (shipped) the six are attended in one prefill_attention_paged call per
    layer; without (the runner's spans taken away) one call per chat over its gathered
    context, as before. Every token and logprob is the same bit for bit."""
    from splitserve_cli.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny", arch="llama", seed=0, head_dim=32)
    system = [3 + (11 * i) % 250 for i in range(300)]
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=2)

    def run(one_call: bool) -> tuple[dict, float]:
        engine = _cpp_prefill_engine(model)
        assert engine.runner.paged_prefill
        if not one_call:
            engine.runner._cached_prefill_spans = lambda seqs: None
        engine.add_request("decoding", [7 + i % 90 for i in range(20)], params)
        engine.add_request("system", system, dataclasses.replace(params, max_tokens=1))
        collected: dict = {}
        while "system" not in collected or collected["system"].finish_reason is None:
            for out in engine.step():
                absorb(collected, out)
        for i in range(6):
            engine.add_request(f"chat{i}", system + [20 + (i * 37 + j * 13) % 200
                                                     for j in range(1 + 9 * i)], params)
        engine.add_request("fresh", [30 + j % 150 for j in range(40)], params)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for out in engine.step():  # the decode row, six chats after the prefix, one fresh
                absorb(collected, out)
        calls = sum(e.count for e in prof.key_averages() if "prefill_attention_paged" in e.key)
        for result in drive(engine).values():
            for out in result.outputs:
                absorb(collected, out)
        assert all(collected[f"chat{i}"].num_cached_tokens == 288 for i in range(6))
        return ({rid: (r.token_ids, r.logprobs) for rid, r in collected.items()},
                calls / len(engine.runner.model.layers))

    one_call, calls = run(True)
    per_prompt, calls_before = run(False)
    assert calls == 1 and calls_before == 0  # per layer
    assert one_call == per_prompt
