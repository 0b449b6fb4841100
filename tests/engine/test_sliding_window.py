"""Sliding-window attention: config.json read as transformers reads it (Mistral on every layer,
Qwen2 only with `use_sliding_window`, on its sliding layers), and greedy decoding equal to
transformers in float32 for a tiny random Mistral and Qwen2 whose window (8) is much shorter
than the test's contexts (up to 45 prompt + 24 generated tokens)."""

from __future__ import annotations

import json

import pytest
from engine_harness import (
    add_all,
    assert_greedy_parity,
    assert_no_leak,
    drive,
    make_engine,
    random_prompts,
)
from tiny_mistral import build_tiny_mistral

from engine.config import ModelConfig
from engine.sampling_params import SamplingParams

WINDOW = 8
MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=5)
LENGTHS = [1, 3, 17, 24, 45]


@pytest.fixture(scope="module")
def tiny_mistral_dir(tmp_path_factory):
    return build_tiny_mistral(tmp_path_factory.mktemp("tiny-mistral"), window=WINDOW)


@pytest.fixture(scope="module")
def tiny_qwen2_sliding_dir(tmp_path_factory):
    """Layer 0 full attention, layer 1 a window of 8 (max_window_layers=1)."""
    from splitserve_cli.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2-sliding"), arch="qwen2", seed=0,
                            use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)


@pytest.fixture(params=["mistral", "qwen2"])
def sliding_model_dir(request, tiny_mistral_dir, tiny_qwen2_sliding_dir):
    return {"mistral": tiny_mistral_dir, "qwen2": tiny_qwen2_sliding_dir}[request.param]


def _prompts(seed: int = 0) -> dict[str, list[int]]:
    return {f"p{n}": p for n, p in zip(LENGTHS, random_prompts(LENGTHS, seed), strict=True)}


# -- config.json ------------------------------------------------------------------------------


def test_mistral_and_qwen2_windows_are_read_per_layer(tiny_mistral_dir, tiny_qwen2_sliding_dir):
    assert ModelConfig.from_dir(tiny_mistral_dir).layer_windows == (WINDOW, WINDOW)
    assert ModelConfig.from_dir(tiny_qwen2_sliding_dir).layer_windows == (0, WINDOW)


def _config_with(tmp_path, source, **fields):
    raw = json.loads((source / "config.json").read_text())
    for key, value in fields.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


def test_qwen2_window_is_off_without_use_sliding_window(tmp_path, tiny_qwen2_sliding_dir):
    path = _config_with(tmp_path, tiny_qwen2_sliding_dir, use_sliding_window=False)
    assert ModelConfig.from_dir(path).layer_windows == ()


def test_qwen2_without_layer_types_slides_from_max_window_layers(tmp_path, tiny_qwen2_sliding_dir):
    path = _config_with(tmp_path, tiny_qwen2_sliding_dir, layer_types=None, max_window_layers=0)
    assert ModelConfig.from_dir(path).layer_windows == (WINDOW, WINDOW)


def test_mistral_without_a_window_attends_everything(tmp_path, tiny_mistral_dir):
    # Mistral-7B v0.2 and later: "sliding_window": null.
    path = _config_with(tmp_path, tiny_mistral_dir, sliding_window=None)
    assert ModelConfig.from_dir(path).layer_windows == ()


@pytest.mark.parametrize("fields,message", [
    ({"sliding_window": 0}, "sliding_window must be a positive integer"),
    ({"sliding_window": "8"}, "sliding_window must be a positive integer"),
    ({"layer_types": ["full_attention", "chunked_attention"]}, "layer_types"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
])
def test_a_malformed_window_is_refused_naming_the_field(tmp_path, tiny_qwen2_sliding_dir, fields, message):
    path = _config_with(tmp_path, tiny_qwen2_sliding_dir, **fields)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dir(path)


# -- parity with transformers -----------------------------------------------------------------


def test_sliding_window_batch_matches_transformers(sliding_model_dir):
    engine = make_engine(sliding_model_dir)
    assert engine.runner.native_decode  # float32 decode rows take the C++ kernel's window
    prompts = _prompts()
    add_all(engine, prompts, GREEDY)
    results = drive(engine)
    for rid, prompt in prompts.items():
        assert_greedy_parity(sliding_model_dir, prompt, results[rid], MAX_TOKENS)
    assert_no_leak(engine)


def test_sliding_window_with_the_torch_reference_matches_transformers(sliding_model_dir):
    engine = make_engine(sliding_model_dir, cpu_attention="torch")
    prompts = _prompts(seed=1)
    add_all(engine, prompts, GREEDY)
    results = drive(engine)
    for rid, prompt in prompts.items():
        assert_greedy_parity(sliding_model_dir, prompt, results[rid], MAX_TOKENS)
    assert_no_leak(engine)


def test_sliding_window_chunked_prefill_and_prefix_hits_match_transformers(sliding_model_dir):
    # Chunks of 5 tokens attend over a cached prefix longer than the window; the second round
    # reads whole prompts back from the prefix cache.
    engine = make_engine(sliding_model_dir, max_num_batched_tokens=12, long_prefill_token_threshold=5)
    prompts = _prompts(seed=2)
    add_all(engine, prompts, GREEDY)
    first = drive(engine)
    add_all(engine, {f"again-{rid}": p for rid, p in prompts.items()}, GREEDY)
    second = drive(engine)
    for rid, prompt in prompts.items():
        assert_greedy_parity(sliding_model_dir, prompt, first[rid], MAX_TOKENS)
        assert_greedy_parity(sliding_model_dir, prompt, second[f"again-{rid}"], MAX_TOKENS)
    assert second["again-p45"].num_cached_tokens == 44
    assert_no_leak(engine)
