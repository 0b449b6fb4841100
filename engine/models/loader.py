"""Builds a model from a Hugging Face folder: config.json plus one or many safetensors files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.models.registry import resolve_model_class


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    return files


def iterate_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """One tensor at a time, so loading never holds a second copy of the whole model."""
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_model(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    model_cls = resolve_model_class(config.architecture)
    with torch.device(device):
        model = model_cls(config)
    model.to(dtype=dtype)
    loaded = model.load_weights(iterate_weights(Path(config.path)))
    expected = {n for n, _ in model.named_parameters()}
    missing = expected - loaded
    if config.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"checkpoint {config.path} lacks weights for: {sorted(missing)[:8]}")
    return model.eval()
