"""bench/engine_plot.py draws the engine benchmark's figure from its JSON report."""

from __future__ import annotations

import json

from bench import engine_plot


def _summary(greedy: float, prefill: float, decode_ms: float, sampled: bool = True) -> dict:
    summary = {"greedy": {"output_tok_s": greedy}, "prefill": {"prompt_tok_s": prefill},
               "decode": {"ms": decode_ms, "read_gbs": 40.0}}
    if sampled:
        summary["sampled"] = {"output_tok_s": greedy * 0.9}
    return {"summary": summary}


def _report(peers: tuple[str, ...]) -> dict:
    systems = {"splitserve": _summary(560, 4000, 7.5)}
    if "vllm" in peers:
        systems["vllm"] = _summary(400, 3000, 9.0)
    if "transformers" in peers:
        systems["transformers"] = _summary(150, 2500, 21.0, sampled=False)
    return {"workload": {"requests": 64, "prompt_len": [128, 512], "long_prompts": 8, "long_prompt_len": 2048,
                         "decode_prompt_len": 128},
            "dtype": "bfloat16", "weight_bytes": 268_800_000, "systems": systems}


def test_the_figure_is_a_png_beside_the_json(tmp_path):
    for peers in ((), ("vllm",), ("vllm", "transformers")):
        path = tmp_path / f"run-{len(peers)}.json"
        path.write_text(json.dumps(_report(peers)))
        engine_plot.main([str(path)])
        png = path.with_suffix(".png")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
