"""Fixtures of the engine tests beyond the shared ones in tests/conftest.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A draft model for tiny_llama_dir (speculative decoding): the same tokenizer, other
    random weights (seed 1). Treat as read-only."""
    from splitserve_cli.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-draft"), arch="llama", seed=1)


@pytest.fixture(scope="module")
def one_torch_thread():
    """For tests of thousands of tiny tensor ops: on a loaded two-core machine a second
    intra-op thread makes each of them tens of times slower. Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
