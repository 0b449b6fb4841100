"""Verification of proposed tokens against the target model's logits at every proposed
position, keeping the output distribution exactly the target's.

Deterministic proposals (n-gram, greedy drafts, any greedy request): each position is
sampled as the plain sampler would (same penalties, filters and per-(seed, position) noise)
and proposals are accepted while they equal those samples. For a proposal that is a point
mass this *is* the standard rule (accept with probability p(x), else draw from p with x
removed), and the text is the one the request would get without speculation.

Draft-model proposals for temperature > 0 use the standard rule of Leviathan et al. / Chen
et al.: accept x ~ q with probability min(1, p(x)/q(x)), on rejection draw from
normalize(max(p - q, 0)), and after k acceptances draw a bonus token from p. The uniform draws
come from their own (seed, position) stream, independent of the draft's and of the residual
draw's, so the result does not depend on batch composition.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.outputs import Logprobs
from engine.sampler import Sampler, SamplingRow, batch_logprobs, sampling_probs
from engine.sampling_batched import draw_from
from engine.sampling_draw import uniform_for
from engine.sampling_params import SamplingParams
from engine.token_counts import TokenCounts

# Tags that separate the random streams derived from one (seed, position). Every uniform is
# sampling_draw.uniform_for's counter-based one (no generator, the same on any device): the
# accept test and the draft's sample in their own streams; the target's draws (a residual
# after a rejection, the bonus token) in the plain sampler's, so a bonus token is the one the
# request would sample there without speculation.
ACCEPT_STREAM = 0xACCE
DRAFT_STREAM = 0xD4AF


def draft_uniform(seed: int, position: int) -> float:
    """The uniform of the draft's own sample at a position (independent of the target's draw
    and accept streams, as the rejection rule requires)."""
    return uniform_for(seed, position, DRAFT_STREAM)


@dataclass
class VerifyItem:
    """One request's verification: its logits rows are [last token, proposals...]."""

    params: SamplingParams
    seed: int
    token_ids: list[int]  # accepted tokens so far (prompt + output)
    num_prompt_tokens: int
    proposals: list[int]
    draft_probs: torch.Tensor | None = None  # [len(proposals), draft vocab], sampled drafts only
    counts: TokenCounts | None = None  # the request's penalty counts over token_ids, if kept

    def rows(self) -> list[SamplingRow]:
        """A sampling row per scored position; position i follows proposals[:i]."""
        base = len(self.token_ids)
        penalties = self.params.needs_penalties
        return [
            SamplingRow(
                params=self.params, seed=self.seed, position=base + i, token_ids=self.token_ids,
                num_prompt_tokens=self.num_prompt_tokens, counts=self.counts,
                pending_token_ids=self.proposals[:i] if penalties else (),
            )
            for i in range(len(self.proposals) + 1)
        ]


class RejectionSampler:
    def __init__(self, sampler: Sampler | None = None) -> None:
        self.sampler = sampler or Sampler()

    def __call__(
        self, logits: torch.Tensor, items: list[VerifyItem]
    ) -> list[tuple[list[int], list[Logprobs]]]:
        """logits: the items' rows back to back. Returns, per item, the tokens to append (the
        accepted proposals then one token from the target) and their logprobs if asked."""
        results: list[tuple[list[int], list[Logprobs]] | None] = [None] * len(items)
        offsets, row = [], 0
        for item in items:
            offsets.append(row)
            row += len(item.proposals) + 1
        by_sampler = [i for i, it in enumerate(items)
                      if it.draft_probs is None or it.params.greedy]
        if by_sampler:
            index = [r for i in by_sampler
                     for r in range(offsets[i], offsets[i] + len(items[i].proposals) + 1)]
            rows = [r for i in by_sampler for r in items[i].rows()]
            tokens, logprobs = self.sampler(logits[index], rows)
            at = 0
            for i in by_sampler:
                n = len(items[i].proposals) + 1
                results[i] = _accept_matching(items[i].proposals, tokens[at : at + n],
                                              logprobs[at : at + n])
                at += n
        for i, item in enumerate(items):
            if results[i] is None:
                n = len(item.proposals) + 1
                results[i] = _rejection_sample(logits[offsets[i] : offsets[i] + n], item)
        return results  # type: ignore[return-value]


def _accept_matching(proposals, tokens, logprobs) -> tuple[list[int], list[Logprobs]]:
    accepted = 0
    while accepted < len(proposals) and tokens[accepted] == proposals[accepted]:
        accepted += 1
    kept = logprobs[: accepted + 1]
    return tokens[: accepted + 1], [lp for lp in kept if lp is not None]


def _rejection_sample(logits: torch.Tensor, item: VerifyItem) -> tuple[list[int], list[Logprobs]]:
    """The standard rule for one request; logits: [k + 1, vocab]."""
    device = logits.device
    rows = item.rows()
    p = sampling_probs(logits, rows)
    vocab = p.shape[-1]
    q = item.draft_probs.to(device=device, dtype=p.dtype)
    # p comes normalised from sampling_probs; q is made so here too, whoever built it: the
    # accept test and the residual compare them as probabilities, not as weights.
    q = q / q.sum(dim=-1, keepdim=True)
    if q.shape[-1] < vocab:  # a draft may have a smaller (prefix) vocabulary
        q = torch.nn.functional.pad(q, (0, vocab - q.shape[-1]))
    k = len(item.proposals)
    proposed = torch.tensor(item.proposals, device=device)
    steps = torch.arange(k, device=device)
    p_x = p[steps, proposed].tolist()
    q_x = q[steps, proposed].tolist()
    tokens: list[int] = []
    for i in range(k):
        # Accept with probability min(1, p/q): u * q < p, no division.
        if uniform_for(item.seed, rows[i].position, ACCEPT_STREAM) * q_x[i] < p_x[i]:
            tokens.append(item.proposals[i])
            continue
        residual = (p[i] - q[i]).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: nothing left to correct
            residual = p[i]
        tokens.append(int(draw_from(residual[None], [uniform_for(item.seed, rows[i].position)])))
        break
    else:
        tokens.append(int(draw_from(p[k : k + 1], [uniform_for(item.seed, rows[k].position)])))
    logprobs: list[Logprobs] = []
    if item.params.logprobs is not None:
        raw = logits[: len(tokens)].float().log_softmax(-1)
        logprobs = batch_logprobs(raw, tokens, [item.params.logprobs] * len(tokens))
    return tokens, logprobs
