"""The figure of bench/engine_throughput.py: output tok/s (greedy, sampled), prefill tok/s on long
prompts, and batch-1 decode ms/token against each system's read-bandwidth floor, from its JSON.

    .venv/bin/python -m bench.engine_plot [bench/results/engine_throughput.json]

writes the PNG beside the JSON (engine_throughput.py also calls it after each run).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.offline.floor import floor_ms

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "2026-12-01-offline" / "engine_throughput.json"
COLORS = {"splitserve": "tab:blue", "vllm": "tab:green", "transformers": "tab:gray"}


def _bars(ax, names, values, fmt):
    ax.bar(names, values, color=[COLORS.get(n, "tab:gray") for n in names])
    for i, v in enumerate(values):
        ax.text(i, v, format(v, fmt), ha="center", va="bottom", fontsize=8)


def plot(report: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems, w = report["systems"], report["workload"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    throughput, prefill, decode = axes
    width = 0.38
    for j, phase in enumerate(("greedy", "sampled")):
        names = [n for n, s in systems.items() if phase in s["summary"]]
        xs = [list(systems).index(n) + (j - 0.5) * width for n in names]
        values = [systems[n]["summary"][phase]["output_tok_s"] for n in names]
        throughput.bar(xs, values, width, color=[COLORS.get(n, "tab:gray") for n in names],
                       alpha=1.0 if phase == "greedy" else 0.55, label=phase)
        for x, v in zip(xs, values, strict=True):
            throughput.text(x, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
    throughput.set_xticks(range(len(systems)), list(systems))
    throughput.set_ylabel("output tokens / s")
    throughput.set_title(f"{w['requests']} requests, prompts {w['prompt_len'][0]}-{w['prompt_len'][1]}, "
                         f"{report['dtype']}", fontsize=9)
    throughput.legend(fontsize=8)

    names = [n for n, s in systems.items() if "prefill" in s["summary"]]
    _bars(prefill, names, [systems[n]["summary"]["prefill"]["prompt_tok_s"] for n in names], ".0f")
    prefill.set_ylabel("prompt tokens / s")
    prefill.set_title(f"prefill, {w['long_prompts']} x {w['long_prompt_len']}-token prompts", fontsize=9)

    names = [n for n, s in systems.items() if "decode" in s["summary"]]
    _bars(decode, names, [systems[n]["summary"]["decode"]["ms"] for n in names], ".1f")
    for i, n in enumerate(names):
        d = systems[n]["summary"]["decode"]
        floor = floor_ms(report["weight_bytes"], d["read_gbs"])
        decode.hlines(floor, i - 0.4, i + 0.4, color="tab:red", linestyle="--",
                      label="read-bandwidth floor" if i == 0 else None)
    decode.set_ylabel("ms / token")
    decode.set_title(f"batch-1 decode, prompt {w['decode_prompt_len']}", fontsize=9)
    if names:
        decode.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    path = Path((argv if argv is not None else sys.argv[1:] or [str(DEFAULT_JSON)])[0])
    print(f"wrote {plot(json.loads(path.read_text()), path.with_suffix('.png'))}")


if __name__ == "__main__":
    main()
