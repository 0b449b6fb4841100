"""The figure of bench/engine_throughput.py: offline throughput of each system, and batch-1
decode milliseconds per token against the copy and read floors of the same run.

    .venv/bin/python -m bench.engine_plot [bench/results/engine_throughput.json]

writes the PNG beside the JSON (engine_throughput.py also calls it after a full run).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "engine_throughput.json"


def plot(report: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = report["results"]
    names = ["splitserve"]
    rates = [r["splitserve"]["tokens_per_s"]]
    if "hf_generate" in r:
        names += [f"transformers\ngenerate (b{r['hf_generate']['batch_size']})", "transformers\ngenerate_batch"]
        rates += [r["hf_generate"]["tokens_per_s"], r["hf_continuous_batching"]["tokens_per_s"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    left.bar(names, rates, color=["tab:blue"] + ["tab:gray"] * (len(names) - 1))
    for i, rate in enumerate(rates):
        left.text(i, rate, f"{rate:.0f}", ha="center", va="bottom")
    left.set_ylabel("output tokens / s")
    left.set_title(f"offline, {report['workload']['requests']} requests, {r['dtype']}")

    decode = {"splitserve": r["splitserve_decode_ms"]}
    if "hf_generate_decode_ms" in r:
        decode["transformers\ngenerate"] = r["hf_generate_decode_ms"]
    right.bar(list(decode), list(decode.values()), color=["tab:blue", "tab:gray"][: len(decode)])
    for i, ms in enumerate(decode.values()):
        right.text(i, ms, f"{ms:.1f}", ha="center", va="bottom")
    right.axhline(r["decode_floor_ms"], color="tab:red", linestyle="--",
                  label=f"copy floor {r['decode_floor_ms']:.1f} ms ({r['copy_bandwidth_gbs']:.0f} GB/s)")
    if "decode_read_floor_ms" in r:
        right.axhline(r["decode_read_floor_ms"], color="tab:orange", linestyle=":",
                      label=f"read floor {r['decode_read_floor_ms']:.1f} ms ({r['read_bandwidth_gbs']:.0f} GB/s)")
    right.set_ylabel("ms / token")
    right.set_title("batch-1 decode")
    right.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    path = Path((argv if argv is not None else sys.argv[1:] or [str(DEFAULT_JSON)])[0])
    print(f"wrote {plot(json.loads(path.read_text()), path.with_suffix('.png'))}")


if __name__ == "__main__":
    main()
