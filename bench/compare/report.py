"""report.md from a sweep's results.json: the headline targets, a table per workload, plots."""

from __future__ import annotations

import json
from pathlib import Path

from bench.compare.machine import machine
from bench.compare.plots import plot_rounds, plot_workload
from bench.compare.rounds import (
    ROUND_METRICS,
    TTFT_P99,
    median_rounds,
    rounds_by_point,
    worse_middle,
)
from bench.compare.targets import (
    MAX_REFUSED_SHARE,
    class_metric,
    max_sustainable_rate,
    offered,
    peak_goodput,
    points_of,
    ratio,
    refused,
)
from bench.run_settings import markdown

DISAGG, AGG = "splitserve-disagg", "splitserve-agg"
PEERS = ("vllm", "transformers-serve")  # the first that ran is the one the ratios compare with


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.0f}"


def _ms1(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def _num(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _x(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def _foreign(point: dict) -> str:
    """Share of the machine's CPU that went to other work during the point (older results: -)."""
    cpu = point.get("cpu")
    return "-" if cpu is None else f"{cpu['foreign_cpu_share']:.0%}"


def workload_table(results: dict, workload: str) -> list[str]:
    rows = ["| system | offered req/s | achieved req/s | out tok/s | TTFT p50 / p99 ms "
            "| TPOT p50 / p99 ms | ITL p99 ms | goodput req/s | ok / sent | 429 | 503 "
            "| other failures | CPU to others | note |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for system, info in results["systems"].items():
        for p in points_of(results, system, workload):
            s = p["summary"]
            shown = offered(p).removesuffix(" req/s")
            other = s["errors"] + s["timeouts"] + sum(s["http_errors"].values())
            tput = f"{s['output_throughput']:.1f}"
            if s.get("streamed_output_throughput", 0) > 1.01 * s["output_throughput"]:
                tput += f" ({s['streamed_output_throughput']:.1f} streamed)"
            rows.append(
                f"| {info['label']} | {shown} "
                f"| {s['request_throughput']:.2f} | {tput} "
                f"| {_ms(s['ttft_s']['p50'])} / {_ms(s['ttft_s']['p99'])} "
                f"| {_ms(s['tpot_s']['p50'])} / {_ms(s['tpot_s']['p99'])} "
                f"| {_ms(s['itl_s']['p99'])} | {s['goodput']:.2f} "
                f"| {s['completed']} / {s['requests']} | {s['rejected_429']} "
                f"| {s['rejected_503']} | {other} | {_foreign(p)} | {p.get('note', '')} |")
    return rows


def rounds_table(results: dict) -> list[str]:
    """Every round of an interleaved run: each point's figure per system and each splitserve
    system over the reference peer in that round, then the median of those ratios."""
    table = rounds_by_point(results)
    if not table:
        return []
    ref, ours = _round_systems(results)
    systems = [*ours, *([ref] if ref else [])]
    label = {s: results["systems"][s]["label"] for s in systems}
    lines = ["| point | figure | round | " + " | ".join(label[s] for s in systems)
             + "".join(f" | {label[s]} / {label[ref]}" for s in ours if ref) + " |",
             "|---" * (3 + len(systems) + (len(ours) if ref else 0)) + "|"]
    for (workload, rate), by_round in table.items():
        _, name, higher_better = ROUND_METRICS.get(workload, TTFT_P99)
        scale = 1.0 if higher_better else 1e3
        point = _point_name(workload, rate)
        per_ratio: dict[str, list[float]] = {s: [] for s in ours}
        for r, vals in by_round.items():
            cells = [_num(None if vals.get(s) is None else vals[s] * scale, 1) for s in systems]
            ratios = []
            for s in ours if ref else ():
                x = ratio(vals.get(s), vals.get(ref))
                if x is not None:
                    per_ratio[s].append(x)
                ratios.append(_x(x))
            lines.append(f"| {point} | {name} | {r} | " + " | ".join(cells)
                         + "".join(f" | {x}" for x in ratios) + " |")
        if ref and len(by_round) > 1:
            better = (lambda x: x) if higher_better else (lambda x: -x)
            meds = [_x(worse_middle(v, better) if v else None) for v in per_ratio.values()]
            lines.append(f"| {point} | {name} | median | " + " | ".join("" for _ in systems)
                         + "".join(f" | **{m}**" for m in meds) + " |")
    return lines


def _round_systems(results: dict) -> tuple[str | None, list[str]]:
    """(the reference peer, or None if it ran no round; the other systems that did), in the
    results' order."""
    ran = {p["system"] for p in results["points"] if "round" in p}
    peers = peers_of(results)
    ref = peers[0] if peers and peers[0] in ran else None
    return ref, [s for s in results["systems"] if s in ran and s not in peers]


def _point_name(workload: str, rate: float | None) -> str:
    return workload if rate is None else f"{workload} @ {rate:g} req/s"


def peers_of(results: dict) -> list[str]:
    """The peer systems of a sweep, in the order they ran; the first in PEERS is the reference."""
    ran = [s for s in results["systems"] if s not in (DISAGG, AGG)]
    return sorted(ran, key=lambda s: PEERS.index(s) if s in PEERS else len(PEERS))


def _row(label: str, values: dict[str, str], ratios: list[str]) -> str:
    return f"| {label} | " + " | ".join(values.values()) + " | " + " | ".join(ratios) + " |"


def headline(results: dict) -> list[str]:
    """One row per target: splitserve's two modes, every peer, and each mode over the reference
    peer (vLLM when it ran)."""
    slo = results["plan"]["slo"]
    peers = peers_of(results)
    modes = [s for s in (DISAGG, AGG) if s in results["systems"]]
    systems = (*modes, *peers)
    ref = peers[0] if peers else None
    labels = [results["systems"][s]["label"] for s in systems]
    ref_label = results["systems"][ref]["label"] if ref else "peer"
    short = {DISAGG: "disaggregated", AGG: "aggregated"}
    lines = ["| target | " + " | ".join(labels)
             + "".join(f" | {short[m]} / {ref_label}" for m in modes) + " |",
             "|---" * (len(systems) + len(modes) + 1) + "|"]

    def ratios(v: dict) -> list[str]:
        return [_x(ratio(v.get(m), v.get(ref))) for m in modes]

    if any(p["workload"] == "burst" for p in results["points"]):
        tput = {s: next((p["summary"]["output_throughput"] for p in points_of(results, s, "burst")),
                        None) for s in systems}
        lines.append(_row("burst output throughput (tok/s)",
                          {s: _num(v, 1) for s, v in tput.items()}, ratios(tput)))
    if any(p["workload"] == "batch1" for p in results["points"]):
        itl = {s: next((p["summary"]["itl_s"]["p50"] for p in points_of(results, s, "batch1")),
                       None) for s in systems}
        lines.append(_row("batch-1 ITL p50 through HTTP (ms; lower is better)",
                          {s: _ms1(v) for s, v in itl.items()}, ratios(itl)))
    if any(p["workload"] == "long" for p in results["points"]):
        ttft = {s: next((p["summary"]["ttft_s"]["p50"] for p in points_of(results, s, "long")),
                        None) for s in systems}
        lines.append(_row("2048-token prompt alone: TTFT p50 through HTTP (ms; lower is better)",
                          {s: _ms(v) for s, v in ttft.items()},
                          ratios(ttft)))
    chat_rates = sorted({p["rate"] for p in results["points"]
                         if p["workload"] == "chat" and p["rate"] is not None})
    for rate in chat_rates:
        at = {s: next((p for p in points_of(results, s, "chat") if p["rate"] == rate), None)
              for s in systems}
        good = {s: p["summary"]["goodput"] if p else None for s, p in at.items()}
        shown = {s: f"{p['summary']['goodput_fraction']:.0%} ({p['summary']['goodput']:.2f} req/s"
                    f", TTFT p99 {_ms(p['summary']['ttft_s']['p99'])} ms, TPOT p50 "
                    f"{_ms(p['summary']['tpot_s']['p50'])} ms)" if p else "-"
                 for s, p in at.items()}
        lines.append(_row(f"chat at {rate:g} req/s: share meeting TTFT <= {slo['ttft_s']:g} s and "
                          f"TPOT <= {slo['tpot_s'] * 1e3:g} ms (goodput)", shown, ratios(good)))
    if chat_rates:
        lines += _chat_bounds(results, systems, ratios)
    if any(p["workload"] in ("burst", "chat") for p in results["points"]):
        sent = {s: [(refused(p["summary"]), p["summary"]["requests"])
                    for w in ("burst", "chat") for p in points_of(results, s, w)] for s in systems}
        lines.append(_row("burst and chat requests refused (429 + 503) / sent, all points",
                          {s: f"{sum(r for r, _ in v)} / {sum(n for _, n in v)}" if v else "-"
                           for s, v in sent.items()}, [""] * len(modes)))
    if any(p["workload"] == "interference" for p in results["points"]):
        lines += ["", *_interference(results)]
    return lines


def _chat_bounds(results: dict, systems: tuple[str, ...], ratios) -> list[str]:
    """Peak goodput and the highest rate within the TTFT target, over the swept rates."""
    slo = results["plan"]["slo"]
    lines = []
    good = {s: peak_goodput(points_of(results, s, "chat")) for s in systems}
    shown = {s: f"{g:.2f} (at {r:g})" if r is not None else f"{g:.2f}" for s, (g, r) in good.items()}
    lines.append(_row(f"chat peak goodput, TTFT <= {slo['ttft_s']:g} s and TPOT <= "
                      f"{slo['tpot_s'] * 1e3:g} ms (req/s, at offered rate)", shown,
                      ratios({s: g for s, (g, _) in good.items()})))
    bounds = {s: max_sustainable_rate(points_of(results, s, "chat"), slo["ttft_s"])
              for s in systems}
    lines.append(_row(f"chat max sustainable rate (TTFT p99 <= {slo['ttft_s']:g} s, "
                      f"<= {MAX_REFUSED_SHARE:.0%} refused)",
                      {s: b.text() if b else "-" for s, b in bounds.items()},
                      ratios({s: b.value if b else None for s, b in bounds.items()})))
    return lines


def _interference(results: dict) -> list[str]:
    inter = {s: next(iter(points_of(results, s, "interference")), None) for s in (DISAGG, AGG)}
    itl = {s: class_metric(p, "steady", "itl_s", "p99") if p else None for s, p in inter.items()}
    lines = ["| interference (steady streams) | splitserve disaggregated "
             "| splitserve aggregated | aggregated / disaggregated |", "|---|---|---|---|",
             f"| ITL p99 ms | {_ms(itl[DISAGG])} | {_ms(itl[AGG])} | {_x(ratio(itl[AGG], itl[DISAGG]))} |"]
    for metric, label in (("tpot_s", "TPOT p99 ms"),):
        v = {s: class_metric(p, "steady", metric, "p99") if p else None for s, p in inter.items()}
        lines.append(f"| {label} | {_ms(v[DISAGG])} | {_ms(v[AGG])} | {_x(ratio(v[AGG], v[DISAGG]))} |")
    ttft = {s: class_metric(p, "long", "ttft_s", "p99") if p else None for s, p in inter.items()}
    lines.append(f"| long-prompt TTFT p99 ms | {_ms(ttft[DISAGG])} | {_ms(ttft[AGG])} "
                 f"| {_x(ratio(ttft[AGG], ttft[DISAGG]))} |")
    # Latencies cover finished requests only: say how many steady streams that is.
    done = {s: (p["by_class"]["steady"]["completed"], p["by_class"]["steady"]["requests"])
            if p and "steady" in p["by_class"] else None for s, p in inter.items()}
    lines.append("| steady streams finished (the latencies above cover these) | "
                 + " | ".join(f"{d[0]} / {d[1]}" if d else "-" for d in (done[DISAGG], done[AGG]))
                 + " | |")
    return lines


def render(results: dict, out_dir: Path) -> Path:
    every_round = results
    results = median_rounds(results)
    rounds = results["plan"].get("rounds", 1)
    plan, m = results["plan"], results.get("machine") or machine()
    command = results.get("command", "")
    peers = " and ".join(results["systems"][s]["label"] for s in peers_of(results)) or "peers"
    versions = "".join(f", {info['label']} {info['version']}"
                       for info in results["systems"].values() if info.get("version"))
    kind = "quick" if plan["quick"] else plan.get("name", "full")
    lines = [f"# splitserve vs {peers} ({kind} sweep)",
             "", f"Run {results['started']} to {results.get('finished', '(unfinished)')}; "
             f"model `{plan['model_dir']}`; {m['cores']} CPU cores ({m['cpu']}); "
             f"torch {m['torch']}, transformers {m['transformers']}{versions}; "
             f"commit {m['commit']}{_uncommitted(m)}.",
             ("Every system ran alone on this machine, one after another; the load generator "
              "shared its cores." if rounds <= 1 else
              f"Interleaved: every system was up at once, idle but for its turn; each point ran "
              f"{rounds} times, the systems taking turns (the order rotated each round, each "
              "turn once the machine had gone quiet); the load generator shared the cores. The "
              "tables show each point's median round (by the figure under Rounds); Rounds lists "
              "them all.")
             + " Output lengths were forced exactly (splitserve and vLLM: "
             "`ignore_eos`; transformers serve: `generation_config` with `eos_token_id: -1`); "
             "prompts were built "
             "to exact token counts with the model's tokenizer. Goodput counts requests with "
             f"TTFT <= {plan['slo']['ttft_s']:g} s and TPOT <= {plan['slo']['tpot_s'] * 1e3:g} ms.",
             *_setup(plan, m), ""]
    if plan["quick"]:
        lines += ["**Quick mode: a tiny random model and seconds-long runs. This checks that every "
                  "system starts, serves and is measured; its numbers are not a performance "
                  "result.**", ""]
    busy = {info["label"]: info["loadavg_1m_at_start"] for info in results["systems"].values()
            if info.get("loadavg_1m_at_start", 0) > m["cores"]}
    if busy:
        lines += ["**The machine was shared: 1-minute load average above its core count when "
                  + ", ".join(f"{k} started ({v:g})" for k, v in busy.items())
                  + ". Other work competed for the cores; expect noise.**", ""]
    if command:
        lines += [f"Command: `{command}`", ""]
    lines += ["## Settings", "", *_settings(plan), "", "## Targets", "", *headline(results), ""]
    if rounds > 1:
        lines += ["## Rounds", "", "Each splitserve system over the reference peer in the same "
                  "round (ratios: higher is better for tok/s, lower for ms), and the median of "
                  "those ratios (of an even count, the worse of the two middle ones).", "",
                  *rounds_table(every_round), ""]
        ref, ours = _round_systems(every_round)
        plotted = plot_rounds(every_round, ref, ours, out_dir) if ref else None
        if plotted is not None:
            lines += [f"![rounds]({plotted.name})", ""]
    notes = out_dir / "notes.md"  # written by hand: what the tables alone do not say
    if notes.exists():
        lines += ["## Notes", "", notes.read_text().strip(), ""]
    for info in results["systems"].values():
        if "error" in info:
            lines += [f"**{info['label']} failed:** `{info['error'].splitlines()[0]}` "
                      f"(log: `{info.get('log', '')}`)", ""]
    for w in plan["workloads"]:
        lines += [f"## Workload `{w['name']}`", "", f"{w['about']}. `{w['workload']}`; "
                  + (f"one burst of {w['burst']}." if w["burst"] else
                     f"{w['concurrency']} client(s) in a closed loop, "
                     f"{w.get('num_requests') or 'as many as fit in'} requests"
                     f" (at most {w['duration_s']:g} s)." if w.get("concurrency") else
                     f"Poisson arrivals for {w['duration_s']:g} s per rate."), "",
                  *workload_table(results, w["name"]), ""]
        if w["name"] == "interference":
            lines += _class_rows(results, "interference")
        for path in plot_workload(results, w["name"], out_dir):
            lines.append(f"![{path.stem}]({path.name})")
        lines.append("")
    lines += ["## Systems", ""]
    for info in results["systems"].values():
        lines.append(f"- {info['label']}: `{info.get('command', '-')}` "
                     f"(ready in {info.get('startup_s', '-')} s; load average at start "
                     f"{info.get('loadavg_1m_at_start', '-')}; log `{info.get('log', '-')}`)")
    lines += ["", "Raw per-request records: `raw/`; all summaries: `results.json`.", ""]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    return path


def _uncommitted(m: dict) -> str:
    changed = m.get("uncommitted") or []
    if not changed:
        return ""
    shown = ", ".join(f"`{p}`" for p in changed[:5]) + (", ..." if len(changed) > 5 else "")
    return (f" **plus uncommitted changes to {len(changed)} path(s) of the measured code when the "
            f"sweep started** ({shown})")


def _setup(plan: dict, m: dict) -> list[str]:
    """dtype and torch threads per process, and what 'CPU to others' means."""
    serve = plan.get("serve")
    if serve is None:  # results from before these were recorded
        return []
    threads = serve["peer_threads"] or m["cores"]
    prefill = max(1, m["cores"] // 2)
    return [f"dtype {serve['dtype']} for splitserve, {serve['peer_dtype'] or serve['dtype']} for "
            f"the peers. Torch threads: disaggregated {prefill} (prefill) + "
            f"{max(1, m['cores'] - prefill)} (decode), each borrowing the other's while it "
            "idles (the core share, from commit e5accc7; 'fixed halves': --no-core-share); "
            f"aggregated {m['cores']} (one worker); "
            f"each peer {threads} (vLLM's bound to cores, see Settings); the gateway and the "
            "load generator run no torch "
            "and share the same cores. 'CPU to others' is the share of the machine's CPU time "
            "during a point that went to neither the system under test nor the load generator "
            "(other jobs, hypervisor steal): 0% is a quiet machine."]


def _settings(plan: dict) -> list[str]:
    """The admission settings and every change from the shipped defaults, with the reasons."""
    settings = plan.get("settings")
    if settings is None:  # results from before these were recorded: admission was off then
        ttft = (plan.get("serve") or {}).get("gateway_ttft_target_s", 0.0)
        return [f"- splitserve gateway --ttft-target-s {ttft if ttft is not None else 'default'} "
                "(recorded before the sweep printed its settings)"]
    return markdown(settings)


def _class_rows(results: dict, workload: str) -> list[str]:
    rows = ["| system | class | TTFT p50 / p99 ms | TPOT p99 ms | ITL p50 / p99 ms | ok / sent |",
            "|---|---|---|---|---|---|"]
    for system, info in results["systems"].items():
        for p in points_of(results, system, workload):
            for cls, s in p["by_class"].items():
                rows.append(f"| {info['label']} | {cls} | {_ms(s['ttft_s']['p50'])} / "
                            f"{_ms(s['ttft_s']['p99'])} | {_ms(s['tpot_s']['p99'])} "
                            f"| {_ms(s['itl_s']['p50'])} / {_ms(s['itl_s']['p99'])} "
                            f"| {s['completed']} / {s['requests']} |")
    return rows + [""]


def render_from(out_dir: Path) -> Path:
    return render(json.loads((out_dir / "results.json").read_text()), out_dir)
