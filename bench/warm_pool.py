"""A worker from the warm pool against a cold one: seconds from the scale-up decision to the
first token that worker serves through a gateway, SmolLM2, shipped worker defaults.

    python -m bench.warm_pool                 # 3 of each, alternating
    python -m bench.warm_pool --runs 1

One gateway (routing through a real Redis registry) stays up; each run brings in one fresh
aggregated worker (`--role both`) and removes it afterwards:
- **warm**: the worker was started with `--standby` beforehand and stood by (loaded,
  profiled, ports open, not registered); the decision is `splitserve.common.standby.activate`.
- **cold**: the decision is the start of the worker process (`splitserve worker`), which then
  imports, loads, profiles and registers.
From the decision on, a client sends a 16-token streamed completion every 20 ms until one is
served; the figure is the time to that request's first token. The gateway's registry follow
interval (0.5 s, shipped) is part of both. Runs alternate, so both see the same machine state.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.routing import Process, start_redis
from services.common.registry import WORKER_KEY
from services.common.standby import activate, list_standby
from splitserve_cli.processes import free_port

REPO = Path(__file__).resolve().parent.parent
SMOLLM2 = REPO / "models" / "smollm2-135m-instruct"
POLL_S = 0.02
SETTINGS = ("worker: --role both --num-threads 2, otherwise shipped defaults; gateway: "
            "--redis-url, otherwise shipped defaults (registry follow 0.5 s)")


def worker_argv(model: Path, redis_url: str, standby: bool) -> list[str]:
    return [sys.executable, "-m", "splitserve_cli.main", "worker", "--role", "both",
            "--model", str(model), "--port", str(free_port()), "--num-threads", "2",
            "--metrics-port", "-1", "--redis-url", redis_url, "--heartbeat-ttl-s", "2",
            "--log-format", "text", *(("--standby",) if standby else ())]


def first_token_served(url: str, model_name: str, deadline_s: float) -> float:
    """Send small streamed requests until one is served; monotonic time of its first token."""
    body = {"model": model_name, "prompt": "The warm pool", "max_tokens": 4, "stream": True,
            "temperature": 0, "ignore_eos": True}
    deadline = time.monotonic() + deadline_s
    with httpx.Client(timeout=30) as client:
        while time.monotonic() < deadline:
            with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                if response.status_code == 200:
                    for line in response.iter_lines():
                        if line.startswith("data: {") and '"text"' in line:
                            return time.monotonic()
                else:
                    response.read()
            time.sleep(POLL_S)
    raise RuntimeError(f"no request served within {deadline_s:.0f}s")


def wait_deregistered(redis_url: str) -> None:
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        deadline = time.monotonic() + 20
        while list(client.scan_iter(WORKER_KEY + "*")) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        client.close()


def one_run(kind: str, model: Path, redis_url: str, url: str) -> dict:
    if kind == "warm":
        worker = Process(worker_argv(model, redis_url, standby=True), "SPLITSERVE_READY")
        worker.wait_ready(300)
        pool = []
        deadline = time.monotonic() + 20
        while not pool and time.monotonic() < deadline:
            pool = list_standby(redis_url)
            time.sleep(0.05)
        time.sleep(1.0)  # standing by: the gateway has looked at the registry since
        decided = time.monotonic()
        activate(redis_url, pool[0].worker_id)
    else:
        decided = time.monotonic()
        worker = Process(worker_argv(model, redis_url, standby=False), "SPLITSERVE_READY")
    try:
        served = first_token_served(url, model.name, 300)
        ready_line = worker.ready_line
    finally:
        worker.stop()
        wait_deregistered(redis_url)
    startup = next((f.split("=", 1)[1] for f in ready_line.split() if f.startswith("startup_s=")),
                   "")
    return {"kind": kind, "decision_to_first_token_s": served - decided,
            "worker_startup_s": float(startup) if startup else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each kind")
    parser.add_argument("--model", type=Path, default=SMOLLM2)
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path (default bench/results/<date>-warm-pool/warm_pool.json)")
    args = parser.parse_args(argv)
    print(f"settings: {SETTINGS}", flush=True)
    results: dict = {"settings": SETTINGS, "model": str(args.model), "runs": [],
                     "started": datetime.datetime.now(datetime.UTC).isoformat()}
    with tempfile.TemporaryDirectory(prefix="splitserve-warm-pool-") as workdir:
        redis, port = start_redis(workdir)
        redis_url = f"redis://127.0.0.1:{port}"
        gateway = Process([sys.executable, "-m", "splitserve_cli.main", "gateway", "--model",
                           str(args.model), "--port", "0", "--grpc-port", "0", "--redis-url",
                           redis_url, "--log-format", "text"], "SPLITSERVE_READY").wait_ready()
        url = f"http://{gateway.ready_line.split()[2]}"
        try:
            total = 2 * args.runs
            for i in range(total):
                kind = ("warm", "cold")[i % 2]
                run = one_run(kind, args.model, redis_url, url)
                results["runs"].append(run)
                print(f"  [{i + 1}/{total}] {kind}: first token {run['decision_to_first_token_s']:.2f}s "
                      f"after the decision (worker start-up {run['worker_startup_s']}s)", flush=True)
        finally:
            gateway.stop()
            redis.stop()
    medians = {kind: statistics.median(r["decision_to_first_token_s"] for r in results["runs"]
                                       if r["kind"] == kind) for kind in ("warm", "cold")}
    results["median_s"] = medians
    print(f"\nmedian decision -> first token: warm {medians['warm']:.2f}s, cold "
          f"{medians['cold']:.2f}s ({medians['warm'] / medians['cold']:.2f}x)")
    out = args.out or REPO / "bench" / "results" / f"{datetime.date.today()}-warm-pool" / "warm_pool.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
