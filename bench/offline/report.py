"""The engine benchmark's report: each system's medians, the ratios splitserve / peer (with the
issue's target where it has one), the read-bandwidth floor of batch-1 decode, and the settings of
every system. Works on the JSON alone, so a saved report prints as it did."""

from __future__ import annotations

from bench.offline.floor import floor_ms
from bench.run_settings import describe

PEERS = ("vllm", "transformers")
LABELS = {"splitserve": "splitserve LLMEngine", "vllm": "vLLM LLM.generate",
          "transformers": "transformers generate"}
# The issue's targets for a ratio splitserve / vLLM (#23): prefill on 2048-token prompts.
TARGETS = {("prefill", "vllm"): 1.5}


def ratios(systems: dict, weight_bytes: int) -> dict:
    """splitserve / peer for output tok/s (greedy, sampled) and prefill tok/s (higher: splitserve
    faster); for decode ms/token, splitserve ms / peer ms (lower: splitserve faster); and each
    system's decode step over its own read-bandwidth floor."""
    ours = systems["splitserve"]["summary"]
    out: dict = {}
    for peer in PEERS:
        if peer not in systems:
            continue
        theirs, row = systems[peer]["summary"], {}
        for phase, key in (("greedy", "output_tok_s"), ("sampled", "output_tok_s"), ("prefill", "prompt_tok_s")):
            if phase in ours and phase in theirs:
                row[phase] = ours[phase][key] / theirs[phase][key]
        if "decode" in ours and "decode" in theirs:
            row["decode_ms"] = ours["decode"]["ms"] / theirs["decode"]["ms"]
        out[peer] = row
    out["decode_vs_read_floor"] = {
        name: s["summary"]["decode"]["ms"] / floor_ms(weight_bytes, s["summary"]["decode"]["read_gbs"])
        for name, s in systems.items() if "decode" in s["summary"]}
    return out


def _target(phase: str, peer: str, value: float) -> str:
    target = TARGETS.get((phase, peer))
    if target is None:
        return ""
    return f" (target >= {target:g}x: {'met' if value >= target else 'missed'})"


def lines(report: dict) -> list[str]:
    systems, w = report["systems"], report["workload"]
    wb = report["weight_bytes"]
    out = [f"offline engine benchmark, {report['config']['threads']} threads, model {report['config']['model']}",
           f"  greedy/sampled runs: {w['requests']} requests each, prompts {w['prompt_len']}, outputs "
           f"{w['output_len']} (EOS ignored); prefill runs: {w['long_prompts']} x {w['long_prompt_len']} "
           f"tokens, 1 output; {w['repeats']} repetitions, fresh prompts each (cold prefix cache)",
           "", f"  {'system':<24} {'greedy tok/s':>13} {'sampled tok/s':>14} {'prefill tok/s':>14} "
           f"{'b1 ms/tok':>10} {'x floor':>8} {'load':>5}"]
    for name, s in systems.items():
        sm = s["summary"]

        def cell(phase, key, width, fmt=".1f", sm=sm):
            return f"{sm[phase][key]:>{width}{fmt}}" if phase in sm else f"{'-':>{width}}"

        floor = (f"{sm['decode']['ms'] / floor_ms(wb, sm['decode']['read_gbs']):>7.2f}x"
                 if "decode" in sm else f"{'-':>8}")
        loads = [r["load_average"] for rs in s["runs"].values() for r in rs]
        out.append(f"  {LABELS[name]:<24} {cell('greedy', 'output_tok_s', 13)} {cell('sampled', 'output_tok_s', 14)} "
                   f"{cell('prefill', 'prompt_tok_s', 14, '.0f')} {cell('decode', 'ms', 10, '.2f')} {floor} "
                   f"{sum(loads) / len(loads):>5.1f}")
    out.append("")
    out.append(f"read-bandwidth floor of a batch-1 decode step ({wb / 1e6:.0f} MB of weights / bytes-read "
               "bandwidth of a 512 MB sum, sampled before and after every timed run):")
    for name, s in systems.items():
        d = s["summary"].get("decode")
        if d:
            samples = ", ".join(f"{g:.0f}" for g in d["read_gbs_samples"])
            out.append(f"  around {name}'s decode runs: {d['read_gbs']:.1f} GB/s -> floor "
                       f"{floor_ms(wb, d['read_gbs']):.2f} ms (samples {samples} GB/s); all of {name}'s "
                       f"runs: {s['summary']['read_gbs_range'][0]:.0f}-{s['summary']['read_gbs_range'][1]:.0f} GB/s")
    r = report["ratios"]
    for peer in PEERS:
        if peer in r:
            row = r[peer]
            parts = [f"{phase} {row[phase]:.2f}x{_target(phase, peer, row[phase])}"
                     for phase in ("greedy", "sampled", "prefill") if phase in row]
            if "decode_ms" in row:
                parts.append(f"batch-1 ms/token {row['decode_ms']:.2f}x theirs")
            out.append(f"splitserve / {LABELS[peer]}: " + "; ".join(parts))
    out.append("")
    out.append("configuration:")
    for name, s in systems.items():
        out.append(f"  {name}: " + ", ".join(f"{k}={v}" for k, v in s["config"].items()))
    out += describe(report["settings"])
    return out
