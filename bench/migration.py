"""The stall a client sees when its stream migrates: the gap from the last token before its
decode worker is killed (kill -9) to the first token after, against prompt + generated length.

A gateway, one prefill and two decode workers (shipped defaults otherwise); one stream at a
time, killed after --generated tokens; the killed decoder is replaced before the next point.
The stall is also given against two figures of the same stream, measured in the same run: the
time to first token of its prompt (prefill of length - generated tokens on the prefill worker)
and its median inter-token latency (ITL) before the kill.

    .venv/bin/python -m bench.migration             # SmolLM2, ~6 minutes on 2 cores
    .venv/bin/python -m bench.migration --quick     # tiny model smoke run, ~30 s
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

from bench.run_settings import Override, RunSettings, gateway_override
from splitserve_cli.processes import WorkerProcess, start_worker

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests/gateway"))
from gateway_processes import start_gateway  # noqa: E402  (the tests' process launcher)


def stream_and_kill(url: str, model: str, prompt: list[int], generated: int,
                    decoders: dict[str, WorkerProcess], tail: int) -> dict:
    """One stream; when `generated` tokens arrived, kill -9 the decoder serving it. Returns
    the token arrival times and which decoder was killed."""
    body = {"model": model, "prompt": prompt, "max_tokens": generated + tail,
            "temperature": 0, "ignore_eos": True, "stream": True}
    stamps: list[float] = []
    killed: dict = {}

    def kill_when_due() -> None:
        serving = None
        while serving is None:  # the first token comes from prefill: wait for the decoder
            serving = next((n for n, w in decoders.items() if w.health().stats.running), None)
            time.sleep(0.005)
        while len(stamps) < generated:
            time.sleep(0.0005)
        killed["at"] = time.perf_counter()
        decoders[serving].kill(signal.SIGKILL)
        killed["name"] = serving

    killer = threading.Thread(target=kill_when_due, daemon=True)
    killer.start()
    finish = None
    sent_at = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line.removeprefix("data: "))
            choice = (event.get("choices") or [{}])[0]
            if choice.get("text"):
                stamps.append(time.perf_counter())
            finish = choice.get("finish_reason") or finish
    killer.join(30)
    return {"stamps": stamps, "killed": killed.get("name"), "finish": finish,
            "killed_at": killed.get("at"), "ttft_s": stamps[0] - sent_at if stamps else None}


def stall_of(stamps: list[float], killed_at: float) -> tuple[float, float]:
    """(stall s: last token before the kill -> first after, median ITL s before the kill)."""
    before = [t for t in stamps if t <= killed_at]
    after = [t for t in stamps if t > killed_at]
    gaps = [b - a for a, b in zip(before, before[1:], strict=False)]
    return after[0] - before[-1], statistics.median(gaps)


def run_settings(args) -> RunSettings:
    return RunSettings("bench/migration.py", (
        gateway_override("ttft_target_s", 0, "one stream at a time; nothing to refuse"),
        Override("workers", "--num-threads", "1 per worker", "0 (torch's own)",
                 "three workers share 2 cores, as `splitserve up` splits them"),
    ))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO / "models/smollm2-135m-instruct"))
    parser.add_argument("--quick", action="store_true", help="tiny model, two points")
    parser.add_argument("--lengths", default="256,1024,2048,4096",
                        help="prompt + generated tokens at the kill, comma-separated")
    parser.add_argument("--generated", type=int, default=64, help="tokens before the kill")
    parser.add_argument("--tail", type=int, default=64, help="tokens after the kill")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(REPO / "bench/results/migration.json"))
    args = parser.parse_args(argv)
    if args.quick:
        from splitserve_cli.tiny_model import build_tiny_model

        args.model = str(build_tiny_model(Path("/tmp/splitserve-bench-tiny-long"),
                                          arch="llama", max_position_embeddings=2048))
        args.lengths, args.repeats, args.tail = "256,1024", 1, 400
    lengths = [int(n) for n in args.lengths.split(",")]
    settings = run_settings(args)
    print(settings.text(), flush=True)
    model = Path(args.model)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    workers: dict[str, WorkerProcess] = {}
    gateway = None
    rows = []
    try:
        workers["p1"] = start_worker("prefill", model)
        for name in ("d1", "d2"):
            workers[name] = start_worker("decode", model)
        gateway = start_gateway(model, "--prefill", workers["p1"].address, "--decode",
                                f"{workers['d1'].address},{workers['d2'].address}",
                                *settings.gateway_args())
        url = f"http://{gateway.address}"
        for length in lengths:
            for rep in range(args.repeats):
                prompt = [(length * 7 + rep * 13 + j * 31) % (vocab - 200) + 100
                          for j in range(length - args.generated)]
                decoders = {n: workers[n] for n in ("d1", "d2")}
                result = stream_and_kill(url, model.name, prompt, args.generated, decoders,
                                         tail=args.tail)
                if result["finish"] != "length" or result["killed"] is None:
                    raise SystemExit(f"the stream did not migrate and finish: {result}")
                stall, itl = stall_of(result["stamps"], result["killed_at"])
                rows.append({"length": length, "stall_s": stall, "itl_s": itl,
                             "ttft_s": result["ttft_s"]})
                print(f"  {length:6d} tokens: stall {stall * 1000:8.1f} ms  (TTFT of its "
                      f"prompt {result['ttft_s'] * 1000:.1f} ms, ITL before {itl * 1000:.1f} "
                      "ms)", flush=True)
                # The dead decoder's address is reused by its replacement (the gateway's
                # static list); the next point kills whichever serves it.
                dead = workers[result["killed"]]
                workers[result["killed"]] = start_worker("decode", model,
                                                         port=dead.port)
                time.sleep(1.0)  # a health poll or two: the replacement is routable again
    finally:
        if gateway is not None:
            gateway.stop()
        for worker in workers.values():
            worker.kill()
    print("\n" + settings.text())
    print("\nprompt+generated   stall p50 (ms)   TTFT of the prompt (ms)   stall / TTFT   "
          "ITL before (ms)   stall / ITL")
    summary = []
    for length in lengths:
        mine = [r for r in rows if r["length"] == length]
        stall = statistics.median(r["stall_s"] for r in mine)
        itl = statistics.median(r["itl_s"] for r in mine)
        ttft = statistics.median(r["ttft_s"] for r in mine)
        summary.append({"length": length, "stall_ms": round(stall * 1000, 1),
                        "ttft_ms": round(ttft * 1000, 1), "itl_ms": round(itl * 1000, 2),
                        "stall_over_ttft": round(stall / ttft, 2),
                        "stall_over_itl": round(stall / itl, 1)})
        print(f"  {length:14d}   {stall * 1000:14.1f}   {ttft * 1000:23.1f}   "
              f"{stall / ttft:12.2f}   {itl * 1000:15.2f}   {stall / itl:11.1f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "settings": settings.to_json(),
                                          "rows": rows, "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
