"""Maps a checkpoint's `architectures` entry to the class that implements it."""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


def resolve_model_class(architecture: str) -> type:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        supported = ", ".join(sorted(MODEL_REGISTRY))
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {supported}"
        ) from None
