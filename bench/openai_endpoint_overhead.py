"""What a worker's --openai-port costs its engine step: a role-both worker serving SSE from its
own port (the endpoint child) against the same worker without the flag behind `splitserve
gateway --worker` on the same machine, both with shipped defaults, rounds alternated.

    python -m bench.openai_endpoint_overhead                 # batch 1 and 16
    python -m bench.openai_endpoint_overhead --batches 16 --rounds 6 --json out.json

Per round: `batch` concurrent streamed /v1/completions (random token prompts, so the prefix
cache is cold; ignore_eos, --output-len tokens each). Reported per config and batch (medians
over rounds): step ms (the worker's splitserve_worker_step_seconds, sum/count over the round),
client ITL ms, worker CPU ms per output token; and endpoint/baseline ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.serving_overhead import cpu_seconds, step_totals
from splitserve_cli.processes import free_port, start_worker

DEFAULT_MODEL = "models/smollm2-135m-instruct"


async def stream_one(client: httpx.AsyncClient, url: str, model: str, prompt: list[int],
                     output_len: int) -> list[float]:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0,
            "ignore_eos": True, "stream": True}
    times = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {") and '"text":""' not in line.replace(" ", ""):
                times.append(time.perf_counter())
    return times


async def one_round(url: str, metrics_url: str, pid: int, model: str, batch: int,
                    prompt_len: int, output_len: int, rng: random.Random) -> dict:
    async with httpx.AsyncClient(timeout=300) as client:
        before = step_totals((await client.get(metrics_url)).text)
        cpu0 = cpu_seconds(pid)
        prompts = [[rng.randrange(100, 40000) for _ in range(prompt_len)] for _ in range(batch)]
        results = await asyncio.gather(*(stream_one(client, url, model, p, output_len)
                                         for p in prompts))
        cpu1 = cpu_seconds(pid)
        after = step_totals((await client.get(metrics_url)).text)
    steps = after[1] - before[1]
    itls = [(t[-1] - t[0]) / (len(t) - 1) for t in results if len(t) > 1]
    return {"step_ms": 1e3 * (after[0] - before[0]) / max(steps, 1),
            "itl_ms": 1e3 * statistics.median(itls),
            "worker_cpu_ms_per_token": 1e3 * (cpu1 - cpu0) / (batch * output_len)}


def start_gateway(model: str, worker_address: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "splitserve_cli.main", "gateway", "--model", model,
         "--worker", worker_address, "--port", str(port), "--ttft-target-s", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in process.stdout:
        if line.startswith("SPLITSERVE_READY"):
            break
    return process, f"http://127.0.0.1:{port}"


def wait_health(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} never became healthy")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    model_name = Path(args.model).name
    # Changed from the defaults: --num-threads 1 per worker (splitserve_cli.processes), so
    # the two workers that run side by side do not fight over the cores; the baseline
    # gateway's --ttft-target-s 0, as the endpoint's, so both serve every request of a round.
    print("settings: shipped worker and gateway defaults, except --num-threads 1 per worker "
          "(two workers side by side) and the baseline gateway's --ttft-target-s 0 (the "
          f"endpoint's setting: no early 503s); {vars(args)}", flush=True)
    baseline = start_worker("both", args.model)
    openai_port = free_port()
    endpoint = start_worker("both", args.model, "--openai-port", str(openai_port))
    gateway, gateway_url = start_gateway(args.model, baseline.address)
    configs = {"baseline": (gateway_url, baseline), "endpoint": (f"http://127.0.0.1:{openai_port}",
                                                                 endpoint)}
    rng = random.Random(0)
    report: dict = {"settings": vars(args), "results": {}}
    try:
        wait_health(configs["endpoint"][0])
        for url, worker in configs.values():  # warm-up: first-use costs out of the rounds
            asyncio.run(one_round(url, f"http://{worker.metrics_address}/metrics",
                                  worker.process.pid, model_name, 2, 16, 8, rng))
        for batch in (int(b) for b in args.batches.split(",")):
            rounds: dict[str, list[dict]] = {name: [] for name in configs}
            for _ in range(args.rounds):
                for name, (url, worker) in configs.items():
                    rounds[name].append(asyncio.run(one_round(
                        url, f"http://{worker.metrics_address}/metrics", worker.process.pid,
                        model_name, batch, args.prompt_len, args.output_len, rng)))
            summary = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
                       for name, rs in rounds.items()}
            summary["ratio"] = {k: summary["endpoint"][k] / summary["baseline"][k]
                                for k in summary["baseline"]}
            report["results"][f"batch_{batch}"] = summary
            for name, values in summary.items():
                print(f"batch {batch:>2} {name:<9} " + "  ".join(
                    f"{k}={v:.3f}" for k, v in values.items()), flush=True)
    finally:
        gateway.terminate()
        gateway.wait(15)
        baseline.kill(15)
        endpoint.kill(15)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
