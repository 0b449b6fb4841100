"""Cache-aware vs round-robin prefill routing on prompts that share long prefixes.

Groups of requests share a system prompt, and each group holds multi-turn conversations whose
every turn resends the whole history. The same workload runs twice against real processes
(Redis, 2 prefill workers, 1 decode worker, a gateway), each time on freshly started workers:
once with `--routing round_robin`, once with the default scored routing (prefix-cache
events + queued work). Prints the prefill workers' prefix-cache hit rate and client-side TTFT,
and the settings it runs with: the gateway's shipped admission unless --gateway-ttft-target-s
says otherwise; a refused request (429/503) is counted and reported, not a failure.

`--topology agg`: 2 aggregated workers instead (each prefills what it decodes), and the two
arms are the shipped routing without its decode prefix affinity (`--decode-affinity-slack
-1`: the decode scorers alone) and the shipped routing.

    .venv/bin/python bench/routing.py            # SmolLM2-135M on CPU, a few minutes
    .venv/bin/python bench/routing.py --topology agg
    .venv/bin/python bench/routing.py --quick    # tiny model smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from bench.loadgen.metrics import percentile
from bench.run_settings import Override, RunSettings, gateway_override, with_inherited
from splitserve_cli.processes import WorkerProcess, free_port, start_worker

REPO = Path(__file__).resolve().parent.parent
POLICIES = ("round_robin", "scored")
AGG_ARMS = ("no_affinity", "scored")  # --topology agg: decode prefix affinity off, then shipped


@dataclass(frozen=True)
class Workload:
    groups: int = 8  # distinct system prompts
    system_tokens: int = 384
    conversations: int = 2  # per group
    turns: int = 4  # per conversation; turn t resends turns 0..t-1 and their answers
    turn_tokens: int = 32  # user tokens per turn (plus as many "assistant" tokens)
    max_tokens: int = 4
    concurrency: int = 4
    seed: int = 0

    def sessions(self, vocab: int) -> list[list[list[int]]]:
        """One session per conversation, its turns' prompts in order, sessions shuffled (a
        fixed order would let round-robin pin each group to one worker by luck)."""
        rng = random.Random(self.seed)

        def tokens(n: int) -> list[int]:
            return [rng.randrange(100, vocab - 1) for _ in range(n)]

        systems = [tokens(self.system_tokens) for _ in range(self.groups)]
        sessions = []
        for g in range(self.groups):
            for _ in range(self.conversations):
                history, turns = list(systems[g]), []
                for _turn in range(self.turns):
                    history += tokens(self.turn_tokens)
                    turns.append(list(history))
                    history += tokens(self.turn_tokens)  # the answer, resent next turn
                sessions.append(turns)
        rng.shuffle(sessions)
        return sessions


@dataclass(frozen=True)
class Result:
    policy: str
    requests: int
    refused: int  # 429/503 from admission: not routed, so not in the hit rate or TTFT
    failed: int
    prefix_hit_rate: float  # prompt tokens served from the prefill workers' prefix caches
    prefill_share: tuple[float, ...]  # of the prompt tokens, per prefill worker
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_mean_s: float
    wall_s: float


class Process:
    """A splitserve child (gateway) or redis-server, stopped by its handle."""

    def __init__(self, argv: list[str], ready_prefix: str | None) -> None:
        self.lines: list[str] = []
        self.ready_line = ""
        self._ready = threading.Event()
        self.process = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True)
        self._prefix = ready_prefix
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line)
            if self._prefix and line.startswith(self._prefix):
                self.ready_line = line.strip()
                self._ready.set()

    def wait_ready(self, timeout: float = 120) -> Process:
        if not self._ready.wait(timeout):
            self.stop()
            raise RuntimeError("did not start:\n" + "".join(self.lines[-40:]))
        return self

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def start_redis(workdir: str) -> tuple[Process, int]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("bench/routing.py needs redis-server (make redis)")
    port = free_port()
    redis = Process([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                     "--appendonly", "no", "--dir", workdir], ready_prefix=None)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(64).startswith(b"+PONG"):
                    return redis, port
        except OSError:
            time.sleep(0.1)
    redis.stop()
    raise RuntimeError("redis-server did not start")


async def run_workload(url: str, model: str, sessions: list[list[list[int]]],
                       workload: Workload) -> tuple[list[float], list[str], list[str]]:
    """`concurrency` clients each take the next session and send its turns one after the
    other, each once the previous answer is complete. Returns TTFTs, refusals (429/503, the
    session goes on with its next turn) and failures."""
    queue = list(reversed(sessions))
    ttfts: list[float] = []
    refusals: list[str] = []
    errors: list[str] = []

    async def one(http: httpx.AsyncClient, prompt: list[int]) -> None:
        body = {"model": model, "prompt": prompt, "max_tokens": workload.max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}
        start = time.perf_counter()
        first = finish = None
        async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                lost = refusals if response.status_code in (429, 503) else errors
                lost.append(f"HTTP {response.status_code}: {response.text[:300]}")
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    errors.append(event["error"].get("message", "")[:300])
                    return
                if first is None:
                    first = time.perf_counter() - start
                finish = event["choices"][0]["finish_reason"] or finish
        if first is None or finish != "length":
            errors.append(f"stream ended without finishing ({finish})")
        else:
            ttfts.append(first)

    async def client(http: httpx.AsyncClient) -> None:
        while queue:
            for prompt in queue.pop():
                await one(http, prompt)

    async with httpx.AsyncClient(timeout=300) as http:
        await asyncio.gather(*(client(http) for _ in range(workload.concurrency)))
    return ttfts, refusals, errors


def prefix_counters(workers: list[WorkerProcess]) -> list[tuple[int, int]]:
    """(prefix_hits, prefix_queries) per worker, in prompt tokens."""
    return [(s.prefix_hits, s.prefix_queries) for s in (w.health().stats for w in workers)]


def run_settings(args) -> RunSettings:
    """The gateway's shipped admission unless a flag says otherwise, and the other changes
    from the shipped defaults this benchmark makes, with the reasons."""
    overrides: tuple[Override, ...] = ()
    if args.gateway_ttft_target_s is not None:
        overrides += (gateway_override("ttft_target_s", args.gateway_ttft_target_s,
                                       "--gateway-ttft-target-s given"),)
    overrides += (gateway_override("health_interval_s", 0.2, "fresh workers per arm: the "
                                   "gateway sees the workers' load and caches sooner"),)
    if args.topology == "agg":
        overrides += (
            Override("bench", "--decode-affinity-slack", "-1, then 4", "4",
                     "the variable under test: decode prefix affinity off, then shipped"),
            Override("workers", "--num-kv-blocks", f"{args.prefill_kv_blocks} (each)",
                     "from --kv-cache-memory 1GiB",
                     "caches smaller than the workload's prefixes, as in a busy deployment"))
    else:
        overrides += (
            Override("bench", "--routing", "round_robin, then scored", "scored",
                     "the variable under test: one arm per policy"),
            Override("workers", "--num-kv-blocks", f"{args.prefill_kv_blocks} (prefill), 2048 "
                     "(decode)", "from --kv-cache-memory 1GiB",
                     "prefill caches smaller than the workload's prefixes, as in a busy "
                     "deployment"))
    overrides += (
        Override("workers", "--num-threads", str(args.threads), "0 (torch's own)",
                 "several workers on a small machine: no oversubscription"),
        Override("workers", "--heartbeat-ttl-s", "2", "5", "each arm's workers register anew"))
    return RunSettings("bench/routing.py", with_inherited(overrides))


def run_policy(policy: str, model: Path, redis_url: str, workload: Workload,
               prefill_kv_blocks: int, threads: int, settings: RunSettings,
               topology: str = "disagg") -> Result:
    common = ("--redis-url", redis_url, "--heartbeat-ttl-s", "2", "--log-format", "text",
              "--num-threads", str(threads))
    workers: list[WorkerProcess] = []
    gateway = None
    if topology == "agg":
        arm = ("--decode-affinity-slack", "-1" if policy == "no_affinity" else "4")
    else:
        arm = ("--routing", policy)
    try:
        if topology == "agg":
            workers = [start_worker("both", model, *common, "--num-kv-blocks",
                                    str(prefill_kv_blocks)) for _ in range(2)]
        else:
            workers = [start_worker("prefill", model, *common, "--num-kv-blocks",
                                    str(prefill_kv_blocks)) for _ in range(2)]
            workers.append(start_worker("decode", model, *common, "--num-kv-blocks", "2048"))
        gateway = Process([sys.executable, "-m", "splitserve_cli.main", "gateway", "--model",
                           str(model), "--port", "0", "--redis-url", redis_url,
                           *arm, *settings.gateway_args(),
                           "--log-level", "WARNING"],
                          ready_prefix="SPLITSERVE_READY").wait_ready()
        url = f"http://{gateway.ready_line.split()[2]}"
        admin = gateway.ready_line.split("admin=")[1].split()[0]  # /ready is on the admin port
        deadline = time.monotonic() + 30
        while httpx.get(f"http://{admin}/ready", timeout=5).status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("gateway never became ready")
            time.sleep(0.2)
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        # Warm-up: one unrelated request per prefill worker (first forwards are slow).
        warm = Workload(groups=2, system_tokens=16, conversations=1, turns=1, turn_tokens=16,
                        max_tokens=2, concurrency=1, seed=99)
        asyncio.run(run_workload(url, model.name, warm.sessions(vocab), warm))
        time.sleep(1.0)
        before = prefix_counters(workers[:2])
        start = time.perf_counter()
        sessions = workload.sessions(vocab)
        ttfts, refusals, errors = asyncio.run(run_workload(url, model.name, sessions, workload))
        wall = time.perf_counter() - start
        if refusals:
            print(f"{policy}: {len(refusals)} requests refused; first: {refusals[0]}",
                  file=sys.stderr)
        if errors:
            print(f"{policy}: {len(errors)} requests failed; first: {errors[0]}", file=sys.stderr)
        after = prefix_counters(workers[:2])
        hits = [h - h0 for (h, _), (h0, _) in zip(after, before, strict=True)]
        queries = [q - q0 for (_, q), (_, q0) in zip(after, before, strict=True)]
        hit_rate = sum(hits) / max(sum(queries), 1)
        share = tuple(round(q / max(sum(queries), 1), 3) for q in queries)
        return Result(policy, sum(map(len, sessions)), len(refusals), len(errors),
                      round(hit_rate, 4), share,
                      round(percentile(ttfts, 50) or 0, 4), round(percentile(ttfts, 90) or 0, 4),
                      round(sum(ttfts) / max(len(ttfts), 1), 4), round(wall, 2))
    finally:
        if gateway is not None:
            gateway.stop()
        for worker in workers:
            worker.kill()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/smollm2-135m-instruct")
    parser.add_argument("--quick", action="store_true", help="tiny random model, small workload")
    parser.add_argument("--topology", choices=("disagg", "agg"), default="disagg",
                        help="disagg: 2 prefill + 1 decode, round_robin vs scored; agg: 2 "
                             "aggregated workers, decode prefix affinity off vs on")
    parser.add_argument("--prefill-kv-blocks", type=int, default=160,
                        help="KV blocks per prefill worker (less than the workload's prefixes "
                             "need in total, as in a busy deployment)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--gateway-ttft-target-s", type=float, default=None,
                        help="the gateway's --ttft-target-s (0: admit everything; default: the "
                             "gateway's shipped default)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    for f in Workload.__dataclass_fields__.values():
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=int, default=f.default)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    workload = Workload(**{f: getattr(args, f) for f in Workload.__dataclass_fields__})
    model = Path(args.model)
    settings = run_settings(args)
    print(settings.text(), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        if args.quick:
            from splitserve_cli.tiny_model import build_tiny_model

            model = build_tiny_model(Path(tmp) / "tiny", arch="llama", seed=0,
                                     max_position_embeddings=2048)
            workload = Workload(groups=4, system_tokens=128, conversations=2, turns=2,
                                turn_tokens=16, max_tokens=2, concurrency=2)
        redis, port = start_redis(tmp)
        try:
            arms = AGG_ARMS if args.topology == "agg" else POLICIES
            results = [run_policy(policy, model, f"redis://127.0.0.1:{port}/{db}", workload,
                                  args.prefill_kv_blocks, args.threads, settings,
                                  args.topology)
                       for db, policy in enumerate(arms)]
        finally:
            redis.stop()
    shape = ("2 aggregated workers" if args.topology == "agg"
             else "2 prefill workers, 1 decode worker")
    print(f"\nworkload: {asdict(workload)}; model {model.name}; {shape}, "
          f"{args.prefill_kv_blocks} KV blocks each prefilling worker")
    print(settings.text())
    print(f"{'routing':<12} {'requests':>8} {'refused':>7} {'failed':>6} {'hit rate':>9} "
          f"{'TTFT p50':>9} {'TTFT p90':>9} {'mean':>7} {'wall':>7}  prompt tokens per prefill "
          "worker (TTFT and hit rate: served requests only)")
    for r in results:
        print(f"{r.policy:<12} {r.requests:>8} {r.refused:>7} {r.failed:>6} "
              f"{r.prefix_hit_rate:>9.1%} "
              f"{r.ttft_p50_s * 1e3:>7.0f}ms {r.ttft_p90_s * 1e3:>7.0f}ms "
              f"{r.ttft_mean_s * 1e3:>5.0f}ms {r.wall_s:>6.1f}s  "
              + " / ".join(f"{x:.0%}" for x in r.prefill_share))
    if args.json:
        args.json.write_text(json.dumps({"workload": asdict(workload), "model": model.name,
                                         "topology": args.topology,
                                         "prefill_kv_blocks": args.prefill_kv_blocks,
                                         "settings": settings.to_json(),
                                         "results": [asdict(r) for r in results]}, indent=2))
    return 0 if all(r.failed == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
