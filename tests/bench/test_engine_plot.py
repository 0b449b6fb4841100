"""bench/engine_plot.py draws the engine benchmark's figure from its JSON report."""

from __future__ import annotations

import json

from bench import engine_plot


def _report(with_hf: bool) -> dict:
    results = {"dtype": "bfloat16", "splitserve": {"tokens_per_s": 500.0}, "splitserve_decode_ms": 7.5,
               "decode_floor_ms": 12.0, "copy_bandwidth_gbs": 22.0}
    if with_hf:
        results.update(hf_generate={"tokens_per_s": 150.0, "batch_size": 32},
                       hf_continuous_batching={"tokens_per_s": 35.0}, hf_generate_decode_ms=21.0,
                       decode_read_floor_ms=6.0, read_bandwidth_gbs=44.0)
    return {"workload": {"requests": 64}, "results": results}


def test_the_figure_is_a_png_beside_the_json(tmp_path):
    for with_hf in (True, False):
        path = tmp_path / f"run-{with_hf}.json"
        path.write_text(json.dumps(_report(with_hf)))
        engine_plot.main([str(path)])
        png = path.with_suffix(".png")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
