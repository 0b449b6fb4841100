"""A tiny random Mistral checkpoint (sliding-window attention) for engine tests: config.json,
float32 safetensors and a generation config, no tokenizer; seconds to build."""

from __future__ import annotations

from pathlib import Path

import torch


def _randomize(model, seed: int) -> None:
    """Peaked logits (std 0.3, as splitserve_cli.tiny_model does): clear top-1 margins; norm
    weights randomized too, so a loader that forgets one fails parity."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.3 * noise)


def build_tiny_mistral(path: Path, *, window: int, head_dim: int = 8, heads: int = 8,
                       kv_heads: int = 4, hidden_size: int = 64, intermediate_size: int = 128,
                       layers: int = 2, seed: int = 0) -> Path:
    """A random MistralForCausalLM with `sliding_window=window`, vocabulary 768 (EOS id 2)."""
    from transformers import GenerationConfig, MistralConfig, MistralForCausalLM

    config = MistralConfig(
        architectures=["MistralForCausalLM"], vocab_size=768, hidden_size=hidden_size,
        intermediate_size=intermediate_size, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=512,
        sliding_window=window, tie_word_embeddings=False, bos_token_id=0, eos_token_id=2,
        pad_token_id=0, dtype="float32",
    )
    model = MistralForCausalLM(config)
    _randomize(model, seed)
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(str(path))
    return path
