"""The comparison sweep: for each system, start it, warm it up, run every workload at every
request rate with the load generator, and stop it. Raw runs and a results.json are written as it
goes, so a report can be rendered (again) from disk.

With rounds > 1 the sweep is interleaved instead: every system is started and kept up, and each
point runs `rounds` times, the systems taking turns (the order rotated each round) once the
machine has gone quiet. This VM's speed drifts over minutes (memory bandwidth, neighbours), so
one system's whole sweep after another's compares two machine states as much as two systems;
taking turns point by point puts the drift on both."""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from bench.compare.machine import ForeignCpu, machine, wait_quiet
from bench.compare.systems import (
    SYSTEMS,
    RunningSystem,
    ServeOptions,
    serve_settings,
    start_system,
)
from bench.compare.targets import offered
from bench.compare.vllm_peer import vllm_version
from bench.loadgen.arrivals import Burst, ClosedLoop, Poisson
from bench.loadgen.client import Target
from bench.loadgen.metrics import SLO
from bench.loadgen.prompts import PromptBuilder, load_tokenizer
from bench.loadgen.runner import RunConfig, run_load
from bench.loadgen.workload import Workload, preset


@dataclass(frozen=True)
class WorkloadPlan:
    name: str
    workload: Workload
    rates: tuple[float, ...] = ()  # a Poisson run per rate ...
    burst: int = 0  # ... or, when > 0, one burst of this many requests ...
    concurrency: int = 0  # ... or, when > 0, this many clients in a closed loop (1: batch 1)
    num_requests: int | None = None  # at most this many requests (closed loop: in all)
    duration_s: float = 30.0
    systems: tuple[str, ...] = ()  # empty: all systems of the sweep
    endpoint: str = "completions"
    about: str = ""
    # None: the plan's. A burst is a fixed amount of work, so it gets time to finish it.
    drain_timeout_s: float | None = None


@dataclass(frozen=True)
class SweepPlan:
    model_dir: str
    systems: tuple[str, ...]
    workloads: tuple[WorkloadPlan, ...]
    slo: SLO = field(default_factory=SLO)
    seed: int = 0
    drain_timeout_s: float = 60.0
    stop_ttft_s: float = 5.0  # a rate whose TTFT p99 exceeds this ends that system's sweep
    serve: ServeOptions = field(default_factory=ServeOptions)
    quick: bool = False
    name: str = "full"
    rounds: int = 1  # > 1: every system up at once, each point run this many times in turns


def full_plan(model_dir: str, systems: tuple[str, ...] = tuple(SYSTEMS)) -> SweepPlan:
    """SmolLM2-sized: about 30 minutes on 2 CPU cores (less where a system saturates early).
    60 s per rate: at the low rates that resolve the peer's knee, 30 s held too few requests
    for a p99 that means anything."""
    return SweepPlan(model_dir, systems, (
        WorkloadPlan("burst", preset("fixed", input_len=128, output_len=128), burst=32,
                     drain_timeout_s=300.0, about="32 requests of 128 in / 128 out sent at once"),
        WorkloadPlan("chat", preset("chat"), rates=(0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0),
                     duration_s=60.0,
                     about="chat-like long-tailed mix, prompt 64-512, output 32-256, Poisson"),
        WorkloadPlan("interference", preset("interference", long_prompt_len=2048), rates=(0.5,),
                     duration_s=60.0, systems=("splitserve-disagg", "splitserve-agg"),
                     about="80% steady (64 in / 192 out) + 20% long prompts (2048 in / 4 out)"),
    ), drain_timeout_s=45.0)


def peer_plan(model_dir: str, systems: tuple[str, ...] = tuple(SYSTEMS)) -> SweepPlan:
    """The side-by-side with vLLM (issue 23's rows), bounded: about 5 minutes per system on
    2 cores plus its start-up. Throughput under a burst, batch-1 inter-token latency through
    HTTP, and chat goodput at one rate every system should sustain and one that separates them."""
    return SweepPlan(model_dir, systems, (
        WorkloadPlan("burst", preset("fixed", input_len=128, output_len=128), burst=32,
                     drain_timeout_s=300.0, about="32 requests of 128 in / 128 out sent at once"),
        WorkloadPlan("batch1", preset("fixed", input_len=128, output_len=256), concurrency=1,
                     num_requests=8, duration_s=120.0, drain_timeout_s=60.0,
                     about="one request at a time (128 in / 256 out), 8 in a row: batch-1 ITL"),
        WorkloadPlan("long", preset("fixed", input_len=2048, output_len=8), concurrency=1,
                     num_requests=6, duration_s=120.0, drain_timeout_s=60.0,
                     about="one 2048-token prompt at a time (8 out), 6 in a row: long-prompt "
                           "TTFT"),
        WorkloadPlan("chat", preset("chat"), rates=(1.0, 3.0), duration_s=60.0,
                     about="chat-like long-tailed mix, prompt 64-512, output 32-256, Poisson"),
        WorkloadPlan("chat-sampled", preset("chat-sampled"), rates=(3.0,), duration_s=60.0,
                     systems=("splitserve-disagg", "splitserve-agg", "vllm"),
                     about="the chat mix sampled: 40% greedy, 40% temperature 0.8 top_p 0.95, "
                           "20% also presence/frequency penalties and top-2 logprobs"),
        WorkloadPlan("shared-prefix", replace(preset("chat"), prefix_groups=4, prefix_len=1024),
                     rates=(3.0,), duration_s=60.0,
                     about="the chat mix behind one of 4 shared prefixes of 1,024 tokens (system "
                           "prompts, a document asked about): each prefill is mostly a cache "
                           "hit once its prefix was seen, Poisson"),
    ), drain_timeout_s=45.0, name="peer")


PLANS = {"full": full_plan, "peer": peer_plan}


def quick_plan(model_dir: str, systems: tuple[str, ...] = tuple(SYSTEMS)) -> SweepPlan:
    """A tiny random model (512 positions): a few minutes in all."""
    return SweepPlan(model_dir, systems, (
        WorkloadPlan("burst", preset("fixed", input_len=64, output_len=64), burst=16,
                     drain_timeout_s=120.0, about="16 requests of 64 in / 64 out sent at once"),
        WorkloadPlan("chat", preset("chat", input_range=(32, 256), output_range=(16, 128)),
                     rates=(2.0, 8.0), duration_s=8.0,
                     about="chat-like long-tailed mix, prompt 32-256, output 16-128, Poisson"),
        WorkloadPlan("interference", preset("interference", long_prompt_len=400), rates=(4.0,),
                     duration_s=8.0, systems=("splitserve-disagg", "splitserve-agg"),
                     about="80% steady (64 in / 192 out) + 20% long prompts (400 in / 4 out)"),
    ), drain_timeout_s=30.0, quick=True, name="quick")


def _warm_up(running: RunningSystem, builder: PromptBuilder) -> None:
    """A few short requests first: one-time costs (lazy init, first allocations) stay out of
    the measurements."""
    config = RunConfig(Target(running.url, running.model_name, builder.endpoint,
                              running.spec.flavor),
                       preset("fixed", input_len=32, output_len=8), Burst(4), duration_s=1.0,
                       seed=12345, drain_timeout_s=120.0, progress=False)
    result = asyncio.run(run_load(config, builder))
    if result.summary.completed == 0:
        first = result.records[0]
        raise RuntimeError(f"{running.spec.name} failed its warm-up: {first.status} {first.error}")


def run_sweep(plan: SweepPlan, out_dir: Path, progress: bool = True,
              append: bool = False) -> dict:
    """Runs the plan; returns (and keeps rewriting) out_dir/results.json. With `append`, the
    systems of an earlier results.json there that this plan does not run are kept (to re-run one
    system); the plan must be the same one."""
    raw_dir = out_dir / "raw"
    raw_dir.mkdir(parents=True, exist_ok=True)
    results = {"plan": _describe(plan), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
               "machine": machine(), "systems": {}, "points": []}
    if append and (out_dir / "results.json").exists():
        earlier = json.loads((out_dir / "results.json").read_text())
        kept = [s for s in earlier["systems"] if s not in plan.systems]
        results["systems"] = {s: earlier["systems"][s] for s in kept}
        results["points"] = [p for p in earlier["points"] if p["system"] in kept]
        results["plan"]["systems"] = kept + list(plan.systems)
        results["started"] = earlier["started"]
        results["command"] = earlier.get("command", "")
    for stale in raw_dir.glob("*.json"):  # earlier runs of the systems about to run
        if not any(stale.name.startswith(s + "_") for s in results["systems"]):
            stale.unlink()
    tokenizer = load_tokenizer(plan.model_dir)
    builders = {e: PromptBuilder(tokenizer, endpoint=e, seed=plan.seed)
                for e in {w.endpoint for w in plan.workloads}}

    def save() -> None:
        (out_dir / "results.json").write_text(json.dumps(results, indent=1))

    if plan.rounds > 1:
        _interleaved(plan, out_dir, results, builders, progress, save)
    else:
        _one_after_another(plan, out_dir, results, builders, progress, save)
    results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    save()
    return results


def _start(plan: SweepPlan, name: str, out_dir: Path, results: dict, builders: dict,
           save) -> RunningSystem | None:
    """Starts and warms up one system; None (its error recorded) if it did not start."""
    spec = SYSTEMS[name]
    # Others may share this machine: the load average before each system says how quiet it was.
    info = results["systems"][name] = {"label": spec.label, "flavor": spec.flavor,
                                       "loadavg_1m_at_start": round(os.getloadavg()[0], 2)}
    t0 = time.monotonic()
    try:
        running = start_system(spec, plan.model_dir, out_dir / "logs", plan.serve)
    except RuntimeError as exc:
        info["error"] = f"did not start: {exc}"
        save()
        return None
    info.update(command=" ".join(running.command), startup_s=round(time.monotonic() - t0, 1))
    if spec.name == "vllm":
        info["version"] = vllm_version()
    try:
        _warm_up(running, builders.get("completions") or next(iter(builders.values())))
    except RuntimeError as exc:
        _stop(running, info, out_dir, str(exc))
        save()
        return None
    return running


def _stop(running: RunningSystem, info: dict, out_dir: Path, error: str | None = None) -> None:
    if error is not None:
        info["error"] = error
    running.stop()
    info["log"] = str(running.log_path.relative_to(out_dir))


def _one_after_another(plan: SweepPlan, out_dir: Path, results: dict, builders: dict,
                       progress: bool, save) -> None:
    raw_dir = out_dir / "raw"
    for name in plan.systems:
        running = _start(plan, name, out_dir, results, builders, save)
        if running is None:
            continue
        error = None
        try:
            for wp in plan.workloads:
                if wp.systems and name not in wp.systems:
                    continue
                rates = wp.rates or (None,)
                for i, rate in enumerate(rates):
                    point = _run_point(plan, wp, running, builders[wp.endpoint], rate, raw_dir,
                                       progress)
                    results["points"].append(point)
                    print(point_line(point), flush=True)
                    if rate is not None and _saturated_point(point, plan):
                        if i + 1 < len(rates):
                            point["note"] = "saturated: higher rates skipped"
                        save()
                        break
                    save()
        except RuntimeError as exc:
            error = str(exc)
        finally:
            _stop(running, results["systems"][name], out_dir, error)
        save()


def _interleaved(plan: SweepPlan, out_dir: Path, results: dict, builders: dict,
                 progress: bool, save) -> None:
    """Every system up at once; each point `plan.rounds` times, the systems in turn (round r
    starts with the r-th), each run once the machine is quiet (an idle system's own background
    work, such as splitserve's KV prefault after a burst, done). A system whose point fails is
    stopped and left out of the rest; one that saturates at a rate skips the higher rates."""
    raw_dir = out_dir / "raw"
    running: dict[str, RunningSystem] = {}
    try:
        for name in plan.systems:
            started = _start(plan, name, out_dir, results, builders, save)
            if started is not None:
                running[name] = started
        for wp in plan.workloads:
            names = [n for n in plan.systems if not wp.systems or n in wp.systems]
            saturated: set[str] = set()
            for rate in wp.rates or (None,):
                now_saturated: set[str] = set()
                for r in range(plan.rounds):
                    for name in names[r % len(names):] + names[:r % len(names)]:
                        if name not in running or name in saturated:
                            continue
                        waited = wait_quiet()
                        try:
                            point = _run_point(plan, wp, running[name], builders[wp.endpoint],
                                               rate, raw_dir, progress, round_=r + 1)
                        except RuntimeError as exc:
                            _stop(running.pop(name), results["systems"][name], out_dir, str(exc))
                            save()
                            continue
                        point["cpu"]["quiet_wait_s"] = round(waited, 1)
                        results["points"].append(point)
                        print(point_line(point), flush=True)
                        if rate is not None and _saturated_point(point, plan):
                            now_saturated.add(name)
                        save()
                for name in now_saturated:
                    for p in results["points"]:
                        if (p["system"], p["workload"], p["rate"]) == (name, wp.name, rate):
                            p["note"] = "saturated: higher rates skipped"
                saturated |= now_saturated
    finally:
        for name, r in running.items():
            _stop(r, results["systems"][name], out_dir)
        save()


def point_line(point: dict) -> str:
    """One line per point as it ends; refusals (429/503, admission's answer to overload) are
    counted apart from failures, so a sweep under the shipped defaults shows both."""
    s = point["summary"]
    refused = s["rejected_429"] + s["rejected_503"]
    other = s["errors"] + s["timeouts"] + sum(s["http_errors"].values())
    ttft = s["ttft_s"]["p99"]
    at = offered(point)
    return (f"{point['system']} {point['workload']} @ {at}: {s['completed']} / {s['requests']} "
            f"served, {refused} refused (429: {s['rejected_429']}, 503: {s['rejected_503']}), "
            f"{other} failed; TTFT p99 {'-' if ttft is None else f'{ttft * 1e3:.0f} ms'}, "
            f"{s['output_throughput']:.1f} out tok/s")


def _saturated_point(point: dict, plan: SweepPlan) -> bool:
    s = point["summary"]
    ttft = s["ttft_s"]["p99"]
    return (s["timeouts"] > 0 or s["completed"] < s["requests"] / 2 or ttft is None
            or ttft > plan.stop_ttft_s)


def point_seed(plan: SweepPlan, wp: WorkloadPlan, rate: float | None, round_: int | None) -> int:
    """The load generator's seed for one point of one round: the systems of a round get the
    same prompts, and no point finds another's in a prefix cache. (One seed per round made
    each workload draw the prompts of the one before it: batch 1's eight prompts were the
    burst's first eight, a prefix-cache hit wherever the burst had been served, 35 against
    100 ms to a first token on the AMD host; and a chat rate's prompts were the lower rate's.)"""
    index = plan.workloads.index(wp) * 50 + (wp.rates.index(rate) if rate in wp.rates else 0)
    if index >= 1000 or len(wp.rates) > 50:
        raise ValueError("a plan of more than 20 workloads or 50 rates would reuse seeds")
    return plan.seed + 1000 * ((round_ or 1) - 1) + index


def _run_point(plan: SweepPlan, wp: WorkloadPlan, running: RunningSystem, builder, rate,
               raw_dir: Path, progress: bool, round_: int | None = None) -> dict:
    arrivals = (Burst(wp.burst) if wp.burst else ClosedLoop(wp.concurrency) if wp.concurrency
                else Poisson(rate))
    target = Target(running.url, running.model_name, wp.endpoint, running.spec.flavor)
    drain = plan.drain_timeout_s if wp.drain_timeout_s is None else wp.drain_timeout_s
    config = RunConfig(target, wp.workload, arrivals, wp.duration_s,
                       seed=point_seed(plan, wp, rate, round_),
                       num_requests=wp.num_requests, slo=plan.slo, drain_timeout_s=drain,
                       progress=progress)
    load_start = round(os.getloadavg()[0], 2)
    foreign = ForeignCpu(running.process.pid)
    result = asyncio.run(run_load(config, builder))
    cpu = {"loadavg_1m_start": load_start, **foreign.stop()}
    kind = "burst" if wp.burst else f"c{wp.concurrency}" if wp.concurrency else rate
    suffix = "" if round_ is None else f"_r{round_}"
    raw = raw_dir / f"{running.spec.name}_{wp.name}_{kind}{suffix}.json"
    raw.write_text(json.dumps(result.to_json()))
    return {"system": running.spec.name, "workload": wp.name, "rate": rate,
            **({} if round_ is None else {"round": round_}),
            "concurrency": wp.concurrency or None, "summary": result.summary.to_json(),
            "by_class": {k: v.to_json() for k, v in result.by_class.items()},
            "send_lag_s": asdict(result.send_lag_s), "config": config.describe(), "cpu": cpu,
            "raw": str(raw.relative_to(raw_dir.parent))}


def _describe(plan: SweepPlan) -> dict:
    return {"model_dir": plan.model_dir, "systems": list(plan.systems), "quick": plan.quick,
            "seed": plan.seed, "slo": asdict(plan.slo), "drain_timeout_s": plan.drain_timeout_s,
            "stop_ttft_s": plan.stop_ttft_s, "serve": asdict(plan.serve), "rounds": plan.rounds,
            "name": plan.name, "settings": serve_settings(plan.serve, plan.systems).to_json(),
            "workloads": [{"name": w.name, "about": w.about, "rates": list(w.rates),
                           "burst": w.burst, "concurrency": w.concurrency,
                           "num_requests": w.num_requests, "duration_s": w.duration_s,
                           "drain_timeout_s": w.drain_timeout_s or plan.drain_timeout_s,
                           "systems": list(w.systems) or list(plan.systems),
                           "workload": w.workload.describe(), "endpoint": w.endpoint}
                          for w in plan.workloads]}
