"""What the serving path adds to the engine step: per output token, at batch 1 and 32, the
engine's own step time, the inter-token latency a client of the decode worker's gRPC stream sees,
and the one a client of the gateway's SSE stream sees, measured side by side in one run on the
deployment `make run` starts (`splitserve up`, shipped flags and dtype).

    python -m bench.serving_overhead                          # both modes, batch 1 and 32
    python -m bench.serving_overhead --modes disagg --batches 1 --json out.json

Stages, per output token of one request (medians over the requests of a round, then over rounds):
  step      the engine's step wall time (the worker's splitserve_worker_step_seconds, over the
            round's decode steps only)
  grpc      ITL of Decode.Generate read directly from the decode worker (prompt prefilled there)
  http      ITL of /v1/completions streamed through the gateway (SSE, one choice per request)
The differences are what the engine loop hand-off and gRPC stream cost (grpc - step) and what
the gateway and SSE cost (http - grpc). CPU time per output token of each process (gateway,
workers, this client) says where the cycles go on a machine whose cores the engine also needs.
Rounds alternate grpc and http and each uses fresh random prompts, so the prefix cache is cold.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import httpx
import numpy as np
from splitserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc

from bench.run_settings import RunSettings, gateway_override, with_inherited
from splitserve_cli.processes import free_port
from splitserve_cli.up import DEFAULT_MODEL, Deployment, UpConfig

_CLK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / _CLK


def step_totals(text: str) -> tuple[float, float]:
    """(sum, count) of the worker's step-seconds histogram in a /metrics page."""
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith("splitserve_worker_step_seconds_sum"):
            total += float(line.split()[-1])
        elif line.startswith("splitserve_worker_step_seconds_count"):
            count += float(line.split()[-1])
    return total, count


def top_leaves(collapsed: str, n: int = 8) -> list[tuple[str, float]]:
    """The functions a py-spy profile (raw, collapsed stacks) found on top of the stack most,
    as shares of all samples."""
    counts: dict[str, int] = {}
    total = 0
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        leaf = stack.rsplit(";", 1)[-1]
        counts[leaf] = counts.get(leaf, 0) + int(count)
        total += int(count)
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])[:n]
    return [(name, c / total) for name, c in ranked] if total else []


class Profiler:
    """py-spy on the gateway and the decode worker for the length of one round (--profile)."""

    def __init__(self, out_dir: Path, pids: dict[str, int], tag: str) -> None:
        self.out_dir, self.tag = out_dir, tag
        out_dir.mkdir(parents=True, exist_ok=True)
        self.procs = {
            name: subprocess.Popen(
                [str(Path(sys.executable).with_name("py-spy")), "record", "--pid", str(pid),
                 "--rate", "200", "--format", "raw", "--threads", "--nonblocking",
                 "--output", str(out_dir / f"{tag}-{name}.txt")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for name, pid in pids.items()}

    def stop(self) -> dict[str, list[tuple[str, float]]]:
        for proc in self.procs.values():
            proc.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        for proc in self.procs.values():
            proc.wait(30)
        tops = {}
        for name in self.procs:
            path = self.out_dir / f"{self.tag}-{name}.txt"
            tops[name] = top_leaves(path.read_text()) if path.exists() else []
        return tops


def window_itl(times: list[float], counts: list[int], start: float, end: float) -> float | None:
    """Seconds per output token between the first and the last arrival inside [start, end]."""
    inside = [(t, c) for t, c in zip(times, counts, strict=True) if start <= t <= end]
    tokens = sum(c for _, c in inside[1:])
    return (inside[-1][0] - inside[0][0]) / tokens if len(inside) > 1 and tokens > 0 else None


async def grpc_request(stub, prompt: list[int], output_len: int) -> tuple[list[float], list[int]]:
    request = decode_pb2.GenerateRequest(
        request_id=f"ovh-{uuid.uuid4().hex[:12]}", prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(max_tokens=output_len, temperature=0.0,
                                           has_temperature=True, ignore_eos=True, seed=0))
    times, counts = [], []
    async for message in stub.Generate(request):
        if message.WhichOneof("kind") == "delta" and message.delta.token_ids:
            times.append(time.perf_counter())
            counts.append(len(message.delta.token_ids))
    return times, counts


async def http_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int],
                       output_len: int) -> tuple[list[float], list[int]]:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0,
            "ignore_eos": True, "stream": True}
    times, counts = [], []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices") and event["choices"][0].get("text"):
                times.append(time.perf_counter())
                counts.append(1)  # one SSE event per token step here (a text delta)
    return times, counts


@dataclass
class Round:
    mode: str
    batch: int
    layer: str  # "grpc" | "http"
    itl_ms: float  # median over the round's requests
    step_ms: float  # the decode worker's mean step time over the round
    tokens: int
    cpu_ms_per_token: dict[str, float]
    profile: dict | None = None  # --profile: top functions per process


class Bench:
    def __init__(self, mode: str, model: str, prompt_len: int, output_len: int, log,
                 profile_dir: Path | None = None) -> None:
        self.profile_dir = profile_dir
        self.mode, self.prompt_len, self.output_len = mode, prompt_len, output_len
        self.deployment = Deployment(UpConfig(port=free_port(), model=model, mode=mode))
        self.url = self.deployment.start()
        children = {c.name: c for c in self.deployment.children}
        self.decode = children["decode" if mode == "disagg" else "both"]
        self.metrics_url = "http://" + self.decode.ready_line.split("metrics=")[1].split()[0] + "/metrics"
        self.pids = {name: c.process.pid for name, c in children.items()}
        self.pids["client"] = os.getpid()
        self.model = httpx.get(f"{self.url}/v1/models", timeout=10).json()["data"][0]["id"]
        self.rng = np.random.default_rng(0)
        self.log = log

    def prompts(self, batch: int) -> list[list[int]]:
        # Fresh random ids each round (cold prefix cache), clear of the special tokens at the start.
        return [self.rng.integers(100, 40000, self.prompt_len).tolist() for _ in range(batch)]

    async def round(self, batch: int, layer: str) -> Round:
        prompts = self.prompts(batch)
        cpu0 = {n: cpu_seconds(p) for n, p in self.pids.items()}
        samples: list[tuple[float, float, float]] = []  # (time, step seconds sum, step count)
        poller = asyncio.create_task(self._poll_steps(samples))
        profiler = None
        if self.profile_dir is not None and layer == "http":
            profiler = Profiler(self.profile_dir, {"gateway": self.pids["gateway"],
                                                   "decode": self.decode.process.pid},
                                f"{self.mode}-b{batch}-{len(samples)}{time.monotonic_ns()}")
        if layer == "grpc":
            async with grpc.aio.insecure_channel(self.decode.address) as channel:
                stub = decode_pb2_grpc.DecodeStub(channel)
                results = await asyncio.gather(*(grpc_request(stub, p, self.output_len)
                                                 for p in prompts))
        else:
            limits = httpx.Limits(max_connections=batch + 4)
            async with httpx.AsyncClient(timeout=120, limits=limits) as client:
                results = await asyncio.gather(*(http_request(client, self.url, self.model, p,
                                                              self.output_len) for p in prompts))
        cpu1 = {n: cpu_seconds(p) for n, p in self.pids.items()}
        poller.cancel()
        profile = profiler.stop() if profiler is not None else None
        tokens = sum(sum(c) for _, c in results)
        # Everything is judged in the window where (nearly) the whole batch decodes: after 90%
        # of the first tokens and before 10% of the requests have ended, so no prefill step
        # and no shrinking batch is inside.
        firsts = sorted(t[0] for t, _ in results)
        lasts = sorted(t[-1] for t, _ in results)
        start, end = firsts[-(-9 * batch // 10) - 1], lasts[batch // 10]
        window = [s for s in samples if start <= s[0] <= end]
        if len(window) < 2 or window[-1][2] == window[0][2]:
            raise RuntimeError(f"batch {batch}: the requests never decoded together for two "
                               "metric samples; give more --output-len")
        step_ms = 1000 * (window[-1][1] - window[0][1]) / (window[-1][2] - window[0][2])
        itls = [v for v in (window_itl(t, c, start, end) for t, c in results) if v is not None]
        return Round(self.mode, batch, layer, 1000 * statistics.median(itls), step_ms, tokens,
                     {n: 1000 * (cpu1[n] - cpu0[n]) / tokens for n in self.pids}, profile)

    async def _poll_steps(self, samples: list, every_s: float = 0.1) -> None:
        async with httpx.AsyncClient(timeout=5) as client:
            while True:
                text = (await client.get(self.metrics_url)).text
                samples.append((time.perf_counter(), *step_totals(text)))
                await asyncio.sleep(every_s)

    def stop(self) -> None:
        self.deployment.stop()


def summarize(rounds: list[Round]) -> list[dict]:
    """Per mode and batch, medians over rounds. The hand-off is ITL minus the step time in the
    same rounds (what reaching the client adds to a token); the slowdown is the step time in the
    HTTP rounds over the gRPC rounds (what the gateway's CPU work costs the engine on shared
    cores)."""
    rows = []
    for mode, batch in sorted({(r.mode, r.batch) for r in rounds}):
        by = {layer: [r for r in rounds if (r.mode, r.batch, r.layer) == (mode, batch, layer)]
              for layer in ("grpc", "http")}
        med = {layer: (statistics.median(r.step_ms for r in rs),
                       statistics.median(r.itl_ms for r in rs),
                       statistics.median(r.itl_ms - r.step_ms for r in rs))
               for layer, rs in by.items()}
        cpu = {n: statistics.median(r.cpu_ms_per_token[n] for r in by["http"])
               for n in by["http"][0].cpu_ms_per_token}
        rows.append({"mode": mode, "batch": batch,
                     "grpc_step_ms": med["grpc"][0], "grpc_itl_ms": med["grpc"][1],
                     "grpc_handoff_ms": med["grpc"][2],
                     "http_step_ms": med["http"][0], "http_itl_ms": med["http"][1],
                     "http_handoff_ms": med["http"][2],
                     "step_slowdown": med["http"][0] / med["grpc"][0],
                     "http_itl_over_grpc_step": med["http"][1] / med["grpc"][0],
                     "cpu_ms_per_token_http": cpu})
    return rows


def print_table(rows: list[dict], out) -> None:
    print("\n| mode | batch | gRPC rounds: step / ITL ms | HTTP rounds: step / ITL ms | "
          "hand-off gRPC / HTTP ms | step slowdown with the gateway | HTTP ITL / gRPC step | "
          "CPU ms per output token (HTTP rounds) |", file=out)
    print("|---|---|---|---|---|---|---|---|", file=out)
    for r in rows:
        cpu = ", ".join(f"{n} {v:.2f}" for n, v in r["cpu_ms_per_token_http"].items())
        print(f"| {r['mode']} | {r['batch']} | {r['grpc_step_ms']:.2f} / {r['grpc_itl_ms']:.2f} | "
              f"{r['http_step_ms']:.2f} / {r['http_itl_ms']:.2f} | "
              f"{r['grpc_handoff_ms']:+.2f} / {r['http_handoff_ms']:+.2f} | "
              f"{r['step_slowdown']:.3f}x | {r['http_itl_over_grpc_step']:.2f}x | {cpu} |", file=out)


def resummarize(path: Path) -> None:
    """Print the table of a saved run again (--from-json)."""
    data = json.loads(path.read_text())
    fields = {f for f in Round.__dataclass_fields__}
    print_table(summarize([Round(**{k: v for k, v in r.items() if k in fields})
                           for r in data["rounds"]]), sys.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--modes", default="disagg,agg")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3, help="rounds per layer and batch")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--from-json", type=Path, help="print a saved run's table and exit")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="py-spy the gateway and the decode worker during the HTTP rounds "
                             "(needs py-spy in this venv) and print their top functions")
    parser.add_argument("--shipped-admission", dest="admit_all", action="store_false",
                        help="keep the shipped TTFT target (a batch-32 burst is then partly refused)")
    parser.add_argument("--log", type=Path, default=Path("/tmp/serving_overhead.log"),
                        help="where the deployment's own output goes")
    args = parser.parse_args(argv)
    if args.from_json:
        resummarize(args.from_json)
        return 0
    if args.profile and not shutil.which("py-spy", path=str(Path(sys.executable).parent)):
        parser.error("--profile needs py-spy in this venv: .venv/bin/pip install py-spy")
    out = sys.stdout
    # Every request of a batch must be admitted, or the batch measured is not the one asked
    # for: the shipped TTFT target refuses part of a burst of 32 on 2 cores.
    overrides = with_inherited((gateway_override(
        "ttft_target_s", 0, "a batch is measured only if all its requests are admitted"),)
        if args.admit_all else ())
    settings = RunSettings("bench.serving_overhead", overrides)
    print(settings.text(), file=out)
    os.environ.update(settings.gateway_env())  # splitserve up's children inherit it
    print("splitserve as `make run` starts it (splitserve up, shipped flags); "
          f"prompts {args.prompt_len} random token ids, {args.output_len} output tokens, "
          "greedy, ignore_eos", file=out, flush=True)
    batches = [int(b) for b in args.batches.split(",")]
    rounds: list[Round] = []
    with open(args.log, "w") as log:
        for mode in args.modes.split(","):
            print(f"starting splitserve up --mode {mode} ...", file=out, flush=True)
            sys.stdout = log  # the deployment echoes its children's output here, all run long
            try:
                bench = Bench(mode, args.model, args.prompt_len, args.output_len, log,
                              args.profile)
            except BaseException:
                sys.stdout = out
                raise
            try:
                asyncio.run(bench.round(4, "http"))  # warm-up: first requests pay one-off costs
                for batch in batches:
                    for i in range(args.rounds):
                        for layer in (("grpc", "http") if i % 2 == 0 else ("http", "grpc")):
                            r = asyncio.run(bench.round(batch, layer))
                            rounds.append(r)
                            print(f"  {mode} batch {batch} {layer}: ITL {r.itl_ms:.2f} ms, "
                                  f"step {r.step_ms:.2f} ms", file=out, flush=True)
                            for proc, top in (r.profile or {}).items():
                                shown = "; ".join(f"{name} {share:.0%}" for name, share in top)
                                print(f"    {proc} top: {shown}", file=out, flush=True)
            finally:
                bench.stop()
                sys.stdout = out
    rows = summarize(rounds)
    print_table(rows, out)
    print("hand-off: ITL minus the engine's step time in the same rounds; slowdown: the step "
          "time with the gateway streaming (HTTP rounds) over without (gRPC rounds)", file=out)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rows": rows, "rounds": [asdict(r) for r in rounds],
                                         "args": {k: str(v) for k, v in vars(args).items()}},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
