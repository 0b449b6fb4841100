"""Benchmark: one new prompt's prefill through the shipped engine on this checkout against the
same on another git revision, in the same run, alternating: what a change to the engine or its
C++ kernels did to prompt time, each side with its own kernel build.

The revision is checked out into a temporary `git worktree` (its kernels build on first use,
about 40 s, then load from torch's extension cache), the model folder linked into it. Each
side runs in its own process: an engine as `make run` builds it (every setting the shipped
default, `--threads` torch threads), three prompts to warm up, then `--repeats` new prompts
(random tokens: a cold prefix cache each), median and best. The two sides take turns
`--rounds` times, so drift in the VM's speed falls on both.

    python bench/prefill_against_revision.py --revision HEAD~1
    python bench/prefill_against_revision.py --revision 595b780 --lengths 256,1024,2048 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Run in the side's own checkout: prints {"ms": [...]} for `repeats` new prompts of `length`.
_SIDE = """
import json, random, sys, time
sys.path.insert(0, sys.argv[1])
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
model, length, repeats, threads = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
engine = LLMEngine(EngineConfig(model=model, num_threads=threads,
                                num_kv_blocks=max(256, 3 * length // 16)))
rng = random.Random(length)
def prefill():
    engine.add_request(f"r{rng.random()}", [rng.randrange(100, 40000) for _ in range(length)],
                       SamplingParams(max_tokens=1, temperature=0))
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return (time.perf_counter() - start) * 1e3
for _ in range(3):
    prefill()
print(json.dumps({"ms": [prefill() for _ in range(repeats)]}))
"""


def side(checkout: Path, model: str, length: int, repeats: int, threads: int) -> list[float]:
    done = subprocess.run([sys.executable, "-c", _SIDE, str(checkout), model, str(length),
                           str(repeats), str(threads)], cwd=checkout, capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["ms"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--revision", required=True, help="the git revision to compare against")
    parser.add_argument("--model", default="models/smollm2-135m-instruct")
    parser.add_argument("--lengths", default="256,1024,2048")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    model = str((ROOT / args.model).resolve())
    with tempfile.TemporaryDirectory(prefix="prefill-rev-") as tmp:
        other = Path(tmp) / "checkout"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(other), args.revision],
                       cwd=ROOT, check=True)
        try:
            print(f"settings: every engine setting the shipped default, {args.threads} torch "
                  f"threads; this checkout against {args.revision}, alternating, {args.rounds} "
                  f"round(s) of {args.repeats} new prompts each", flush=True)
            print(f"{'tokens':>7}  {'this checkout ms':>22}  {args.revision + ' ms':>22}  ratio")
            for length in (int(n) for n in args.lengths.split(",")):
                runs: dict[str, list[float]] = {"this": [], "other": []}
                for round_ in range(args.rounds):
                    print(f"  {length} tokens, round {round_ + 1}/{args.rounds}...",
                          file=sys.stderr, flush=True)
                    runs["this"] += side(ROOT, model, length, args.repeats, args.threads)
                    runs["other"] += side(other, model, length, args.repeats, args.threads)
                this, base = (statistics.median(runs[k]) for k in ("this", "other"))
                cells = [f"{statistics.median(runs[k]):8.1f} (best {min(runs[k]):6.1f})"
                         for k in ("this", "other")]
                print(f"{length:>7}  {cells[0]:>22}  {cells[1]:>22}  {base / this:.3f}x faster",
                      flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(other)], cwd=ROOT,
                           check=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
