"""Per-request token counts for the repetition, presence and frequency penalties, kept
incrementally: a step counts only the tokens appended since the previous one, so its cost does
not grow with the length of the request."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.step_inputs import to_device


class TokenCounts:
    """Penalty state of one request, mirroring its token list (prompt, then output).

    The list must only grow while this object follows it (a request's tokens do: preemption
    and migration start a new state). `update` counts `token_ids[num_counted:]`: prompt tokens
    once into `seen`, output tokens into `seen` and `output`. Tensors are vocab-sized, made on
    first use, so a request without penalties pays nothing. Ids outside the vocabulary are not
    counted: a draft model with a smaller vocabulary has no logit to penalise for them. Owned by
    the thread that owns the token list (the engine thread)."""

    def __init__(self) -> None:
        self.num_counted = 0
        self.tokens_counted = 0  # total tokens ever counted: equals num_counted unless reset
        self.seen: torch.Tensor | None = None  # bool [vocab]: in the prompt or the output
        self.output: torch.Tensor | None = None  # float32 [vocab]: occurrences in the output

    def update(self, token_ids: Sequence[int], num_prompt_tokens: int, vocab: int,
               device: torch.device) -> None:
        if (self.seen is None or self.seen.shape[0] != vocab or self.seen.device != device
                or len(token_ids) < self.num_counted):
            # First use, or a caller broke the append-only contract: count from scratch.
            self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            self.output = torch.zeros(vocab, dtype=torch.float32, device=device)
            self.num_counted = 0
        start = self.num_counted
        if start == len(token_ids):
            return
        split = min(max(num_prompt_tokens, start), len(token_ids))
        if split > start:
            self.seen[_ids(token_ids[start:split], vocab, device)] = True
        if len(token_ids) > split:
            self.output, self.seen = with_output_tokens(
                self.output, self.seen, token_ids[split:], in_place=True)
        self.tokens_counted += len(token_ids) - start
        self.num_counted = len(token_ids)


def with_output_tokens(output: torch.Tensor, seen: torch.Tensor, token_ids: Sequence[int],
                       in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`output` and `seen` with `token_ids` counted as further output tokens; copies unless
    `in_place` (speculative proposals are counted on a copy, never into the request's state)."""
    if not token_ids:
        return output, seen
    ids = _ids(token_ids, output.shape[0], output.device)
    if not in_place:
        output, seen = output.clone(), seen.clone()
    output.index_add_(0, ids, torch.ones(len(ids), dtype=output.dtype, device=output.device))
    seen[ids] = True
    return output, seen


def _ids(token_ids: Sequence[int], vocab: int, device: torch.device) -> torch.Tensor:
    return to_device([t for t in token_ids if 0 <= t < vocab], torch.long, device)
