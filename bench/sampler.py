"""Benchmark: one sampling step on real SmolLM2 logits, the shipped Sampler against the draw
it replaced, in the same run.

The logits come from the model itself (transformers, float32) at the positions of a few chat
answers it samples, so they have a language model's shape: a few likely tokens and a long tail
(uniform random logits would make top-p keep thousands of tokens and flatter neither draw).
The previous draw is rebuilt from what the tree still has: sampler._filter (a full sort for
top-p) and an exponential race over vocabulary-wide noise from one torch.Generator per row
(noise_for, kept here), with the per-row penalty and logprob loops it used. Each case is the median of
--repeats calls after one warm-up.

    python bench/sampler.py [--model DIR] [--threads 2] [--repeats 10]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.outputs import Logprobs  # noqa: E402
from engine.sampler import Sampler, SamplingRow, _filter, top_logprobs  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.token_counts import TokenCounts, with_output_tokens  # noqa: E402

QUESTIONS = ["Write a story about a dragon.", "Explain how a CPU cache works.",
             "What is the capital of France and why?", "List ten fruits.",
             "Write a poem about the sea.", "How do I bake bread?",
             "Tell me about the Roman empire.", "What is machine learning?"]


def real_logits(model_dir: str, tokens_per_answer: int = 40) -> torch.Tensor:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(0)
    rows = []
    with torch.no_grad():
        for question in QUESTIONS:
            ids = tok.apply_chat_template([{"role": "user", "content": question}],
                                          add_generation_prompt=True)
            ids = ids if isinstance(ids, list) else ids["input_ids"]
            out = model.generate(torch.tensor([ids]), max_new_tokens=tokens_per_answer,
                                 do_sample=True, temperature=0.8, top_p=0.95)
            logits = model(out).logits[0]
            rows.append(logits[len(ids) - 1 : out.shape[1] - 1])
    return torch.cat(rows)


def previous_sampler(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[Logprobs]]:
    """The draw before the CDF inversion: per-row penalties, a full-vocabulary filter (a sort
    for top-p), an exponential race over noise for every token, per-row logprobs."""
    logits = logits.float()
    asked = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    raw = logits[asked].log_softmax(-1) if asked else None
    logits = logits.clone()
    for i, row in enumerate(rows):
        if row.params.needs_penalties:
            _penalise_one(logits[i], row)
    tokens = logits.argmax(dim=-1)
    temps = torch.tensor([r.params.temperature for r in rows]).unsqueeze(1)
    probs = _filter(logits / temps, rows)
    noise = torch.stack([noise_for(r.seed, r.position, logits.shape[-1], logits.device) for r in rows])
    tokens = (probs / noise).argmax(dim=-1).tolist()
    logprobs: list[Logprobs] = [top_logprobs(raw[at], tokens[i], rows[i].params.logprobs)
                                for at, i in enumerate(asked)]
    return tokens, logprobs


def noise_for(seed: int, position: int, vocab: int, device: torch.device) -> torch.Tensor:
    """The previous draw's noise: exponential, from a generator seeded by (seed, position)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(hash((seed, position)) & ((1 << 63) - 1))
    return torch.empty(vocab, device=device).exponential_(generator=generator)


def _penalise_one(logits: torch.Tensor, row: SamplingRow) -> None:
    p = row.params
    counts = row.counts if row.counts is not None else TokenCounts()
    counts.update(row.token_ids, row.num_prompt_tokens, logits.shape[-1], logits.device)
    output, seen = counts.output, counts.seen
    if row.pending_token_ids:
        output, seen = with_output_tokens(output, seen, row.pending_token_ids)
    if p.repetition_penalty != 1.0:
        ids = seen.nonzero().squeeze(1)
        values = logits[ids]
        logits[ids] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if p.presence_penalty or p.frequency_penalty:
        ids = output.nonzero().squeeze(1)
        logits[ids] -= p.frequency_penalty * output[ids] + p.presence_penalty


CASES = {
    "temperature 0.8, top_p 0.95": lambda i: dict(temperature=0.8, top_p=0.95),
    "temperature 1.0": lambda i: dict(temperature=1.0),
    "temperature 0.7, top_k 50": lambda i: dict(temperature=0.7, top_k=50),
    "chat mix (1/3 penalties, 1/4 logprobs)": lambda i: dict(
        temperature=0.8, top_p=0.95,
        **(dict(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5) if i % 3 == 0 else {}),
        **(dict(logprobs=5) if i % 4 == 1 else {})),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="models/smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--batches", default="16,64")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"sampler benchmark: {args.threads} threads, real logits of {args.model}", flush=True)
    logits = real_logits(args.model)
    vocab = logits.shape[-1]
    rng = random.Random(0)
    print(f"{len(logits)} positions x {vocab} vocabulary; median of {args.repeats} calls\n")
    print(f"{'batch':>5}  {'rows':<40} {'previous ms':>12} {'now ms':>8} {'speed-up':>9}")
    for batch in (int(b) for b in args.batches.split(",")):
        picked = logits[torch.randperm(len(logits), generator=torch.Generator().manual_seed(batch))[:batch]]
        for name, fields in CASES.items():
            old_rows, new_rows = (_rows(fields, batch, vocab, rng) for _ in range(2))
            before = _median_ms(lambda: previous_sampler(picked, old_rows), args.repeats)  # noqa: B023
            after = _median_ms(lambda: Sampler()(picked, new_rows), args.repeats)  # noqa: B023
            print(f"{batch:>5}  {name:<40} {before:>12.1f} {after:>8.1f} {before / after:>8.1f}x", flush=True)


def _rows(fields, batch: int, vocab: int, rng: random.Random) -> list[SamplingRow]:
    """Rows with 300-token histories (200 prompt) for the penalties to count."""
    return [SamplingRow(SamplingParams(max_tokens=16, **fields(i)), seed=i, position=300,
                        token_ids=[rng.randrange(vocab) for _ in range(300)], num_prompt_tokens=200,
                        counts=TokenCounts())
            for i in range(batch)]


def _median_ms(call, repeats: int) -> float:
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


if __name__ == "__main__":
    main()
