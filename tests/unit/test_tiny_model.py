"""The tiny checkpoints load like real ones, round-trip any UTF-8 text and decode non-degenerately."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from splitserve_cli.tiny_model import build_tiny_model

ROUND_TRIP_TEXTS = [
    "The capital of France is Paris.",
    "naïve café, crème brûlée, Zürich, Łódź",
    "emoji 🙂🚀 and CJK 東京 and Cyrillic Москва",
    "  leading spaces,\ttabs\nand newlines  ",
    "<|im_start|>user\nhi<|im_end|>\n",
    "",
]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_dir(request):
    return request.getfixturevalue(f"tiny_{request.param}_dir")


def _load(path):
    return AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path).eval()


def test_llama_config_matches_spec(tiny_llama_dir):
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"]) == (64, 2)
    assert config["num_attention_heads"] == 8
    assert config["num_key_value_heads"] == 4  # grouped-query attention
    assert config["head_dim"] == 8
    assert config["intermediate_size"] == 128
    assert config["max_position_embeddings"] == 512
    assert config["rope_parameters"]["rope_theta"] == 10000.0
    assert config["tie_word_embeddings"] is False


def test_qwen2_has_qkv_bias_and_tied_embeddings(tiny_qwen2_dir):
    _, model = _load(tiny_qwen2_dir)
    assert model.config.architectures == ["Qwen2ForCausalLM"]
    assert model.config.tie_word_embeddings is True
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    attn = model.model.layers[0].self_attn
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert proj.bias is not None and proj.bias.abs().sum() > 0  # random, so a lost bias shows


def test_weights_are_float32_and_norms_are_randomized(tiny_dir):
    _, model = _load(tiny_dir)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    norm = model.model.layers[0].input_layernorm.weight
    assert not torch.allclose(norm, torch.ones_like(norm))


def test_vocab_matches_tokenizer_and_special_tokens(tiny_dir):
    tokenizer, model = _load(tiny_dir)
    assert 512 <= len(tokenizer) <= 1024
    assert model.config.vocab_size == len(tokenizer)
    for token in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        assert tokenizer.convert_tokens_to_ids(token) < 3
        assert len(tokenizer.encode(token)) == 1
    assert tokenizer.eos_token == "<|im_end|>"
    assert model.config.eos_token_id == tokenizer.eos_token_id


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_tokenizer_round_trips_utf8(tiny_llama_dir, text):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text


def test_chat_template_is_chatml(tiny_llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_greedy_generation_is_not_constant(tiny_dir):
    tokenizer, model = _load(tiny_dir)
    prompt = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.inference_mode():
        output = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=False
        )
    new_tokens = output[0, prompt.shape[1] :].tolist()
    assert len(set(new_tokens)) >= 8, new_tokens


def test_same_seed_gives_identical_files_and_new_seed_new_weights(tmp_path):
    def digests(path):
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}

    first = digests(build_tiny_model(tmp_path / "a", arch="llama", seed=3))
    again = digests(build_tiny_model(tmp_path / "b", arch="llama", seed=3))
    other = digests(build_tiny_model(tmp_path / "c", arch="llama", seed=4))
    assert first == again
    assert other["model.safetensors"] != first["model.safetensors"]
    assert other["tokenizer.json"] == first["tokenizer.json"]


def test_overrides_replace_config_fields(tmp_path):
    path = build_tiny_model(tmp_path / "deep", arch="llama", num_hidden_layers=3)
    assert json.loads((path / "config.json").read_text())["num_hidden_layers"] == 3


def test_unknown_arch_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown arch"):
        build_tiny_model(tmp_path, arch="gpt2")
