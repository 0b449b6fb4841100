"""Benchmark: the sampler's draw of a step's sampled rows, the C++ kernel
(kernels/cpu/sample_draw.cpp, what a CPU worker runs) against the torch path it replaced
(engine/sampling_draw.draw), side by side in one process on the same logits.

The logits are SmolLM2's own (`make model`): the last position of chat prompts and of a few
sampled continuations, bfloat16 as the shipped dtype computes them; rows are repeated to make a
batch. Each setting runs both paths alternately, --repeats times each, on the threads a decode
worker has under `make run` (1 unless --threads); it prints milliseconds per call, the ratio,
and how many tokens the two paths drew alike (they differ only where two tokens' probabilities
are equal, which bf16 logits make common, and on rounded boundaries).

    python bench/sample_draw.py [--rows 8,32,104,256] [--threads 1] [--repeats 20]
    python bench/sample_draw.py --logits gaussian --rows 16   # flat rows, as random prompts give

--logits gaussian draws from N(0, std^2) logits (--std, default 2) over SmolLM2's vocabulary
instead: flat rows whose top-p set runs to thousands of tokens, and at --std 1 whose top-k rows
hold most of the vocabulary within their first span (the kernel's bins, see sample_draw.cpp).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine import sampler as sampler_module  # noqa: E402
from engine.sampler import Sampler, SamplingRow  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from kernels import cpu_kernels  # noqa: E402

MODEL = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-instruct"
SETTINGS = {
    "temperature 1.0": dict(temperature=1.0),
    "temperature 0.8, top_p 0.95": dict(temperature=0.8, top_p=0.95),
    "temperature 0.7, top_k 50": dict(temperature=0.7, top_k=50),
    "temperature 1.0, min_p 0.05": dict(temperature=1.0, min_p=0.05),
}


def model_logits(rows: int) -> torch.Tensor:
    """[rows, vocab] bf16 logits of SmolLM2 at the end of chat prompts and along sampled
    continuations of them (8 positions a prompt)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.bfloat16)
    out: list[torch.Tensor] = []
    torch.manual_seed(0)
    with torch.no_grad():
        for i in range(max(1, (min(rows, 64) + 7) // 8)):
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": f"Review number {i}: the film was long."}],
                tokenize=False, add_generation_prompt=True)
            ids = tokenizer(text, return_tensors="pt").input_ids
            generated = model.generate(ids, max_new_tokens=8, do_sample=True, temperature=1.0,
                                       output_logits=True, return_dict_in_generate=True)
            out += [step[0].bfloat16() for step in generated.logits]
    base = torch.stack(out)
    return base.repeat((rows + len(base) - 1) // len(base), 1)[:rows].contiguous()


def gaussian_logits(rows: int, std: float = 2.0, vocab: int = 49152) -> torch.Tensor:
    """[rows, vocab] bf16 logits drawn from N(0, std^2): flat rows."""
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(rows, vocab, generator=generator) * std).bfloat16()


def timed(fn, repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="8,32,104,256")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--logits", choices=("smollm2", "gaussian"), default="smollm2",
                        help="SmolLM2's own (peaked rows) or N(0, std^2) (flat rows)")
    parser.add_argument("--std", type=float, default=2.0, help="--logits gaussian: their std")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_kernels.load():
        print(f"the C++ kernels did not build ({cpu_kernels.build_error()}); nothing to compare")
        return 1
    counts = [int(r) for r in args.rows.split(",")]
    source = (f"SmolLM2 logits from {MODEL.name}" if args.logits == "smollm2"
              else f"N(0, {args.std:g}^2) logits over 49,152 tokens")
    print(f"{source}; {args.threads} thread(s); {args.repeats} calls per timing, the two paths "
          "alternating, 3 timings each (median)", flush=True)
    logits_all = (model_logits(max(counts)) if args.logits == "smollm2"
                  else gaussian_logits(max(counts), args.std))
    sampler = Sampler(batched=False)
    takes = sampler_module.draw_kernel_takes
    print(f"\n{'setting':<30} {'rows':>5} {'torch ms':>9} {'kernel ms':>10} {'speed-up':>9} "
          f"{'same token':>11}")
    for name, setting in SETTINGS.items():
        params = SamplingParams(max_tokens=16, **setting)
        for count in counts:
            logits = logits_all[:count]
            rows = [SamplingRow(params, seed=i, position=30, token_ids=[1] * 30,
                                num_prompt_tokens=30) for i in range(count)]
            times: dict[str, list[float]] = {"torch": [], "kernel": []}
            tokens: dict[str, list[int]] = {}
            for _ in range(3):
                for path in ("torch", "kernel"):
                    sampler_module.draw_kernel_takes = (lambda _: False) if path == "torch" else takes
                    tokens[path] = sampler(logits, rows)[0]
                    times[path].append(timed(functools.partial(sampler, logits, rows), args.repeats))
            sampler_module.draw_kernel_takes = takes
            t, k = statistics.median(times["torch"]), statistics.median(times["kernel"])
            same = sum(a == b for a, b in zip(tokens["torch"], tokens["kernel"], strict=True))
            print(f"{name:<30} {count:>5} {t:>9.2f} {k:>10.2f} {t / k:>8.1f}x {same:>5}/{count:<5}",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
