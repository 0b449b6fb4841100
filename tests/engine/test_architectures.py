"""What the README's supported-architecture table promises, read from config.json: per
architecture, the rope scaling kinds, sliding window and biases that load, and the ones refused
at once with an error naming the field (never a model that loads and answers wrongly)."""

from __future__ import annotations

import json

import pytest
from tiny_mistral import build_tiny_mistral

from engine.config import ModelConfig


@pytest.fixture(scope="module")
def tiny_mistral_dir(tmp_path_factory):
    return build_tiny_mistral(tmp_path_factory.mktemp("tiny-mistral-arch"), window=8)


def _config(tmp_path, source, **fields):
    raw = json.loads((source / "config.json").read_text())
    raw.update(fields)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return ModelConfig.from_dir(tmp_path)


LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def test_llama_loads_default_and_llama3_rope(tmp_path, tiny_llama_dir):
    assert _config(tmp_path, tiny_llama_dir).rope_scaling is None
    assert _config(tmp_path, tiny_llama_dir, rope_scaling=LLAMA3_SCALING).rope_scaling == LLAMA3_SCALING


@pytest.mark.parametrize("kind", ["linear", "dynamic", "yarn", "longrope"])
def test_other_rope_scaling_is_refused_naming_it(tmp_path, tiny_llama_dir, kind):
    with pytest.raises(ValueError, match=f"rope_scaling type '{kind}' is not supported"):
        _config(tmp_path, tiny_llama_dir, rope_scaling={"rope_type": kind, "factor": 2.0})
    with pytest.raises(ValueError, match=f"rope_scaling type '{kind}'"):  # the older key
        _config(tmp_path, tiny_llama_dir, rope_scaling={"type": kind, "factor": 2.0})


@pytest.mark.parametrize("field", ["attention_bias", "mlp_bias"])
def test_llama_biases_are_refused_naming_the_field(tmp_path, tiny_llama_dir, field):
    # transformers puts attention_bias on o_proj too, which the fused C++ decode would drop.
    with pytest.raises(ValueError, match=f"{field}=true is not supported"):
        _config(tmp_path, tiny_llama_dir, **{field: True})


def test_qwen2_has_qkv_bias_and_mistral_none_whatever_the_config_says(tmp_path, tiny_qwen2_dir,
                                                                      tiny_mistral_dir):
    assert _config(tmp_path, tiny_qwen2_dir, attention_bias=False).attention_bias
    assert not _config(tmp_path, tiny_mistral_dir, attention_bias=True).attention_bias


def test_tied_embeddings_are_read(tmp_path, tiny_qwen2_dir, tiny_llama_dir):
    assert ModelConfig.from_dir(tiny_qwen2_dir).tie_word_embeddings
    assert not ModelConfig.from_dir(tiny_llama_dir).tie_word_embeddings


def test_llama_has_no_sliding_window_even_if_the_config_names_one(tmp_path, tiny_llama_dir):
    # transformers' Llama never reads sliding_window; neither does the engine.
    assert _config(tmp_path, tiny_llama_dir, sliding_window=4).layer_windows == ()
