"""--attention-backend on a worker: parsed, validated with a clear error, carried into the
engine's configuration (kernels/attention.py uses_triton reads the same three names)."""

from __future__ import annotations

import argparse

import pytest

from services.common.worker_cli import add_worker_arguments, worker_config_from_args
from services.common.worker_config import WorkerConfig


@pytest.fixture
def parse(tiny_llama_dir):
    def parse(*argv: str) -> WorkerConfig:
        parser = argparse.ArgumentParser()
        add_worker_arguments(parser, role="decode")
        args = parser.parse_args(["--model", str(tiny_llama_dir), *argv])
        return worker_config_from_args(args, "decode")

    return parse


def test_attention_backend_defaults_to_auto(parse):
    assert parse().engine_config().attention_backend == "auto"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_attention_backend_flag_reaches_the_engine_config(parse, backend):
    assert parse("--attention-backend", backend).engine_config().attention_backend == backend


def test_attention_backend_env(parse, monkeypatch):
    monkeypatch.setenv("SPLITSERVE_ATTENTION_BACKEND", "torch")
    assert parse().attention_backend == "torch"


def test_unknown_attention_backend_is_refused_clearly(parse, tiny_llama_dir, capsys):
    with pytest.raises(SystemExit):
        parse("--attention-backend", "flash")
    assert "invalid choice: 'flash'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--attention-backend 'flash' is not one of auto"):
        WorkerConfig(role="decode", model=str(tiny_llama_dir), attention_backend="flash")


def test_an_engine_asked_for_triton_on_cpu_refuses_to_start(tiny_llama_dir, monkeypatch):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="attention backend triton needs a CUDA device"):
        LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu",
                               num_kv_blocks=16, attention_backend="triton"))


def test_the_engine_passes_its_backend_to_every_step(tiny_llama_dir):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu",
                                    num_kv_blocks=16, attention_backend="torch"))
    seen = []
    forward = engine.runner.model.forward

    def record(input_ids, positions, kv_caches, meta):
        seen.append(meta.attention_backend)
        return forward(input_ids, positions, kv_caches, meta)

    engine.runner.model.forward = record
    engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert seen and set(seen) == {"torch"}
