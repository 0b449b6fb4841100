"""Benchmark: does a seeded sampled request get the same text alone as in a batch?

The offline engine on SmolLM2 (`make model`) runs chat prompts, each with its own seed, once
all together in one batch and once each alone, and reports for each dtype how many requests'
tokens differ and where they first do. The draw itself is keyed by (seed, position) and does
not see the batch (engine/sampling_draw.py); what moves is the logits: the batch's shape changes
how the matrix products round (about 5e-5 in float32 here, up to 0.25 in bfloat16), and the
draw, an inverse of the cumulative distribution in vocabulary order, passes a move on when its
uniform lands that close to a boundary between two tokens, which the vocabulary's many
tokens of tiny probability make likely within a few dozen draws.

    python bench/seed_batch_invariance.py [--prompts 12] [--tokens 60] [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODEL = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-instruct"
QUESTIONS = ["Tell me a story about a dragon.", "Write a poem about the sea.",
             "Explain gravity in detail.", "Describe a cat.", "Why is the sky blue?",
             "Give me a recipe for bread.", "What is a black hole?", "Name some rivers.",
             "How do plants grow?", "Describe your favourite city.", "Why do we sleep?",
             "Write a letter to a friend."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=60)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    questions = (QUESTIONS * (args.prompts // len(QUESTIONS) + 1))[: args.prompts]
    prompts = [list(tokenizer.apply_chat_template(
        [{"role": "user", "content": q}], add_generation_prompt=True, return_dict=True)["input_ids"])
        for q in questions]
    params = [SamplingParams(max_tokens=args.tokens, temperature=args.temperature, seed=i,
                             ignore_eos=True) for i in range(len(prompts))]
    print(f"{len(prompts)} prompts, {args.tokens} tokens each, temperature "
          f"{args.temperature:g}, seeds 0..{len(prompts) - 1}; the offline engine, changed from "
          f"a worker's defaults: each dtype named (auto is bfloat16 on this CPU), "
          f"{args.threads} torch thread(s), prefix caching off (every run starts cold, so the "
          "runs alone do not read what the batch cached)")
    for dtype in args.dtypes.split(","):
        engine = LLMEngine(EngineConfig(model=str(MODEL), dtype=dtype, num_threads=args.threads,
                                        enable_prefix_caching=False))
        together = [list(o.token_ids) for o in engine.generate(prompts, params)]
        again = [list(o.token_ids) for o in engine.generate(prompts, params)]
        alone = []
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            alone.append(list(engine.generate([prompt], [p])[0].token_ids))
            print(f"\r  {dtype}: alone {i + 1}/{len(prompts)}", end="", file=sys.stderr)
        print(file=sys.stderr)
        firsts = [next((k for k, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), None)
                  for x, y in zip(together, alone, strict=True)]
        differ = [k for k in firsts if k is not None]
        # Up to this many rows the bf16 linear layers take the C++ small-M kernel, which
        # computes each row as it would alone; past it, torch's matrix product, which rounds
        # by the batch's shape. Measured at start by timing both (engine/kernel_choice.py), so
        # it can differ from one start to the next.
        small_m = getattr(engine.runner, "small_m_max_rows", 0)
        print(f"{dtype} (small-M kernel up to {small_m} rows): the same batch twice: "
              f"{'identical' if together == again else 'DIFFERENT'}; "
              f"batch vs alone: {len(differ)} of {len(prompts)} requests differ"
              + (f", first at tokens {sorted(differ)}" if differ else "")
              + f" ({len(differ)} divergences in {sum(k if k is not None else args.tokens for k in firsts)} "
                "draws before them)")
        del engine


if __name__ == "__main__":
    main()
