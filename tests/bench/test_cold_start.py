"""bench/cold_start.py on a tiny model: one real worker start, its phases read back and its
weight load set against a timed read of the same checkpoint."""

from __future__ import annotations

import pytest

from bench.cold_start import evict, median_row, one_start, timed_read
from engine.models.loader import safetensors_files
from services.common.startup import PHASES

pytestmark = pytest.mark.timeout(120)


def test_one_cold_start_reports_phases_and_the_read_floor(tiny_llama_dir):
    files = safetensors_files(tiny_llama_dir)
    evict(files)
    nbytes, seconds = timed_read(files)
    assert nbytes == sum(f.stat().st_size for f in files) and seconds > 0
    run = one_start("both", tiny_llama_dir, "evicted")
    assert list(run["phases"]) == list(PHASES)
    assert run["weight_bytes"] == nbytes
    assert run["startup_s"] == pytest.approx(sum(run["phases"].values()), abs=0.01)
    assert run["weight_load_over_floor"] == pytest.approx(run["phases"]["weight_load"] / run["read_s"])
    row = median_row([run])
    assert row["startup_s"] == run["startup_s"] and row["weight_load"] == run["phases"]["weight_load"]
