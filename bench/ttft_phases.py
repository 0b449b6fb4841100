"""Where the time to a first token goes in a `splitserve up` deployment as shipped: the
gateway's fair queue, the decode worker's KV reservation (which the gateway waits for before it
sends the prompt to the prefill worker), the prefill worker's queue and forward pass, the KV
send, and the decode worker's first step. Starts `splitserve up` with the per-process trace
file (SPLITSERVE_TRACE_FILE), drives it with `python -m bench.loadgen`, stops it, and prints
the percentiles of each phase over the requests, from their spans, and the prefill steps that
took them (how a burst split into waves, and when each ran).

    python bench/ttft_phases.py                         # disaggregated, chat at 3 req/s, 60 s
    python bench/ttft_phases.py --rate 6 --duration 30 --workload chat --out /tmp/phases
    python bench/ttft_phases.py --loadgen-args "--workload fixed --input-len 2048 \
        --output-len 8 --arrival closed --concurrency 1 --num-requests 8"

Only the load generator's own settings change; every serving setting is the shipped default.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# (label, span whose duration it is); "reserve" is computed: see phases().
PHASES = (("gateway queue", "gateway.queue"), ("decode reservation", None),
          ("prefill queue", "prefill.queue"), ("prefill forward", "prefill.forward"),
          ("KV send", "prefill.kv_send"), ("decode: KV wait", "decode.kv_wait"),
          ("decode: first step", "decode.first_step"))


def spans_by_trace(trace_file: Path) -> dict[str, dict[str, dict]]:
    """A trace file's spans (SPLITSERVE_TRACE_FILE's JSON lines): trace id -> span name -> span."""
    traces: dict[str, dict] = collections.defaultdict(dict)
    for line in trace_file.read_text().splitlines():
        span = json.loads(line)
        traces[span["trace_id"]][span["name"]] = span
    return traces


def phases(trace_file: Path) -> dict[str, list[float]]:
    """Milliseconds per phase, one value per request that has the phase's span(s). The
    reservation: from the end of the gateway's queue (the request's start if it was never
    queued) to the start of the decode worker's wait for KV, which begins once it reserved."""
    traces = spans_by_trace(trace_file)
    out: dict[str, list[float]] = {label: [] for label, _ in PHASES}
    for spans in traces.values():
        if "gateway.request" not in spans:
            continue
        for label, name in PHASES:
            if name is not None and name in spans:
                out[label].append((spans[name]["end_ns"] - spans[name]["start_ns"]) / 1e6)
        if "decode.kv_wait" in spans and "prefill.queue" in spans:
            released = spans.get("gateway.queue", spans["gateway.request"])
            key = "end_ns" if "gateway.queue" in spans else "start_ns"
            out["decode reservation"].append(
                (spans["decode.kv_wait"]["start_ns"] - released[key]) / 1e6)
    return out


def prefill_waves(trace_file: Path, gap_ms: float = 10.0) -> list[tuple[int, float, float]]:
    """The prefill steps that started requests, as (requests, start ms, last end ms) from the
    arrival at the gateway of the first request that was prefilled: requests whose prefill forward began within
    `gap_ms` of the previous one's share a step. Shows a burst's waves: a first step that took
    only the earliest arrivals, or a wave that ran long (on one core, say)."""
    traces = spans_by_trace(trace_file)
    rows = sorted((spans["prefill.forward"]["start_ns"], spans["prefill.forward"]["end_ns"],
                   spans["gateway.request"]["start_ns"]) for spans in traces.values()
                  if "prefill.forward" in spans and "gateway.request" in spans)
    if not rows:
        return []
    origin = min(arrived for _, _, arrived in rows)
    waves: list[list[int]] = []  # [count, start_ns, last end_ns]
    for start, end, _ in rows:
        if waves and (start - waves[-1][1]) / 1e6 <= gap_ms:
            waves[-1][0] += 1
            waves[-1][2] = max(waves[-1][2], end)
        else:
            waves.append([1, start, end])
    return [(count, (start - origin) / 1e6, (end - origin) / 1e6)
            for count, start, end in waves]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def wait_ready(admin: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{admin}/ready", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit(f"splitserve up not ready after {timeout_s:.0f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", default="disagg", choices=("disagg", "agg"))
    parser.add_argument("--workload", default="chat")
    parser.add_argument("--rate", type=float, default=3.0)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=8310)
    parser.add_argument("--loadgen-args", default="",
                        help="more bench.loadgen flags for the measured run, e.g. '--workload "
                             "fixed --input-len 2048 --output-len 8 --arrival closed "
                             "--concurrency 1 --num-requests 8' (one long prompt at a time)")
    parser.add_argument("--out", help="folder for phases.json and the load generator's JSON")
    args = parser.parse_args()
    python = sys.executable
    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="ttft-phases-"))
    work.mkdir(parents=True, exist_ok=True)
    trace = work / "trace.jsonl"
    trace.unlink(missing_ok=True)
    url, admin = f"http://127.0.0.1:{args.port}", f"http://127.0.0.1:{args.port + 1}"
    env = {**os.environ, "SPLITSERVE_TRACE_FILE": str(trace)}
    print(f"starting splitserve up --mode {args.mode} (shipped settings, traced)...", flush=True)
    up = subprocess.Popen([python, "-m", "splitserve_cli.main", "up", "--mode", args.mode,
                           "--port", str(args.port), "--admin-port", str(args.port + 1)],
                          cwd=ROOT, env=env, stdout=(work / "up.log").open("w"),
                          stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_ready(admin, 300)
        loadgen = [python, "-m", "bench.loadgen", "--url", url, "--no-progress"]
        subprocess.run([*loadgen, "--workload", "fixed", "--input-len", "64", "--output-len", "8",
                        "--arrival", "closed", "--concurrency", "1", "--num-requests", "4"],
                       cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        trace.write_text("")  # the warm-up's spans are not measured
        print(f"{args.workload} at {args.rate:g} req/s for {args.duration:g} s...", flush=True)
        subprocess.run([*loadgen, "--workload", args.workload, "--rate", str(args.rate),
                        "--duration", str(args.duration), "--seed", str(args.seed),
                        "--out", str(work / "loadgen.json"), *shlex.split(args.loadgen_args)],
                       cwd=ROOT, check=True)
    finally:
        os.killpg(up.pid, signal.SIGINT)
        try:
            up.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
    measured = phases(trace)
    print(f"\n{'phase':<22}{'requests':>9}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'max ms':>9}")
    for label, values in measured.items():
        if values:
            print(f"{label:<22}{len(values):>9}" + "".join(
                f"{percentile(values, q):>9.0f}" for q in (0.5, 0.9, 0.99)) +
                f"{max(values):>9.0f}")
    waves = prefill_waves(trace)
    if waves:
        print("\nprefill steps (ms after the first request reached the gateway): " + ", ".join(
            f"{count} from {start:.0f} to {end:.0f}" for count, start, end in waves))
    (work / "phases.json").write_text(json.dumps(measured))
    print(f"\nwrote {work / 'phases.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
