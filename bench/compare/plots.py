"""PNG plots of a workload's rate sweep, one line per system, and of an interleaved run's rounds
(matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
from matplotlib.ticker import FuncFormatter  # noqa: E402
from matplotlib.transforms import blended_transform_factory  # noqa: E402

from bench.compare.rounds import advantage, rounds_by_point, worse_middle  # noqa: E402
from bench.compare.targets import failed, points_of  # noqa: E402

# (file suffix, title, y label, value from a summary, log scale)
PANELS = (
    ("ttft_p99", "TTFT p99", "seconds", lambda s: s["ttft_s"]["p99"], True),
    ("itl_p99", "Inter-token latency p99", "seconds", lambda s: s["itl_s"]["p99"], True),
    ("throughput", "Output throughput", "tokens / s", lambda s: s["output_throughput"], False),
    ("goodput", "Goodput", "requests / s", lambda s: s["goodput"], False),
)


def plot_workload(results: dict, workload: str, out_dir: Path) -> list[Path]:
    """One PNG per panel; nothing when the workload was not swept over at least two rates."""
    systems = [s for s in results["systems"]
               if len([p for p in points_of(results, s, workload) if p["rate"] is not None]) >= 1]
    rates = {p["rate"] for p in results["points"] if p["workload"] == workload}
    if not systems or len(rates - {None}) < 2:
        return []
    slo = results["plan"]["slo"]
    paths = []
    for suffix, title, ylabel, value, log in PANELS:
        fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
        for system in systems:
            pts = [p for p in points_of(results, system, workload) if p["rate"] is not None]
            # A point that mostly timed out has latencies of its few finished requests only:
            # drawn as an x on the top edge of the latency panels, not as a (flattering) value.
            lost = [p for p in pts if log and failed(p)]
            pts = [p for p in pts if value(p["summary"]) is not None and not (log and failed(p))]
            line, = ax.plot([p["rate"] for p in pts], [value(p["summary"]) for p in pts],
                            marker="o", label=results["systems"][system]["label"])
            if lost:
                ax.scatter([p["rate"] for p in lost], [1.0] * len(lost), marker="x", s=60,
                           color=line.get_color(), clip_on=False,
                           transform=blended_transform_factory(ax.transData, ax.transAxes),
                           label=f"{results['systems'][system]['label']}: most requests timed out")
        if suffix == "ttft_p99":
            ax.axhline(slo["ttft_s"], color="grey", linestyle="--", linewidth=1,
                       label=f"target {slo['ttft_s']:g} s")
        if suffix == "goodput":
            lim = max(rates - {None})
            ax.plot([0, lim], [0, lim], color="grey", linestyle=":", linewidth=1,
                    label="offered rate")
        if log:
            ax.set_yscale("log")
        ax.set_xlabel("offered request rate (requests / s)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{workload}: {title}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{workload}_{suffix}.png"
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_rounds(results: dict, ref: str, ours: list[str], out_dir: Path) -> Path | None:
    """rounds.png: per point of an interleaved run, each of `ours` against `ref` in every round
    as dots (> 1: splitserve better; throughput ours over theirs, latency theirs over ours) and
    the median of the rounds as a bar. None when no round has both."""
    table = rounds_by_point(results)
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(table)), 4), dpi=100)
    width = 0.7 / max(1, len(ours))
    drawn = False
    for i, system in enumerate(ours):
        color = f"C{i}"
        for j, ((workload, _rate), by_round) in enumerate(table.items()):
            values = [advantage(workload, v.get(system), v.get(ref)) for v in by_round.values()]
            values = [v for v in values if v is not None]
            if not values:
                continue
            x = j - 0.35 + width * (i + 0.5)
            ax.scatter([x] * len(values), values, color=color, s=18, zorder=3,
                       label=results["systems"][system]["label"])
            median = worse_middle(values, lambda v: v)
            ax.plot([x - width / 3, x + width / 3], [median, median], color=color, linewidth=2.5)
            drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_yscale("log")
    times = FuncFormatter(lambda v, _: f"{v:g}x")
    ax.yaxis.set_major_formatter(times)
    ax.yaxis.set_minor_formatter(times)
    ax.tick_params(axis="y", which="minor", labelsize=7)
    ax.set_xticks(range(len(table)), [w if r is None else f"{w}\n@ {r:g}/s" for w, r in table],
                  fontsize=8)
    ax.set_ylabel(f"times better than {results['systems'][ref]['label']}")
    ax.set_title("Each round (dots) and the median of the rounds (bar); above 1: splitserve "
                 "better", fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    ax.legend(unique.values(), unique.keys(), fontsize=8)
    fig.tight_layout()
    path = out_dir / "rounds.png"
    fig.savefig(path)
    plt.close(fig)
    return path
