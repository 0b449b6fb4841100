"""Whether a migrated request's text stays the same, per dtype: one engine runs 8 chat prompts
(greedy and seeded sampling, 200 tokens) as one batch, then resumes each from its first k
tokens (k = 50, 120), as a migration does, and counts continuations that differ. For scale it
also reruns the batch undisturbed and runs each prompt alone.

    .venv/bin/python -m bench.migration_exactness --dtype float32     # SmolLM2, ~1 minute
    .venv/bin/python -m bench.migration_exactness --dtype bfloat16
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parent.parent
PROMPTS = ("Write a short story about a lighthouse keeper.", "Explain how a hash map works.",
           "List ten facts about the moon.", "Describe the water cycle in detail.",
           "Write a poem about autumn leaves.", "How do vaccines train the immune system?",
           "Give a recipe for bread.", "Summarize the history of the printing press.")


def run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams, list[int]]],
        tag: str) -> list[list[int]]:
    """Add (prompt, params, resumed) requests at once, step to the end: each one's new tokens."""
    ids = []
    for i, (prompt, params, resumed) in enumerate(requests):
        ids.append(f"{tag}-{i}")
        engine.add_request(ids[-1], prompt, params, resumed_output_token_ids=resumed)
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    return [out[rid] for rid in ids]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO / "models/smollm2-135m-instruct"))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-tokens", type=int, default=200)
    args = parser.parse_args(argv)
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, device="cpu",
                                    num_threads=2))
    tok = engine.tokenizer
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": p}],
                                            add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]) for p in PROMPTS]
    params = [SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)
              if i % 2 == 0 else
              SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.8,
                             top_p=0.95, seed=100 + i) for i in range(len(prompts))]
    started = time.time()
    reference = run(engine, [(p, q, []) for p, q in zip(prompts, params, strict=True)], "ref")
    differing = []
    for k in (50, 120):
        resumed = run(engine, [(p, q, r[:k]) for p, q, r in zip(prompts, params, reference,
                                                                 strict=True)], f"k{k}")
        for i, (got, ref) in enumerate(zip(resumed, reference, strict=True)):
            if got != ref[k:]:
                at = k + next(j for j, (a, b) in enumerate(zip(got, ref[k:], strict=False))
                              if a != b)
                differing.append(f"{'greedy' if i % 2 == 0 else 'seeded'} #{i} from {k}: "
                                 f"token {at}")
    rerun = run(engine, [(p, q, []) for p, q in zip(prompts, params, strict=True)], "again")
    alone = [run(engine, [(p, q, [])], f"alone{i}")[0]
             for i, (p, q) in enumerate(zip(prompts, params, strict=True))]
    n = len(prompts)
    print(f"{args.dtype}: resumed continuations that differ: {len(differing)} of {2 * n}")
    for line in differing:
        print(f"  {line}")
    print(f"{args.dtype}: undisturbed batch rerun differs in "
          f"{sum(a != b for a, b in zip(rerun, reference, strict=True))} of {n}; each prompt "
          f"alone differs from the batch in "
          f"{sum(a != b for a, b in zip(alone, reference, strict=True))} of {n} "
          f"({time.time() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
