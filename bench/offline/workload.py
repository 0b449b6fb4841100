"""The requests every system runs: random prompt token ids (fixed seeds), exact output lengths
(EOS ignored), greedy or sampled. Plain data (JSON-able), so the vLLM child gets the same ones.
No torch here: the vLLM venv imports it too."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

# Ids from 100 up: clear of the special tokens at the bottom of the Llama-family vocabularies.
FIRST_ID = 100


@dataclass(frozen=True)
class RequestSpec:
    """One request as both engines' SamplingParams take it (same field names in each)."""

    prompt: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None

    def sampling_fields(self) -> dict:
        """The sampling keywords, ignore_eos on; no seed: each engine seeds as it ships."""
        fields = asdict(self)
        del fields["prompt"]
        return {**fields, "ignore_eos": True}


@dataclass(frozen=True)
class Workload:
    """One timed run's requests, all submitted at once."""

    name: str
    requests: list[RequestSpec]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt) for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    def to_json(self) -> dict:
        return {"name": self.name, "requests": [asdict(r) for r in self.requests]}

    @classmethod
    def from_json(cls, data: dict) -> Workload:
        return cls(data["name"], [RequestSpec(**r) for r in data["requests"]])


def sampled(i: int) -> dict:
    """The sampled variant of request i: temperature 0.8, top_p 0.95; every third also has
    penalties, every fourth asks for 5 logprobs (what a chat client sends)."""
    fields: dict = {"temperature": 0.8, "top_p": 0.95}
    if i % 3 == 0:
        fields.update(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5)
    if i % 4 == 1:
        fields["logprobs"] = 5
    return fields


def make_workload(name: str, n: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                  vocab: int, seed: int, sample: bool = False) -> Workload:
    rng = random.Random(seed)
    requests = []
    for i in range(n):
        prompt = [rng.randrange(FIRST_ID, vocab) for _ in range(rng.randint(*prompt_range))]
        requests.append(RequestSpec(prompt, rng.randint(*output_range), **(sampled(i) if sample else {})))
    return Workload(name, requests)


@dataclass(frozen=True)
class Shape:
    """The knobs of the plan (BenchConfig carries them)."""

    num_requests: int
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    long_prompts: int  # prefill phase: this many prompts of long_prompt_len, one output token
    long_prompt_len: int
    decode_prompt_len: int
    decode_tokens: int
    repeats: int
    seed: int


def plan(shape: Shape, vocab: int) -> dict[str, list[Workload]]:
    """Every timed run of the bench, by phase, and one untimed warm-up of each kind first.

    Each run draws its own prompts (its own seed), so no run finds another's blocks in the
    prefix cache: every repetition starts cold (the engines keep their caches; nothing is
    reset). The decode phase pairs a 1-token and a (1 + decode_tokens)-token run per repeat:
    their time difference over decode_tokens is one batch-1 decode step.
    """
    seeds = iter(range(shape.seed * 1000 + 1, shape.seed * 1000 + 1000))
    s = shape

    def runs(name, n, prompt, output, sample=False, repeats=s.repeats):
        return [make_workload(name, n, prompt, output, vocab, next(seeds), sample) for _ in range(repeats)]

    long = (s.long_prompt_len, s.long_prompt_len)
    decode = (s.decode_prompt_len, s.decode_prompt_len)
    warm = runs("warm-up", 4, (32, 64), (8, 8), repeats=1) + runs("warm-up", 4, (32, 64), (8, 8), True, 1) \
        + runs("warm-up", 1, long, (1, 1), repeats=1)
    decode_runs = []
    for _ in range(s.repeats):
        decode_runs += runs("decode-1", 1, decode, (1, 1), repeats=1)
        decode_runs += runs("decode-n", 1, decode, (s.decode_tokens + 1,) * 2, repeats=1)
    return {
        "warm-up": warm,
        "decode": decode_runs,
        "greedy": runs("greedy", s.num_requests, s.prompt_len, s.output_len),
        "sampled": runs("sampled", s.num_requests, s.prompt_len, s.output_len, sample=True),
        "prefill": runs("prefill", s.long_prompts, long, (1, 1)),
    }
