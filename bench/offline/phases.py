"""The loop every system's timed runs go through, so the method is one: the read bandwidth
sampled before and after each run, the output-token count checked, and a run that found prompt
tokens in the prefix cache refused (every repetition must start cold)."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Protocol

from bench.offline.floor import read_bandwidth_gbs
from bench.offline.workload import Workload

PHASES = ("decode", "greedy", "sampled", "prefill")


class WarmCacheError(RuntimeError):
    """A timed run reused KV from the prefix cache: its figure would not be a cold one."""


class Runner(Protocol):
    def run(self, work: Workload) -> dict:
        """Run every request of work at once; return seconds (wall, the generation only),
        cpu_seconds (or None where the work runs in other processes), output_tokens and
        cached_tokens (prompt tokens served from the prefix cache; None if unknown)."""


def timed_run(runner: Runner, work: Workload, sample: Callable[[], float] = read_bandwidth_gbs) -> dict:
    before, load = sample(), os.getloadavg()[0]
    result = runner.run(work)
    after = sample()
    if result["output_tokens"] != work.num_output_tokens:
        raise RuntimeError(f"{work.name}: {result['output_tokens']} output tokens, "
                           f"expected {work.num_output_tokens}")
    if result.get("cached_tokens"):
        raise WarmCacheError(f"{work.name}: {result['cached_tokens']} of {work.num_prompt_tokens} "
                             "prompt tokens came from the prefix cache; a repetition must start cold")
    return {**result, "prompt_tokens": work.num_prompt_tokens, "expected_output_tokens": work.num_output_tokens,
            "read_gbs_before": before, "read_gbs_after": after,
            "load_average": (load + os.getloadavg()[0]) / 2}


def run_phases(runner: Runner, plan: dict[str, list[Workload]], phases=PHASES,
               progress: Callable[[str], None] = print,
               sample: Callable[[], float] = read_bandwidth_gbs) -> dict[str, list[dict]]:
    """The warm-up runs (untimed, unchecked), then each phase's runs in order."""
    for work in plan["warm-up"]:
        runner.run(work)
    out: dict[str, list[dict]] = {}
    for phase in phases:
        out[phase] = []
        for i, work in enumerate(plan[phase]):
            start = time.perf_counter()
            out[phase].append(timed_run(runner, work, sample))
            progress(f"  {phase} {i + 1}/{len(plan[phase])}: {out[phase][-1]['seconds']:.2f}s "
                     f"(with floor samples {time.perf_counter() - start:.1f}s)")
    return out


def summarize(runs: dict[str, list[dict]], decode_tokens: int) -> dict:
    """Medians over the repetitions: output tok/s (greedy, sampled), prompt tok/s (prefill),
    ms per batch-1 decode step (1+n-token run minus 1-token run, over n), read bandwidth."""
    summary: dict = {}
    for phase in ("greedy", "sampled"):
        if runs.get(phase):
            rates = [r["output_tokens"] / r["seconds"] for r in runs[phase]]
            cpu = [r["output_tokens"] / r["cpu_seconds"] for r in runs[phase] if r.get("cpu_seconds")]
            summary[phase] = {"output_tok_s": statistics.median(rates), "output_tok_s_runs": rates,
                              "output_tok_cpu_s": statistics.median(cpu) if cpu else None}
    if runs.get("prefill"):
        rates = [r["prompt_tokens"] / r["seconds"] for r in runs["prefill"]]
        summary["prefill"] = {"prompt_tok_s": statistics.median(rates), "prompt_tok_s_runs": rates}
    if runs.get("decode"):
        pairs = list(zip(runs["decode"][::2], runs["decode"][1::2], strict=True))
        steps = [(n["seconds"] - one["seconds"]) / decode_tokens * 1e3 for one, n in pairs]
        samples = [s for r in runs["decode"] for s in (r["read_gbs_before"], r["read_gbs_after"])]
        summary["decode"] = {"ms": statistics.median(steps), "ms_runs": steps,
                             "read_gbs": statistics.median(samples), "read_gbs_samples": samples}
    every = [s for rs in runs.values() for r in rs for s in (r["read_gbs_before"], r["read_gbs_after"])]
    summary["read_gbs_range"] = [min(every), max(every)] if every else None
    return summary
