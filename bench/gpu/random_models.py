"""Random-weight Llama models for bench/gpu/check.sh's engine steps (engine_check.py): the
shapes, checkpoints that transformers and the engine both load, and an engine whose weights
are drawn in place on the device instead of read (for a shape too large to write and read back
within the check's time budget)."""

from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path

import torch

from engine.config import ModelConfig

LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", rms_norm_eps=1e-5,
             attention_bias=False, mlp_bias=False, hidden_act="silu")
SHAPES = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0,
                         max_position_embeddings=8192),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                     vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
                     max_position_embeddings=8192),
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0,
                     max_position_embeddings=8192),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=8, vocab_size=512,
                 tie_word_embeddings=False, rope_theta=10000.0, max_position_embeddings=512),
}


def std_for(shape: dict) -> float:
    """Weights of std 2.4 / sqrt(hidden): each projection scales a normalized row by about 2.4
    (tiny_model's 0.3 at hidden 64), so logits are peaked and greedy margins clear."""
    return 2.4 / math.sqrt(shape["hidden_size"])


def randomize_(model: torch.nn.Module, std: float, seed: int = 0) -> None:
    """Norm weights near 1, everything else N(0, std^2), drawn on the parameters' device."""
    generator = torch.Generator(next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.empty(param.shape, device=param.device).normal_(generator=generator)
            param.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else std * noise)


def write_config(folder: Path, shape: dict) -> Path:
    from transformers import LlamaConfig

    config = LlamaConfig(**LLAMA, **shape, eos_token_id=None, bos_token_id=None)
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    return folder


def hf_checkpoint(folder: Path, shape: dict, dtype: torch.dtype, device: torch.device):
    """A random checkpoint written to `folder`, and the transformers model holding it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    write_config(folder, shape)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=dtype)
    randomize_(model, std_for(shape))
    model.save_pretrained(folder)
    return model.eval()


@contextmanager
def weights_drawn_in_place(std: float):
    """ModelRunner builds its model as usual, but draws the weights instead of reading them."""
    import engine.model_runner as model_runner
    from engine.models.loader import _default_dtype
    from engine.models.registry import resolve_model_class

    def load(config: ModelConfig, dtype: torch.dtype, device: torch.device):
        with torch.device(device), _default_dtype(dtype):
            model = resolve_model_class(config.architecture)(config)
        randomize_(model, std)
        return model.eval()

    saved = model_runner.load_model
    model_runner.load_model = load
    try:
        yield
    finally:
        model_runner.load_model = saved
