"""The converted SmolLM2-135M-Instruct folder has the architecture the engine expects."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_config_describes_smollm2_135m(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 30
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["hidden_size"] == 576
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert config["dtype"] == "float32"
    assert "quantization_config" not in config


def test_tokenizer_has_chatml_template_and_eos(smollm2_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert "<|im_start|>" in tokenizer.chat_template
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2


def test_weights_are_float32_with_tied_lm_head(smollm2_dir):
    from safetensors import safe_open

    with safe_open(smollm2_dir / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
        embed = f.get_slice("model.embed_tokens.weight")
        assert embed.get_dtype() == "F32"
        assert embed.get_shape() == [49152, 576]
    assert "lm_head.weight" not in names  # tied to the embeddings
    assert sum(name.endswith("self_attn.q_proj.weight") for name in names) == 30
