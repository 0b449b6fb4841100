"""Decode steps through DecodeGraphs (engine/cuda_graphs.py) give the tokens and logprobs of the
same engine run eagerly: batches padded to the graphs' sizes, contexts past the graphs' block
tables and prefill steps falling back to eager, padding rows writing no KV.

A CPU has no CUDA graphs: `eager_replay` stands in for the capture (each replay runs the same
forward again on the graph's static buffer and writes the same output tensor), so everything
but the capture itself runs as on a GPU: the static buffers, StepInputs packing into them,
padding, bucket choice and the Triton kernels (interpreted here, TRITON_INTERPRET=1 from
conftest.py). The gpu-marked test captures real graphs on CUDA.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine.cuda_graphs import DecodeGraphs, eager_replay, graph_batch_sizes  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from tests.engine.engine_harness import (  # noqa: E402
    LOGPROB_ATOL,
    assert_no_leak,
    drive,
    make_engine,
    random_prompts,
)


def engine_for(model_dir, device="cpu", dtype="float32"):
    return make_engine(model_dir, cpu_attention="torch", attention_backend="triton",
                       device=device, dtype=dtype, max_num_batched_tokens=64)


def with_graphs(engine, max_batch=8, max_context=32, capture=eager_replay):
    runner = engine.runner
    runner.graphs = DecodeGraphs(runner.model, runner.kv_caches, block_size=runner.block_size,
                                 max_context=max_context, max_batch=max_batch, capture=capture)
    runner.graphs.capture_all()
    return runner.graphs


def run(engine, prompts, max_tokens):
    for (rid, prompt), n in zip(prompts.items(), max_tokens, strict=True):
        engine.add_request(rid, prompt, SamplingParams(max_tokens=n, temperature=0.0, logprobs=3,
                                                       ignore_eos=True))
    return drive(engine)


def test_graph_batch_sizes_cover_every_batch_up_to_the_largest():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert graph_batch_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    with pytest.raises(ValueError, match="at least 1"):
        graph_batch_sizes(0)


def test_capture_writes_no_kv(tiny_llama_dir):
    engine = engine_for(tiny_llama_dir)
    with_graphs(engine)
    # every graph ran its forward on padding rows only (slot -1): the pool is still untouched
    assert not engine.runner.kv_cache.any()


def test_graph_for_picks_the_smallest_graph_that_holds_the_batch(tiny_llama_dir):
    engine = engine_for(tiny_llama_dir)
    graphs = with_graphs(engine, max_batch=8, max_context=32)
    assert [graphs.graph_for(n, 10).batch for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert graphs.graph_for(9, 10) is None  # more rows than the largest graph
    assert graphs.graph_for(1, 33) is None  # a context past the graphs' block tables
    assert graphs.graph_for(1, 32) is not None


def test_all_graphs_write_their_logits_into_one_buffer(tiny_llama_dir):
    graphs = with_graphs(engine_for(tiny_llama_dir), max_batch=8)
    pointers = {graph.logits.data_ptr() for graph in graphs.graphs.values()}
    assert len(pointers) == 1
    assert [graphs.graphs[b].logits.shape[0] for b in (1, 2, 4, 8)] == [1, 2, 4, 8]


def test_decode_graphs_give_the_eager_tokens(tiny_llama_dir):
    """Five greedy requests finishing one after another (decode batches of 5, 4, 3, 2, 1 rows:
    graphs of 8, 4, 4, 2, 1, so padded) whose contexts grow past the graphs' 32 tokens, where
    steps go eager again mid-stream."""
    prompts = dict(zip("abcde", random_prompts([3, 9, 14, 6, 11], seed=3), strict=True))
    max_tokens = [6, 10, 14, 18, 26]
    eager = run(engine_for(tiny_llama_dir), prompts, max_tokens)
    engine = engine_for(tiny_llama_dir)
    graphs = with_graphs(engine, max_batch=8, max_context=32)
    ours = run(engine, prompts, max_tokens)
    assert graphs.replays >= 15, graphs.replays
    assert max(len(p) + n for p, n in zip(prompts.values(), max_tokens, strict=True)) > 32
    for rid, ref in eager.items():
        assert ours[rid].token_ids == ref.token_ids, rid
        for mine, theirs in zip(ours[rid].logprobs, ref.logprobs, strict=True):
            assert mine.top.keys() == theirs.top.keys(), rid
            assert abs(mine.logprob - theirs.logprob) < LOGPROB_ATOL, rid
    assert_no_leak(engine)


@pytest.mark.gpu
def test_captured_cuda_graphs_give_the_eager_tokens(tiny_llama_dir):
    """The same on CUDA with real graphs (the worker's own capture: cuda_capture)."""
    from engine.cuda_graphs import cuda_capture

    prompts = dict(zip("abcde", random_prompts([3, 9, 14, 6, 11], seed=3), strict=True))
    max_tokens = [6, 10, 14, 18, 26]
    eager_engine = engine_for(tiny_llama_dir, device="cuda")
    eager_engine.runner.graphs = None
    eager = run(eager_engine, prompts, max_tokens)
    engine = engine_for(tiny_llama_dir, device="cuda")
    graphs = with_graphs(engine, capture=cuda_capture(torch.device("cuda")))
    ours = run(engine, prompts, max_tokens)
    assert graphs.replays >= 15
    for rid, ref in eager.items():
        assert ours[rid].token_ids == ref.token_ids, rid
