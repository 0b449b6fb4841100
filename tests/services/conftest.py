"""Fixtures for tests that run real worker processes."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine


@pytest.fixture(scope="session")
def reference_engine(tiny_llama_dir):
    """The engine alone, in this process: what every disaggregated run must reproduce."""
    return LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=512))
