"""What tracing costs: request throughput of the same disaggregated deployment with tracing on
(every request sampled, every span serialized to a JSON-lines file) and off, in one run.

    python -m bench.tracing_overhead                       # tiny random model, about 3 minutes
    python -m bench.tracing_overhead --json bench/results/tracing_overhead.json

Two stacks (gateway + prefill + decode each) run side by side, one with SPLITSERVE_TRACE_FILE
and OTEL_TRACES_SAMPLER=always_on in every process, one with tracing off. They take the same
closed-loop load in alternating rounds (off, on, on, off, ...), so drift on a shared machine
hits both arms alike; the figure is median(on) / median(off) of requests per second. The tiny
model makes each request cheap, so per-request costs like tracing weigh as much as they can.
The gateways run the shipped admission settings unless --gateway-ttft-target-s says otherwise;
refused requests (429/503) are counted per round and reported, not served.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench.run_settings import Override, RunSettings, gateway_override, with_inherited
from splitserve_cli.processes import WorkerProcess, start_worker

REPO_ROOT = Path(__file__).resolve().parent.parent
ARMS = ("off", "on")


class Stack:
    """Gateway, prefill and decode of one arm; `env` goes to all three processes."""

    def __init__(self, model: Path, env: dict[str, str], gateway_args: list[str]) -> None:
        self.workers: list[WorkerProcess] = []
        self.gateway: subprocess.Popen | None = None
        try:
            for role in ("decode", "prefill"):
                self.workers.append(start_worker(role, model, "--num-kv-blocks", "512",
                                                 "--metrics-port", "-1", env=env))
            decode, prefill = self.workers
            self.gateway = subprocess.Popen(
                [sys.executable, "-m", "splitserve_cli.main", "gateway", "--model", str(model),
                 "--port", "0", "--prefill", prefill.address, "--decode", decode.address,
                 *gateway_args],
                cwd=REPO_ROOT, env={**os.environ, **env}, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, text=True)
            self.url = _await_ready(self.gateway)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.gateway is not None and self.gateway.poll() is None:
            self.gateway.terminate()
            self.gateway.wait(30)
        for worker in self.workers:
            worker.kill()


def _await_ready(process: subprocess.Popen, timeout: float = 120.0) -> str:
    found: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        for line in process.stdout:
            if line.startswith("SPLITSERVE_READY") and not found:
                # The API, then the admin port (/ready).
                found.extend(("http://" + line.split()[2],
                              "http://" + line.split("admin=")[1].split()[0]))
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    if not ready.wait(timeout):
        raise RuntimeError("the gateway did not start")
    deadline = time.monotonic() + timeout
    while httpx.get(f"{found[1]}/ready", timeout=5).status_code != 200:
        if time.monotonic() > deadline:
            raise RuntimeError("the gateway never became ready")
        time.sleep(0.2)
    return found[0]


async def closed_loop(url: str, model: str, clients: int, seconds: float, prompt_len: int,
                      max_tokens: int, vocab_size: int) -> dict:
    """`clients` callers sending back to back for `seconds`; completed requests per second.
    A refused request (429/503) is counted, and its caller pauses briefly before the next."""
    done = tokens = refused = 0
    stop_at = time.monotonic() + seconds

    async def caller(index: int, http: httpx.AsyncClient) -> None:
        nonlocal done, tokens, refused
        n = 0
        while time.monotonic() < stop_at:
            start = index * 7919 + n * 104729  # distinct prompts: no prefix-cache hits
            n += 1
            prompt = [10 + (start + j) % (vocab_size - 10) for j in range(prompt_len)]
            response = await http.post(f"{url}/v1/completions", json={
                "model": model, "prompt": prompt,
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
            if response.status_code in (429, 503):
                refused += 1
                await asyncio.sleep(0.05)
                continue
            response.raise_for_status()
            done += 1
            tokens += response.json()["usage"]["completion_tokens"]

    began = time.monotonic()
    async with httpx.AsyncClient(timeout=120) as http:
        await asyncio.gather(*(caller(i, http) for i in range(clients)))
    elapsed = time.monotonic() - began
    return {"requests": done, "refused": refused, "seconds": elapsed,
            "requests_per_s": done / elapsed,
            "output_tokens_per_s": tokens / elapsed}


def run_settings(args) -> RunSettings:
    """The shipped admission unless a flag says otherwise, and this benchmark's other changes
    from the shipped defaults, with the reasons."""
    overrides: tuple[Override, ...] = ()
    if args.gateway_ttft_target_s is not None:
        overrides += (gateway_override("ttft_target_s", args.gateway_ttft_target_s,
                                       "--gateway-ttft-target-s given"),)
    overrides += (
        gateway_override("health_interval_s", 0.2, "fresh workers: routable sooner"),
        Override("workers", "--num-kv-blocks", "512", "from --kv-cache-memory 1GiB",
                 "two stacks share the machine; a tiny model's requests need few blocks"),
        Override("workers", "--metrics-port", "-1 (off)", "0", "not measured; two stacks"),
        Override("workers", "--num-threads", "1", "0 (torch's own)",
                 "four workers on one machine: no oversubscription"))
    return RunSettings("bench.tracing_overhead", with_inherited(overrides),
                       note="the 'on' arm sets SPLITSERVE_TRACE_FILE and OTEL_TRACES_SAMPLER="
                            "always_on in every process: the variable under test")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="model folder (default: a tiny random one)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds per arm")
    parser.add_argument("--seconds", type=float, default=8.0, help="length of one round")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--gateway-ttft-target-s", type=float, default=None,
                        help="the gateways' --ttft-target-s (0: off; default: the shipped one)")
    parser.add_argument("--json", default="", help="write the result here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings = run_settings(args)
    print(settings.text(), flush=True)

    with tempfile.TemporaryDirectory(prefix="splitserve-tracing-") as tmp:
        model = Path(args.model) if args.model else _tiny_model(Path(tmp))
        trace_file = Path(tmp) / "spans.jsonl"
        envs = {"off": {"OTEL_TRACES_EXPORTER": "none", "SPLITSERVE_TRACE_FILE": ""},
                "on": {"SPLITSERVE_TRACE_FILE": str(trace_file),
                       "OTEL_TRACES_SAMPLER": "always_on"}}
        stacks = {}
        try:
            for arm in ARMS:
                stacks[arm] = Stack(model, envs[arm], settings.gateway_args())
            name = model.name
            vocab = json.loads((model / "config.json").read_text())["vocab_size"]
            for arm in ARMS:  # warm-up: first-call costs stay out of the figure
                asyncio.run(closed_loop(stacks[arm].url, name, args.clients, 2.0,
                                        args.prompt_len, args.max_tokens, vocab))
            rounds: dict[str, list[dict]] = {arm: [] for arm in ARMS}
            for i in range(args.rounds):
                for arm in (ARMS if i % 2 == 0 else ARMS[::-1]):
                    result = asyncio.run(closed_loop(stacks[arm].url, name, args.clients,
                                                     args.seconds, args.prompt_len,
                                                     args.max_tokens, vocab))
                    rounds[arm].append(result)
                    print(f"round {i} {arm:>3}: {result['requests_per_s']:.2f} req/s "
                          f"{result['output_tokens_per_s']:.1f} tok/s, "
                          f"{result['refused']} refused", flush=True)
        finally:
            for stack in stacks.values():
                stack.stop()
        spans = sum(1 for _ in trace_file.open()) if trace_file.exists() else 0

    median = {arm: statistics.median(r["requests_per_s"] for r in rounds[arm]) for arm in ARMS}
    ratio = median["on"] / median["off"]
    pairs = [on["requests_per_s"] / off["requests_per_s"]
             for on, off in zip(rounds["on"], rounds["off"], strict=True)]
    summary = {
        "benchmark": "tracing_overhead", "model": str(args.model or "tiny-llama (random)"),
        "clients": args.clients, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
        "rounds": args.rounds, "round_seconds": args.seconds,
        "requests_per_s_median": median, "ratio_on_over_off": ratio,
        "cost_percent": (1 - ratio) * 100, "pair_ratios": pairs,
        "spans_exported": spans, "requests_traced": sum(r["requests"] for r in rounds["on"]),
        "refused": {arm: sum(r["refused"] for r in rounds[arm]) for arm in ARMS},
        "settings": settings.to_json(),
        "raw": rounds, "cpu_count": os.cpu_count(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    print(settings.text())
    print(f"tracing on/off throughput ratio: {ratio:.3f} (cost {summary['cost_percent']:.1f}%; "
          f"pairs {', '.join(f'{p:.3f}' for p in pairs)}; {spans} spans exported; refused "
          f"off {summary['refused']['off']}, on {summary['refused']['on']})")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0


def _tiny_model(folder: Path) -> Path:
    from splitserve_cli.tiny_model import build_tiny_model

    return build_tiny_model(folder / "tiny-llama", arch="llama", seed=0)


if __name__ == "__main__":
    sys.exit(main())
