"""Turns logits into tokens: penalties, temperature, top-k/top-p/min-p, seeded sampling,
logprobs. Randomness belongs to the request: a sampled token inverts its filtered distribution
at a uniform keyed by (seed, position) (sampling_draw), so batch composition and the worker that
samples do not matter. noise_for is the exponential noise the speculative residual draws use."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.outputs import Logprobs
from engine.sampling_draw import draw, uniform_for
from engine.sampling_params import SamplingParams
from engine.token_counts import TokenCounts, with_output_tokens

_MASK63 = (1 << 63) - 1


@dataclass
class SamplingRow:
    """One position to sample: the request's params and the tokens that precede it.

    Penalties read `counts`, the request's incremental counts over `token_ids`; without one
    (a caller that keeps no state) the whole history is counted for this row alone.
    `pending_token_ids` follow `token_ids` before this position (speculative proposals being
    verified or drafted): counted for this row only."""

    params: SamplingParams
    seed: int
    position: int  # index of the token being sampled within the sequence
    token_ids: list[int]  # prompt + accepted output so far (for penalties)
    num_prompt_tokens: int
    counts: TokenCounts | None = None
    pending_token_ids: Sequence[int] = ()


def _apply_penalties(logits: torch.Tensor, row: SamplingRow) -> None:
    p = row.params
    counts = row.counts if row.counts is not None else TokenCounts()
    counts.update(row.token_ids, row.num_prompt_tokens, logits.shape[-1], logits.device)
    output, seen = counts.output, counts.seen
    if row.pending_token_ids:
        output, seen = with_output_tokens(output, seen, row.pending_token_ids)
    # Only the seen (output) entries are touched: on a long vocabulary that is about twice as
    # fast as arithmetic on every logit, and the values are those of counting from scratch.
    if p.repetition_penalty != 1.0:
        ids = seen.nonzero().squeeze(1)
        values = logits[ids]
        logits[ids] = torch.where(values > 0, values / p.repetition_penalty,
                                  values * p.repetition_penalty)
    if p.presence_penalty or p.frequency_penalty:
        ids = output.nonzero().squeeze(1)
        logits[ids] -= p.frequency_penalty * output[ids] + p.presence_penalty


def _filter(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Top-k then top-p then min-p on temperature-scaled logits; returns probabilities that
    sum to 1 over the kept tokens (the rejection sampler uses them as p and q, not only as
    weights for a draw)."""
    device = logits.device
    top_ks = [r.params.top_k for r in rows]
    if any(k > 0 for k in top_ks):
        vocab = logits.shape[-1]
        ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks], device=device)
        kmax = int(ks.max())
        top = logits.topk(kmax, dim=-1).values
        threshold = top.gather(1, (ks - 1).unsqueeze(1))
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    probs = logits.softmax(dim=-1)
    top_ps = [r.params.top_p for r in rows]
    if any(p < 1.0 for p in top_ps):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly ahead of each token
        ps = torch.tensor(top_ps, device=device, dtype=probs.dtype).unsqueeze(1)
        # Rows with top_p == 1 are exempt: their float32 cumsum can reach 1.0 before the tail,
        # which would drop tail tokens only when a neighbour in the batch uses top_p.
        sorted_probs = sorted_probs.masked_fill((before >= ps) & (ps < 1.0), 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
    min_ps = [r.params.min_p for r in rows]
    if any(m > 0 for m in min_ps):
        ms = torch.tensor(min_ps, device=device, dtype=probs.dtype).unsqueeze(1)
        probs = probs.masked_fill(probs < ms * probs.max(dim=-1, keepdim=True).values, 0.0)
    if any(p < 1.0 for p in top_ps) or any(m > 0 for m in min_ps):
        probs = probs / probs.sum(dim=-1, keepdim=True)  # the top token always survives: sum > 0
    return probs


def sampling_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The distribution each (non-greedy) row's token is drawn from: penalties, temperature,
    then top-k/top-p/min-p, as float32 [rows, vocab]. Speculative verification needs it whole."""
    logits = logits.float().clone()
    for i, row in enumerate(rows):
        if row.params.needs_penalties:
            _apply_penalties(logits[i], row)
    temps = torch.tensor([r.params.temperature for r in rows], device=logits.device)
    return _filter(logits / temps.unsqueeze(1), rows)


def noise_for(seed: int, position: int, vocab: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator(device=device)
    generator.manual_seed(hash((seed, position)) & _MASK63)
    return torch.empty(vocab, device=device).exponential_(generator=generator)


class Sampler:
    def __call__(
        self, logits: torch.Tensor, rows: list[SamplingRow]
    ) -> tuple[list[int], list[Logprobs | None]]:
        logits = logits.float()
        # Logprobs are of the model's distribution (before penalties), for the rows that ask.
        asked = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        raw_logprobs = None
        if asked:
            raw_logprobs = (logits if len(asked) == len(rows) else logits[asked]).log_softmax(-1)
        if any(r.params.needs_penalties for r in rows):
            logits = logits.clone()
            for i, row in enumerate(rows):
                if row.params.needs_penalties:
                    _apply_penalties(logits[i], row)
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if random_rows:
            subset = [rows[i] for i in random_rows]
            index = torch.tensor(random_rows, device=logits.device)
            temps = torch.tensor([r.params.temperature for r in subset], device=logits.device)
            scaled = logits if len(subset) == len(rows) else logits[index]
            drawn = draw(scaled / temps.unsqueeze(1), [r.params for r in subset],
                         [uniform_for(r.seed, r.position) for r in subset])
            tokens[index] = torch.tensor(drawn, device=logits.device)
        token_list = tokens.tolist()
        logprobs: list[Logprobs | None] = [None] * len(rows)
        for at, i in enumerate(asked):
            logprobs[i] = top_logprobs(raw_logprobs[at], token_list[i], rows[i].params.logprobs)
        return token_list, logprobs


def top_logprobs(row_logprobs: torch.Tensor, token: int, n: int) -> Logprobs:
    chosen = row_logprobs[token]
    rank = int((row_logprobs > chosen).sum()) + 1
    top: dict[int, float] = {}
    if n:
        values, ids = row_logprobs.topk(n)
        top = dict(zip(ids.tolist(), values.tolist(), strict=False))
    return Logprobs(logprob=float(chosen), rank=rank, top=top)
