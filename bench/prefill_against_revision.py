"""Benchmark: prefill through the shipped engine on this checkout against the same on another
git revision, in the same run, alternating: what a change to the engine or its C++ kernels did
to prompt time, each side with its own kernel build.

Three kinds of work, each a new prompt set every repetition (random tokens: nothing cached but
what the shape caches on purpose):
  --lengths 256,2048     one prompt of that many tokens, alone (time to its first token);
  --cached 12x30+1100    one step of COUNT prompts of NEW own tokens after a cached prefix of
                         PREFIX tokens (a system prompt, computed and cached first);
  --sets 13x8x42         one step of SETS x COPIES identical prompts of LENGTH tokens (the
                         choices of n-choice chats: each choice is a request of its own);
  --many 16x128          one step of COUNT different prompts of LENGTH tokens (a wave of a
                         burst: 16 of 128 fill the default 2,048-token step).

The revision is checked out into a temporary `git worktree` (its kernels build on first use,
about 40 s, then load from torch's extension cache); the model folder is this checkout's. Each
side runs in its own process: an engine as `make run` builds it (every setting the shipped
default but a fixed KV pool of 2,048 blocks, which it prints; `--threads` torch threads),
warmed up on the same work twice, then `--repeats` measured repetitions, median and best. The sides take turns `--rounds` times, so drift in the
VM's speed falls on both.

    python bench/prefill_against_revision.py --revision HEAD~1
    python bench/prefill_against_revision.py --revision 595b780 --lengths 2048 --cached 12x30+1100 --sets 13x8x42
    python bench/prefill_against_revision.py --revision 7502c8e --lengths 2048 --many 16x128,4x512
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

# Run in the side's own checkout: prints {"ms": [...]}, one time per repetition of the work.
_SIDE = """
import json, random, sys, time
sys.path.insert(0, sys.argv[1])
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
model, kind, shape, repeats, threads = sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
engine = LLMEngine(EngineConfig(model=model, num_threads=threads, num_kv_blocks=2048))
rng = random.Random(0)
def tokens(n):
    return [rng.randrange(100, 40000) for _ in range(n)]
def run_out():
    while engine.has_unfinished():
        engine.step()
def add(prompt, max_tokens=1):
    engine.add_request(f"r{rng.random()}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.8))
def step_ms():  # the next step (what was added), then the rest run out untimed
    start = time.perf_counter()
    engine.step()
    elapsed = time.perf_counter() - start
    run_out()
    return elapsed * 1e3
def prompt_ms():  # one prompt alone, to its first token
    add(tokens(int(shape)))
    start = time.perf_counter()
    run_out()
    return (time.perf_counter() - start) * 1e3
def cached_ms():  # COUNTxNEW+PREFIX: one step after the prefix is cached
    count_new, prefix_len = shape.split("+")
    count, new = (int(x) for x in count_new.split("x"))
    prefix = tokens(int(prefix_len))
    add(prefix + tokens(1))
    run_out()
    for _ in range(count):
        add(prefix + tokens(new))
    return step_ms()
def sets_ms():  # SETSxCOPIESxLENGTH identical prompts, one step
    sets, copies, length = (int(x) for x in shape.split("x"))
    for _ in range(sets):
        prompt = tokens(length)
        for _ in range(copies):
            add(prompt)
    return step_ms()
def many_ms():  # COUNTxLENGTH different prompts, one step
    count, length = (int(x) for x in shape.split("x"))
    for _ in range(count):
        add(tokens(length))
    return step_ms()
work = {"prompt": prompt_ms, "cached": cached_ms, "sets": sets_ms, "many": many_ms}[kind]
for _ in range(2):
    work()
print(json.dumps({"ms": [work() for _ in range(repeats)]}))
"""


def side(checkout: Path, model: str, kind: str, shape: str, repeats: int, threads: int) -> list[float]:
    done = subprocess.run([sys.executable, "-c", _SIDE, str(checkout), model, kind, shape,
                           str(repeats), str(threads)], cwd=checkout, capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["ms"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--revision", required=True, help="the git revision to compare against")
    parser.add_argument("--model", default="models/smollm2-135m-instruct")
    parser.add_argument("--lengths", default="256,1024,2048", help="one prompt alone ('' none)")
    parser.add_argument("--cached", default="", help="COUNTxNEW+PREFIX,...: a step after a cached prefix")
    parser.add_argument("--sets", default="", help="SETSxCOPIESxLENGTH,...: a step of identical prompts")
    parser.add_argument("--many", default="", help="COUNTxLENGTH,...: a step of different prompts")
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
            print(f"settings: every engine setting the shipped default but the KV pool, 2,048 "
                  f"blocks (a worker sizes its pool from memory), {args.threads} torch threads; "
                  f"this checkout against {args.revision}, alternating, {args.rounds} round(s) "
                  f"of {args.repeats} repetitions each, new prompts every time", flush=True)
            print(f"{'work':>22}  {'this checkout ms':>22}  {args.revision + ' ms':>22}  ratio")
            work = [("prompt", x) for x in args.lengths.split(",") if x]
            work += [("cached", x) for x in args.cached.split(",") if x]
            work += [("sets", x) for x in args.sets.split(",") if x]
            work += [("many", x) for x in args.many.split(",") if x]
            for kind, shape in work:
                runs: dict[str, list[float]] = {"this": [], "other": []}
                for round_ in range(args.rounds):
                    print(f"  {kind} {shape}, round {round_ + 1}/{args.rounds}...",
                          file=sys.stderr, flush=True)
                    runs["this"] += side(ROOT, model, kind, shape, args.repeats, args.threads)
                    runs["other"] += side(other, model, kind, shape, args.repeats, args.threads)
                this, base = (statistics.median(runs[k]) for k in ("this", "other"))
                cells = [f"{statistics.median(runs[k]):8.1f} (best {min(runs[k]):6.1f})"
                         for k in ("this", "other")]
                label = f"{kind} {shape}" if kind != "prompt" else f"prompt of {shape}"
                print(f"{label:>22}  {cells[0]:>22}  {cells[1]:>22}  {base / this:.3f}x faster",
                      flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(other)], cwd=ROOT,
                           check=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
