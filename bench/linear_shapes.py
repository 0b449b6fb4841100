"""Benchmark: the shipped engine's memory and prefill time as it meets new prompt lengths, with
the bfloat16 matmul's row counts rounded up to kernels.linear.ROW_BUCKET (shipped, 16) against
no rounding (SPLITSERVE_CPU_LINEAR_ROW_BUCKET=1), in the same run.

oneDNN keeps a primitive per row count it has multiplied (about 3 MB each on SmolLM2); a prefill
worker meets every step size up to --max-num-batched-tokens. Each side runs in its own process,
an engine as `make run` builds it (every setting the shipped default but a fixed KV pool of
1,024 blocks; `--threads` torch threads), one prompt at a time (new tokens each time: nothing is
cached but the shapes):
  A        the even lengths of [--first, --last)   (RSS also grows as the KV pool is first touched)
  A again  the same lengths: nothing new, the time of warm shapes (what rounding's padded rows cost)
  B        the odd lengths of the same range: new row counts, the same peak memory as A
It reports the process's RSS after each pass and the seconds each took; the sides take turns
`--rounds` times. What rounding buys is B's RSS growth; what it costs is "A again"'s time.

    python bench/linear_shapes.py                     # lengths 600..699, 2 threads, 2 rounds
    python bench/linear_shapes.py --first 100 --last 2000 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PASSES = ("A", "A again", "B")

# One side: prints {"rss_mib": [after warm-up, after A, after A again, after B], "pass_s": [...]}.
_SIDE = """
import json, random, sys, time
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
model, threads, first, last = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
engine = LLMEngine(EngineConfig(model=model, num_threads=threads, num_kv_blocks=1024))
rng = random.Random(0)
def rss_mib():
    with open("/proc/self/status") as status:
        return int(next(l for l in status if l.startswith("VmRSS")).split()[1]) // 1024
def prefill(n):
    engine.add_request(f"r{rng.random()}", [rng.randrange(100, 40000) for _ in range(n)],
                       SamplingParams(max_tokens=1, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
even = [n for n in range(first, last) if n % 2 == 0]
odd = [n for n in range(first, last) if n % 2 == 1]
prefill(last)  # warm-up: the longest step first, so A holds the peak
rss, seconds = [rss_mib()], []
for lengths in (even, even, odd):
    start = time.perf_counter()
    for n in lengths:
        prefill(n)
    seconds.append(time.perf_counter() - start)
    rss.append(rss_mib())
print(json.dumps({"rss_mib": rss, "pass_s": seconds, "dtype": str(engine.runner.dtype)}))
"""


def _side(bucket: str, args) -> dict:
    env = {**os.environ, "SPLITSERVE_CPU_LINEAR_ROW_BUCKET": bucket,
           "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _SIDE, args.model, str(args.threads),
                          str(args.first), str(args.last)], cwd=ROOT, env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--first", type=int, default=600)
    p.add_argument("--last", type=int, default=700)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    sides = {"rounded (16, shipped)": "16", "unrounded": "1"}
    results: dict[str, list[dict]] = {name: [] for name in sides}
    print(f"prompt lengths {args.first}..{args.last - 1} (A even, B odd), {args.threads} threads, "
          f"{args.rounds} rounds alternating", flush=True)
    print("settings: the shipped engine defaults but a fixed KV pool of 1,024 blocks (the same on "
          "both sides, no start-up profile); the baseline changes SPLITSERVE_CPU_LINEAR_ROW_BUCKET "
          "to 1 (no rounding)", flush=True)
    for round_ in range(args.rounds):
        for name, bucket in sides.items():
            r = _side(bucket, args)
            results[name].append(r)
            passes = ", ".join(f"{p} {s:.1f} s -> {m} MiB"
                               for p, s, m in zip(PASSES, r["pass_s"], r["rss_mib"][1:], strict=True))
            print(f"  round {round_ + 1} {name:22s} ({r['dtype']}): start {r['rss_mib'][0]} MiB; "
                  f"{passes}", flush=True)
    rounded, plain = (results[name] for name in sides)

    def median(rs: list[dict], key) -> float:
        return statistics.median(key(r) for r in rs)

    def b_growth(r: dict) -> float:
        return r["rss_mib"][3] - r["rss_mib"][2]

    print(f"RSS growth over B (new lengths, same peak): rounded {median(rounded, b_growth):.0f} "
          f"MiB, unrounded {median(plain, b_growth):.0f} MiB")
    for i, name in enumerate(PASSES):
        ratio = (median(rounded, lambda r, i=i: r["pass_s"][i])
                 / median(plain, lambda r, i=i: r["pass_s"][i]))
        print(f"{name} time, rounded / unrounded: {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
