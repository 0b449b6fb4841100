"""Weights are made in the serving dtype: loading a model in bfloat16 never allocates a
float32 tensor of a parameter's shape (the old path built the model in float32 and cast it,
so weight memory peaked at float32 + bfloat16), and the loaded values are the checkpoint's,
rounded once."""

from __future__ import annotations

import torch
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode

from engine.config import ModelConfig
from engine.models.loader import load_model, safetensors_files


class _Allocations(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[torch.dtype, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and func.__name__.split(".")[0] in (
                "empty", "zeros", "ones", "full", "empty_strided", "_to_copy"):
            self.made.append((out.dtype, tuple(out.shape)))
        return out


def test_bf16_load_allocates_no_float32_parameter(tiny_llama_dir):
    config = ModelConfig.from_dir(tiny_llama_dir)
    with _Allocations() as recorded:
        model = load_model(config, torch.bfloat16, torch.device("cpu"))
    shapes = {tuple(p.shape) for p in model.parameters()}
    float32_params = [(d, s) for d, s in recorded.made if d == torch.float32 and s in shapes]
    assert not float32_params, float32_params[:5]
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32, "the default dtype is restored"
    checkpoint = {}
    for file in safetensors_files(tiny_llama_dir):
        checkpoint.update(load_file(str(file)))
    ours = dict(model.named_parameters())
    for name in ("layers.0.post_attention_layernorm.weight", "embed_tokens.weight"):
        assert torch.equal(ours[name], checkpoint[f"model.{name}"].to(torch.bfloat16)), name
