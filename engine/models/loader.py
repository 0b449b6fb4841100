"""Builds a model from a Hugging Face folder: config.json plus one or many safetensors files."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.distributed import get_tp
from engine.models.registry import resolve_model_class

# Seconds this process spent in load_model (a speculative draft adds its own): start-up timing.
_load_seconds = 0.0


def weight_load_seconds() -> float:
    """Wall time of every load_model call in this process so far."""
    return _load_seconds


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    return files


class CheckpointSlice:
    """A checkpoint matrix not read yet: `narrow` and `[a:b]` read only the rows or columns
    asked for, so a tensor-parallel rank reads its shard and never the whole matrix."""

    def __init__(self, handle) -> None:
        self._handle = handle  # a safetensors slice, valid while its file is open
        self.shape = torch.Size(handle.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._handle[tuple(index)]

    def __getitem__(self, rows: slice) -> torch.Tensor:
        return self._handle[rows]


def iterate_weights(path: Path, shard_reads: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """One tensor at a time, so loading never holds a second copy of the whole model. With
    `shard_reads`, matrices come as CheckpointSlice for the parameters' weight loaders to cut."""
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if shard_reads and len(f.get_slice(name).get_shape()) >= 2:
                    yield name, CheckpointSlice(f.get_slice(name))
                else:
                    yield name, f.get_tensor(name)


def load_model(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The parameters are made in `dtype` on `device` and filled from the checkpoint one tensor
    at a time: no float32 copy of the model is built first, so weight memory peaks at the
    model's size in `dtype` (plus one checkpoint tensor)."""
    global _load_seconds
    start = time.monotonic()
    try:
        return _build_and_fill(config, dtype, device)
    finally:
        _load_seconds += time.monotonic() - start


def _build_and_fill(config: ModelConfig, dtype: torch.dtype,
                    device: torch.device) -> torch.nn.Module:
    model_cls = resolve_model_class(config.architecture)
    with torch.device(device), _default_dtype(dtype):
        model = model_cls(config)
    loaded = model.load_weights(iterate_weights(Path(config.path), shard_reads=get_tp().size > 1))
    expected = {n for n, _ in model.named_parameters()}
    missing = expected - loaded
    if config.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"checkpoint {config.path} lacks weights for: {sorted(missing)[:8]}")
    return model.eval()


@contextmanager
def _default_dtype(dtype: torch.dtype):
    """Floating tensors made without a dtype are `dtype` inside (the layers' parameters); the
    layers that need float32 (rotary tables) ask for it."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
