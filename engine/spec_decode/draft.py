"""Draft-model proposer: a smaller model with the target's tokenizer drafts k tokens per
request, one batched forward per drafted token, in its own paged KV cache.

The draft's KV for a request covers the accepted tokens it has seen plus the proposals it fed
itself; after each verification it keeps only what the target accepted and catches up on the
rest (usually the target's one correction or bonus token) in the first forward of a round.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.block_pool import BlockPool, KVCacheBlock
from engine.config import ModelConfig
from engine.request import Request
from engine.sampler import SamplingRow, greedy_tokens, sampling_probs
from engine.sampling_batched import draw_from
from engine.spec_decode.draft_runner import DraftRunner, DraftSeq
from engine.spec_decode.proposer import Proposals, Proposer
from engine.spec_decode.rejection_sampler import draft_uniform
from engine.token_counts import TokenCounts


@dataclass
class _DraftState:
    blocks: list[KVCacheBlock] = field(default_factory=list)
    num_computed: int = 0  # leading tokens of the request whose draft KV is valid
    fed: list[int] = field(default_factory=list)  # proposals run after those, last round

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]


def check_same_tokenizer(draft: ModelConfig, target: ModelConfig) -> None:
    """Raise ValueError unless the draft's token ids mean what the target's mean."""
    if draft.vocab_size > target.vocab_size:
        raise ValueError(
            f"draft model vocabulary ({draft.vocab_size}) is larger than the target's "
            f"({target.vocab_size}); they must share a tokenizer"
        )
    vocabs = []
    for path in (draft.path, target.path):
        file = Path(path) / "tokenizer.json"
        if not file.is_file():
            return  # nothing to compare; vocabulary sizes had to do
        model = json.loads(file.read_text()).get("model", {})
        vocabs.append(model.get("vocab"))
    if vocabs[0] != vocabs[1]:
        raise ValueError(f"draft model {draft.path} has a different tokenizer than the target "
                         f"{target.path}")


class DraftModelProposer(Proposer):
    def __init__(self, draft_dir: str, target: ModelConfig, dtype: torch.dtype,
                 device: torch.device, num_blocks: int, block_size: int) -> None:
        self.model_config = ModelConfig.from_dir(draft_dir)
        check_same_tokenizer(self.model_config, target)
        self.block_size = block_size
        # As many blocks as the target has: every running request fits, as on the target.
        self.pool = BlockPool(num_blocks, enable_caching=False)
        self.runner = DraftRunner(self.model_config, dtype, device, num_blocks, block_size)
        self.device = device
        self._states: dict[str, _DraftState] = {}

    def propose(self, requests: list[Request], num_tokens: dict[str, int]) -> Proposals:
        work: list[tuple[Request, int, _DraftState]] = []
        for request in requests:
            k = min(num_tokens.get(request.request_id, 0),
                    self.model_config.max_position_embeddings - request.num_tokens + 1)
            if k <= 0:
                continue
            state = self._sync(request)
            if state is not None and self._reserve(state, request.num_tokens + k - 1):
                work.append((request, k, state))
            else:
                self.release([request.request_id])  # no room: no proposals this step
        proposals = Proposals()
        if not work:
            return proposals
        drafted: list[list[int]] = [[] for _ in work]
        probs: list[list[torch.Tensor]] = [[] for _ in work]
        seqs = [DraftSeq(r.all_token_ids[s.num_computed :], s.num_computed, s.block_ids)
                for r, _, s in work]
        active = list(range(len(work)))
        while active:
            logits = self.runner.forward(seqs)
            tokens, q = self._sample(logits, [work[i][0] for i in active],
                                     [drafted[i] for i in active])
            seqs, still = [], []
            for j, i in enumerate(active):
                request, k, state = work[i]
                drafted[i].append(tokens[j])
                if q is not None and q[j] is not None:
                    probs[i].append(q[j])
                if len(drafted[i]) < k:
                    position = request.num_tokens + len(drafted[i]) - 1
                    seqs.append(DraftSeq([tokens[j]], position, state.block_ids))
                    still.append(i)
            active = still
        for i, (request, _, state) in enumerate(work):
            state.num_computed = request.num_tokens
            state.fed = drafted[i][:-1]  # the last drafted token was never run
            proposals.token_ids[request.request_id] = drafted[i]
            if probs[i]:
                proposals.draft_probs[request.request_id] = torch.stack(probs[i])
        return proposals

    def _sync(self, request: Request) -> _DraftState | None:
        """Keep the draft KV that matches the request's accepted tokens. The last token is
        always rerun, because a round starts from the logits after it."""
        state = self._states.get(request.request_id)
        if state is None:
            state = self._states[request.request_id] = _DraftState()
        tokens = request.all_token_ids
        matched = 0
        for token in state.fed:
            at = state.num_computed + matched
            if at >= len(tokens) or tokens[at] != token:
                break
            matched += 1
        state.num_computed = min(state.num_computed + matched, len(tokens) - 1)
        state.fed = []
        return state

    def _reserve(self, state: _DraftState, num_tokens: int) -> bool:
        needed = -(-num_tokens // self.block_size) - len(state.blocks)
        if needed > self.pool.num_free_blocks:
            return False
        if needed > 0:
            state.blocks.extend(self.pool.allocate(needed))
        return True

    def _sample(self, logits: torch.Tensor, requests: list[Request], drafted: list[list[int]]):
        """The draft's token per row: argmax for greedy requests, else a draw from the
        draft's own filtered distribution q (returned, for the rejection rule)."""
        tokens = greedy_tokens(logits).tolist()
        sampled = [j for j, r in enumerate(requests) if not r.sampling_params.greedy]
        if not sampled:
            return tokens, None
        rows = []
        for j in sampled:
            request, params = requests[j], requests[j].sampling_params
            if request.draft_token_counts is None:
                request.draft_token_counts = TokenCounts()
            rows.append(SamplingRow(
                params=params, seed=params.seed, position=request.num_tokens + len(drafted[j]),
                token_ids=request.all_token_ids, num_prompt_tokens=request.num_prompt_tokens,
                counts=request.draft_token_counts,
                pending_token_ids=drafted[j] if params.needs_penalties else (),
            ))
        q = sampling_probs(logits[sampled], rows)
        draws = draw_from(q, [draft_uniform(r.seed, r.position) for r in rows]).tolist()
        q_rows: list[torch.Tensor | None] = [None] * len(requests)
        for row, j in enumerate(sampled):
            tokens[j] = draws[row]
            q_rows[j] = q[row]
        return tokens, q_rows

    def release(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            state = self._states.pop(rid, None)
            if state is not None and state.blocks:
                self.pool.free(reversed(state.blocks))

    def retain(self, request_ids: set[str]) -> None:
        self.release([rid for rid in self._states if rid not in request_ids])
