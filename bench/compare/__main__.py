"""`python -m bench.compare`: start each system, sweep the workloads, write the report.

    python -m bench.compare --quick     # tiny random model, a few minutes (make bench)
    python -m bench.compare             # SmolLM2-135M, bf16: about 30 minutes on 2 cores
    python -m bench.compare --plan peer --systems splitserve-disagg,splitserve-agg,vllm
                                        # the side-by-side with vLLM (make peers): ~20 minutes
    python -m bench.compare --plan peer --systems splitserve-agg,vllm --rounds 3 \
        --workloads burst,long           # interleaved: the systems take turns, point by point
    python -m bench.compare --report-only bench/results/2026-11-29   # re-render a report
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from bench.compare.report import render, render_from
from bench.compare.sweep import PLANS, quick_plan, run_sweep
from bench.compare.systems import SYSTEMS, ServeOptions, serve_settings

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO / "models" / "smollm2-135m-instruct"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="tiny random model, short runs (a smoke test, not a measurement)")
    p.add_argument("--model", type=Path, help=f"model folder (default {DEFAULT_MODEL.name}; "
                   "--quick: a tiny random Llama)")
    p.add_argument("--plan", choices=tuple(PLANS), default="full",
                   help="which workloads: full (every workload, several rates) or peer (burst, "
                   "batch-1 ITL, chat at 1 and 3 req/s: the side-by-side with vLLM); "
                   "--quick has its own")
    p.add_argument("--systems", default="",
                   help=f"comma-separated subset of {', '.join(SYSTEMS)} (default: all of them "
                   "that are installed; vllm needs `make peers`)")
    p.add_argument("--workloads", help="comma-separated subset of the plan's workloads")
    p.add_argument("--rates", help="override the chat workload's rates, e.g. 0.5,1,2")
    p.add_argument("--duration", type=float, help="override seconds of arrivals per rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="",
                   help="every system's dtype (default: splitserve's shipped auto, bfloat16 where "
                   "this CPU multiplies it natively, else float32, and the same for the peer; "
                   "the tiny --quick model: float32)")
    p.add_argument("--peer-dtype", default="", help="transformers serve --dtype (default: --dtype)")
    p.add_argument("--peer-blocks", type=int, default=4096, help="transformers serve blocks")
    p.add_argument("--peer-threads", type=int, default=0,
                   help="OMP_NUM_THREADS for transformers serve (0: the machine's cores, the "
                   "total splitserve's workers get)")
    p.add_argument("--gateway-ttft-target-s", type=float, default=None,
                   help="splitserve gateway's early rejection by predicted TTFT (0: off; "
                   "default: the gateway's shipped default, so the sweep measures what ships)")
    p.add_argument("--rounds", type=int, default=1,
                   help="N > 1: start every system at once and run each point N times, the "
                   "systems taking turns (the order rotated each round, each turn once the "
                   "machine is quiet), so the VM's drift over minutes falls on every system "
                   "alike; tables show each point's median round, a Rounds section all of them")
    p.add_argument("--append", action="store_true",
                   help="keep the other systems' results already in --out (re-run some systems)")
    p.add_argument("--out", type=Path, help="results folder (default bench/results/<date>, "
                   "with a -quick suffix for --quick)")
    p.add_argument("--report-only", type=Path, metavar="DIR",
                   help="re-render DIR/report.md from DIR/results.json and exit")
    p.add_argument("--no-progress", action="store_true")
    return p


def default_dtype(quick: bool) -> tuple[str, str]:
    """(dtype, why): splitserve runs its shipped dtype ("auto"), except on the tiny --quick
    model, which runs float32 like the peer."""
    if quick:
        return "float32", "the tiny random --quick model (a smoke test); the peer runs the same"
    return "auto", ""


def shipped_dtype() -> str:
    """What `--dtype auto` resolves to on this CPU, for the peer to run the same arithmetic."""
    from engine.config import cpu_has_fast_bf16

    return "bfloat16" if cpu_has_fast_bf16() else "float32"


# vLLM's CPU attention has kernels for real head sizes only; the tiny model's is 8.
TINY_MODEL_UNSUPPORTED = {"vllm": "vLLM's CPU attention has no kernel for the tiny model's "
                                  "head_dim 8 (pass --model with a real model)"}


def choose_systems(asked: str, tiny_model: bool = False) -> tuple[str, ...]:
    """The systems named (each must be known and installed), or by default every installed one
    but the ablations (splitserve with a shipped default turned off: run only when named); a
    peer left out for want of its install, or because it cannot serve the tiny --quick model,
    is said so."""
    if not asked:
        chosen = []
        for name, spec in SYSTEMS.items():
            if spec.ablation:
                continue
            if not spec.installed():
                print(f"{name}: not installed, left out (`{spec.installed_by}` installs it)")
            elif tiny_model and name in TINY_MODEL_UNSUPPORTED:
                print(f"{name}: left out: {TINY_MODEL_UNSUPPORTED[name]}")
            else:
                chosen.append(name)
        return tuple(chosen)
    systems = tuple(s for s in asked.split(",") if s)
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise SystemExit(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    if tiny_model and (cannot := [s for s in systems if s in TINY_MODEL_UNSUPPORTED]):
        raise SystemExit("; ".join(TINY_MODEL_UNSUPPORTED[s] for s in cannot))
    absent = [SYSTEMS[s] for s in systems if not SYSTEMS[s].installed()]
    if absent:
        raise SystemExit("; ".join(f"{s.name} is not installed: `{s.installed_by}` installs it"
                                   for s in absent))
    return systems


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the sweep's finally blocks stop the system under test.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if args.report_only:
        print(render_from(args.report_only))
        return 0
    if args.rounds < 1:
        build_parser().error("--rounds must be at least 1")
    if args.rounds > 1 and args.append:
        build_parser().error("--append re-runs systems one after another; not with --rounds")
    systems = choose_systems(args.systems, tiny_model=args.quick and args.model is None)
    out = args.out or REPO / "bench" / "results" / (time.strftime("%Y-%m-%d")
                                                    + ("-quick" if args.quick else ""))
    out.mkdir(parents=True, exist_ok=True)
    scratch = None
    if args.quick and args.model is None:
        from splitserve_cli.tiny_model import build_tiny_model

        scratch = Path(tempfile.mkdtemp(prefix="splitserve-compare-"))
        model = build_tiny_model(scratch / "tiny-llama", arch="llama", seed=0)
    else:
        model = args.model or DEFAULT_MODEL
    plan = (quick_plan if args.quick else PLANS[args.plan])(str(model), systems)
    dtype, dtype_reason = (args.dtype, "--dtype given") if args.dtype else default_dtype(args.quick)
    serve = ServeOptions(
        dtype=dtype, dtype_reason=dtype_reason,
        peer_dtype=args.peer_dtype or (shipped_dtype() if dtype == "auto" else ""),
        cb_num_blocks=args.peer_blocks, peer_threads=args.peer_threads,
        gateway_ttft_target_s=args.gateway_ttft_target_s)
    plan = replace(plan, seed=args.seed, serve=serve, rounds=args.rounds)
    print(serve_settings(serve, systems).text(), flush=True)
    workloads = plan.workloads
    if args.workloads:
        wanted = set(args.workloads.split(","))
        workloads = tuple(w for w in workloads if w.name in wanted)
    if args.rates:
        rates = tuple(float(r) for r in args.rates.split(","))
        workloads = tuple(replace(w, rates=rates) if w.name == "chat" else w for w in workloads)
    if args.duration:
        workloads = tuple(replace(w, duration_s=args.duration) for w in workloads)
    plan = replace(plan, workloads=workloads)
    try:
        results = run_sweep(plan, out, progress=not args.no_progress, append=args.append)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    command = "python -m bench.compare " + " ".join(argv)
    results["command"] = (results.get("command", "") + " ; " if args.append else "") + command
    (out / "results.json").write_text(json.dumps(results, indent=1))
    report = render(results, out)
    print(f"wrote {report}")
    failed = [name for name, info in results["systems"].items() if "error" in info]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
