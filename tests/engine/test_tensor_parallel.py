"""Tensor parallelism on CPU (gloo, one process per rank): TP=2 and TP=4 produce the TP=1
greedy tokens, with logprobs equal to float noise, through chunked prefill, prefix-cache hits
and preemption; each rank loads only its slice of the checkpoint; a size that does not split
the heads names the sizes that do; a dead rank fails the engine at once and never hangs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from engine_harness import (
    LOGPROB_ATOL,
    Collected,
    add_all,
    assert_no_leak,
    drive,
    make_engine,
    random_prompts,
)
from safetensors.torch import load_file

from engine.config import EngineConfig, ModelConfig
from engine.distributed import TensorParallelGroup, get_tp, set_tensor_parallel_group
from engine.executor import TensorParallelError
from engine.llm_engine import LLMEngine
from engine.models.loader import load_model
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 16
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=3)
# Small steps (chunked prefill), a shared prefix (cache hits) and a cache too small for all of
# them at once (preemption), so each mechanism crosses the rank boundary.
SCHEDULE = dict(block_size=4, num_kv_blocks=24, max_num_batched_tokens=24,
                long_prefill_token_threshold=10, num_threads=1)


def _prompts() -> dict[str, list[int]]:
    shared = random_prompts([12], seed=5)[0]
    tails = random_prompts([1, 9, 14], seed=6)
    prompts = {f"shared{i}": shared + tail for i, tail in enumerate(tails)}
    prompts.update({f"solo{n}": p for n, p in zip([3, 21], random_prompts([3, 21], seed=7),
                                                 strict=True)})
    return prompts


def _run(model_dir, tp: int, **config) -> tuple[dict[str, Collected], LLMEngine]:
    engine = make_engine(model_dir, tensor_parallel_size=tp, **SCHEDULE, **config)
    try:
        add_all(engine, _prompts(), GREEDY)
        return drive(engine), engine
    finally:
        engine.close()


def _assert_same(ours: dict[str, Collected], reference: dict[str, Collected]) -> None:
    assert set(ours) == set(reference)
    for rid, ref in reference.items():
        assert ours[rid].token_ids == ref.token_ids, rid
        for lp, ref_lp in zip(ours[rid].logprobs, ref.logprobs, strict=True):
            assert abs(lp.logprob - ref_lp.logprob) <= LOGPROB_ATOL
            assert lp.top.keys() == ref_lp.top.keys()
            for token, value in lp.top.items():
                assert abs(value - ref_lp.top[token]) <= LOGPROB_ATOL


@pytest.fixture(scope="module")
def tp1_results(tiny_llama_dir):
    results, engine = _run(tiny_llama_dir, 1)
    assert engine.scheduler.num_preemptions > 0, "the schedule no longer preempts"
    # The hits are on resumption after preemption (the prompts sharing a prefix arrive
    # together), which the prefix-cache statistics leave out: compare with no cache instead.
    _, uncached = _run(tiny_llama_dir, 1, enable_prefix_caching=False)
    assert engine.num_computed_tokens < uncached.num_computed_tokens, (
        "the schedule no longer hits the prefix cache")
    return results


@pytest.mark.parametrize("tp", [2, 4])
def test_greedy_tokens_match_tp1(tiny_llama_dir, tp1_results, tp):
    results, engine = _run(tiny_llama_dir, tp)
    _assert_same(results, tp1_results)
    assert engine.runner.num_kv_heads == 4 // tp  # 8 heads, 4 KV heads: each rank its own
    assert engine.scheduler.num_preemptions > 0
    assert_no_leak(engine)


def test_kv_heads_are_replicated_when_fewer_than_ranks(tmp_path):
    from splitserve_cli.tiny_model import build_tiny_model

    mqa = build_tiny_model(tmp_path / "mqa", arch="llama", seed=1, num_key_value_heads=1)
    reference, _ = _run(mqa, 1)
    results, engine = _run(mqa, 2)
    assert engine.runner.num_kv_heads == 1
    _assert_same(results, reference)


def test_a_size_that_does_not_split_the_heads_names_the_valid_sizes(tiny_llama_dir):
    with pytest.raises(ValueError) as err:
        LLMEngine(EngineConfig(model=str(tiny_llama_dir), device="cpu", tensor_parallel_size=3))
    message = str(err.value)
    assert "8 attention heads do not divide by 3" in message
    assert message.endswith("valid sizes: 1, 2, 4, 8")


@pytest.fixture
def restore_tp_group():
    previous = get_tp()
    yield
    set_tensor_parallel_group(previous)


@pytest.mark.parametrize("rank,size", [(1, 2), (3, 4), (5, 8)])
def test_each_rank_holds_its_slice_of_the_checkpoint(tiny_llama_dir, restore_tp_group, rank, size):
    # Loading needs no collective, so a rank can be built alone with a group of no processes.
    set_tensor_parallel_group(TensorParallelGroup(rank=rank, size=size))
    model = load_model(ModelConfig.from_dir(tiny_llama_dir), torch.float32, torch.device("cpu"))
    full = {k.removeprefix("model."): v for k, v in load_file(tiny_llama_dir / "model.safetensors").items()}
    head_dim, heads, kv_heads, inter, vocab = 8, 8 // size, 4 // size or 1, 128 // size, 768 // size
    kv_rank = rank // (size // 4) if size > 4 else rank  # 8 ranks share 4 KV heads in pairs

    def rows(name, start, count):
        return full[name][start * count : (start + 1) * count]

    layer = model.layers[1]
    qkv = layer.self_attn.qkv_proj.weight
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim])
    assert torch.equal(q, rows("layers.1.self_attn.q_proj.weight", rank, heads * head_dim))
    assert torch.equal(k, rows("layers.1.self_attn.k_proj.weight", kv_rank, kv_heads * head_dim))
    assert torch.equal(v, rows("layers.1.self_attn.v_proj.weight", kv_rank, kv_heads * head_dim))
    o = full["layers.1.self_attn.o_proj.weight"]
    assert torch.equal(layer.self_attn.o_proj.weight,
                       o[:, rank * heads * head_dim : (rank + 1) * heads * head_dim])
    gate, up = layer.mlp.gate_up_proj.weight.split([inter, inter])
    assert torch.equal(gate, rows("layers.1.mlp.gate_proj.weight", rank, inter))
    assert torch.equal(up, rows("layers.1.mlp.up_proj.weight", rank, inter))
    down = full["layers.1.mlp.down_proj.weight"]
    assert torch.equal(layer.mlp.down_proj.weight, down[:, rank * inter : (rank + 1) * inter])
    assert torch.equal(model.embed_tokens.weight, rows("embed_tokens.weight", rank, vocab))
    assert torch.equal(model.lm_head.weight, full["lm_head.weight"][rank * vocab : (rank + 1) * vocab])
    assert torch.equal(layer.input_layernorm.weight, full["layers.1.input_layernorm.weight"])


def test_a_killed_rank_fails_the_engine_at_once(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, tensor_parallel_size=2, num_threads=1)
    failures: list[str] = []
    engine.runner.on_failure = failures.append
    try:
        engine.add_request("long", random_prompts([8], seed=3)[0],
                           SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
        for _ in range(3):
            engine.step()
        os.kill(engine.runner.rank_pids[0], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RuntimeError):
            for _ in range(400):
                engine.step()
        assert time.monotonic() - start < 10
        deadline = time.monotonic() + 10
        while not failures and time.monotonic() < deadline:
            time.sleep(0.05)
        assert failures and "rank 1" in failures[0], failures
        with pytest.raises(TensorParallelError, match="rank 1"):
            engine.step()
    finally:
        engine.close()


def test_ranks_exit_when_rank_0_is_killed(tiny_llama_dir):
    script = textwrap.dedent(f"""
        import time
        from engine.config import EngineConfig
        from engine.llm_engine import LLMEngine
        if __name__ == "__main__":
            engine = LLMEngine(EngineConfig(model={str(tiny_llama_dir)!r}, device="cpu",
                                            num_kv_blocks=64, num_threads=1,
                                            tensor_parallel_size=2))
            print("RANKS", *engine.runner.rank_pids, flush=True)
            time.sleep(600)
    """)
    rank0 = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                             cwd=os.getcwd())
    try:
        line = rank0.stdout.readline()
        assert line.startswith("RANKS"), line
        rank1 = int(line.split()[1])
        rank0.kill()
        rank0.wait(10)
        deadline = time.monotonic() + 10
        while _alive(rank1):
            assert time.monotonic() < deadline, "rank 1 outlived its rank 0"
            time.sleep(0.1)
    finally:
        if rank0.poll() is None:
            rank0.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_smollm2_tp3_matches_tp1(smollm2_dir):
    """The real SmolLM2-135M: 9 heads and 3 KV heads, one KV head per rank at TP=3."""
    prompts = {f"r{i}": p for i, p in enumerate(random_prompts([7, 30], seed=11, vocab=49152))}
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=5)
    outputs = {}
    for tp in (1, 3):
        engine = make_engine(smollm2_dir, tensor_parallel_size=tp, num_threads=1,
                             num_kv_blocks=64)
        try:
            add_all(engine, prompts, params)
            outputs[tp] = drive(engine)
        finally:
            engine.close()
    for rid in prompts:
        ref, ours = outputs[1][rid], outputs[3][rid]
        for i, (mine, theirs) in enumerate(zip(ours.token_ids, ref.token_ids, strict=True)):
            if mine != theirs:  # DESIGN.md: only a genuine near-tie may end the comparison
                assert mine in ref.logprobs[i].top and theirs in ours.logprobs[i].top, (rid, i)
                break
            assert abs(ours.logprobs[i].logprob - ref.logprobs[i].logprob) <= 1e-3
