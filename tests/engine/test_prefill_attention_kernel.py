"""The C++ CPU prefill attention (kernels/cpu/prefill_attention.cpp, and its AMX path in
prefill_attention_amx.cpp) against its torch reference, kernels.attention.prefill_attention,
and the engine's prompt logprobs with either."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_harness import absorb, drive
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


def _packed_prompts(lengths, heads, kv_heads, head_dim, seed=0):
    """A step's rows: prompts of `lengths` back to back, as the model passes them (strided
    slices of the qkv projection), with a decode-like row between the first two."""
    rows = sum(lengths) + 1
    generator = torch.Generator().manual_seed(seed)
    qkv = torch.randn(rows, heads + 2 * kv_heads, head_dim, generator=generator).bfloat16()
    spans, start = [], 0
    for i, length in enumerate(lengths):
        spans.append((start, length))
        start += length + (1 if i == 0 else 0)
    return (qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:], spans)


@pytest.mark.parametrize("lengths", [
    [1], [128] * 16, [5, 63, 64, 65, 1, 130], [300, 17],
])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 8, 64), (6, 2, 48), (4, 4, 80)])
@pytest.mark.parametrize("window", [0, 7, 64])
@PATHS
def test_prefill_attention_into_attends_each_prompt_on_its_own(lengths, heads, kv_heads, head_dim,
                                                               window, amx):
    """Several prompts of a step in one call: each prompt's rows equal the one-prompt op on that
    prompt alone (bit for bit on the dot-product path: the same tiles, the same order of
    sums), and rows outside every prompt keep what out held."""
    query, key, value, spans = _packed_prompts(lengths, heads, kv_heads, head_dim)
    scale = head_dim ** -0.5
    out = torch.full(query.shape, 7.0, dtype=torch.bfloat16)
    torch.ops.splitserve_cpu.prefill_attention_into(
        out, query, key, value, torch.tensor(spans, dtype=torch.long), scale, window, amx)
    covered = torch.zeros(len(query), dtype=torch.bool)
    for start, length in spans:
        end = start + length
        alone = torch.ops.splitserve_cpu.prefill_attention(
            query[start:end], key[start:end], value[start:end], scale, window, amx)
        assert torch.equal(out[start:end], alone), (start, length)
        exact = prefill_attention(query[start:end].float(), key[start:end].float(),
                                  value[start:end].float(), scale, window)
        assert (out[start:end].float() - exact).abs().max().item() < 3e-2
        covered[start:end] = True
    assert (out[~covered] == 7.0).all()


@pytest.mark.parametrize("spans,message", [
    ([(0, 0)], "not within"), ([(-1, 3)], "not within"), ([(10, 10)], "not within"),
])
def test_prefill_attention_into_refuses_spans_outside_the_rows(spans, message):
    query, key, value = _inputs(12, 12, 9, 3, 64)
    out = torch.empty(query.shape, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.splitserve_cpu.prefill_attention_into(
            out, query, key, value, torch.tensor(spans, dtype=torch.long), 0.125)
    with pytest.raises(RuntimeError, match="int64"):
        torch.ops.splitserve_cpu.prefill_attention_into(
            out, query, key, value, torch.tensor([[0, 4]], dtype=torch.int32), 0.125)
    with pytest.raises(RuntimeError, match="one row per query row"):
        torch.ops.splitserve_cpu.prefill_attention_into(
            out[:4], query[:4], key, value, torch.tensor([[0, 4]], dtype=torch.long), 0.125)


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


def _cpp_prefill_engine(model) -> LLMEngine:
    """A bf16 engine with the C++ prefill attention asked for, blocks of 16, one step taking up
    to 1,024 tokens (the engine tests below put several prompts in one step)."""
    from engine.scheduler import SchedulerConfig

    return LLMEngine(EngineConfig(
        model=str(model), dtype="bfloat16", device="cpu", num_kv_blocks=256, block_size=16,
        cpu_attention="cpp", scheduler=SchedulerConfig(max_num_batched_tokens=1024)))


def test_engine_attends_a_steps_fresh_prompts_in_one_call_as_it_did_one_by_one(tmp_path):
    """A tiny bf16 model (head_dim 32); one step carries a decoding request, a prompt after a
    cached prefix and three fresh prompts. With the fresh prompts' spans (shipped) they are
    attended in one prefill_attention_into call per layer; without them (the runner's spans
    taken away), one call per prompt as before. Every token and logprob is the same bit for bit,
    and the profiler shows which op ran."""
    from splitserve_cli.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny", arch="llama", seed=0, head_dim=32)
    shared = [3 + (11 * i) % 250 for i in range(48)]
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=2, prompt_logprobs=1)

    def run(one_call: bool) -> tuple[dict, int]:
        engine = _cpp_prefill_engine(model)
        assert engine.runner.native_prefill
        if not one_call:
            engine.runner._fresh_prefill_spans = lambda seqs: None
        engine.add_request("decoding", [7 + i % 90 for i in range(20)],
                           dataclasses.replace(params, max_tokens=12))
        engine.add_request("prefix", shared, dataclasses.replace(params, max_tokens=1))
        collected: dict = {}
        while "prefix" not in collected or collected["prefix"].finish_reason is None:
            for out in engine.step():  # the shared prefix is cached once it is done
                absorb(collected, out)
        # (no prompt logprobs: they need every position computed, so they skip the cache)
        engine.add_request("after-prefix", shared + [5, 6, 7, 8, 9],
                           dataclasses.replace(params, prompt_logprobs=None))
        for i, length in enumerate((1, 33, 70)):
            engine.add_request(f"fresh{i}", [20 + (i * 37 + j * 13) % 200 for j in range(length)],
                               params)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            outputs = engine.step()  # 1 decode row, the prompt after the prefix, 3 fresh prompts
        for out in outputs:
            absorb(collected, out)
        calls = sum(e.count for e in prof.key_averages() if "prefill_attention_into" in e.key)
        layers = len(engine.runner.model.layers)
        for result in drive(engine).values():
            for out in result.outputs:
                absorb(collected, out)
        assert collected["after-prefix"].num_cached_tokens == 48
        return ({rid: (r.token_ids, r.prompt_logprobs, r.logprobs)
                 for rid, r in collected.items()}, calls / layers)

    one_call, calls = run(True)
    per_prompt, calls_before = run(False)
    assert calls == 1 and calls_before == 0  # per layer
    assert set(one_call) == {"decoding", "prefix", "after-prefix", "fresh0", "fresh1", "fresh2"}
    assert one_call == per_prompt


AMX_ONLY = pytest.mark.skipif(not _has_amx(), reason="needs AMX (bf16)")


@AMX_ONLY
@pytest.mark.parametrize("window", [0, 9])
def test_prefill_attention_into_reads_keys_off_a_word_boundary_as_on_one(window):
    """Keys and values are packed by 32-bit gathers where their rows start on a 32-bit word,
    element by element where they do not (rows one bf16 off): the same output either way."""
    query, key, value, spans = _packed_prompts([5, 40, 17, 128], 9, 3, 64)
    seqs = torch.tensor(spans, dtype=torch.long)

    def attend(k, v):
        out = torch.zeros(query.shape, dtype=torch.bfloat16)
        torch.ops.splitserve_cpu.prefill_attention_into(out, query, k, v, seqs, 0.125, window, True)
        return out

    def off_a_word(t):  # the same values, stored one element past a 4-byte boundary
        shifted = torch.empty(t.numel() + 1, dtype=t.dtype)[1:].view(t.shape)
        shifted.copy_(t)
        assert shifted.data_ptr() % 4 == 2
        return shifted

    assert torch.equal(attend(off_a_word(key), off_a_word(value)), attend(key.contiguous(), value.contiguous()))
