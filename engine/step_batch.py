"""One step's flat batch, as plain lists: the tokens that go through the model with their
positions and cache slots, the decode rows' block tables and context lengths, the other
sequences (prefill chunks, speculative verification), and which rows are sampled, scored
for prompt logprobs or verified. ModelRunner turns it into device tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from engine.outputs import SchedulerOutput


class RequestView(Protocol):
    """What the batch reads of a request (model_runner.CachedRequestState)."""

    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    num_prompt_tokens: int
    prompt_logprobs: list | None


@dataclass
class StepBatch:
    # (request id, tokens scheduled), in row order: decode rows first, longest context first
    order: list[tuple[str, int]]
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    decode_tables: list[list[int]] = field(default_factory=list)  # one per decode row
    decode_lens: list[int] = field(default_factory=list)  # context of each, its token included
    prefill_seqs: list[tuple[int, int, int]] = field(default_factory=list)  # (row, q_len, ctx)
    prefill_tables: list[list[int]] = field(default_factory=list)  # one per prefill sequence
    sample_rows: list[tuple[str, int]] = field(default_factory=list)  # (request id, row)
    prompt_rows: list[tuple[str, int, int]] = field(default_factory=list)  # (id, row, count)
    verify_rows: list[tuple[str, int, int]] = field(default_factory=list)  # (id, row, count)

    @property
    def max_decode_len(self) -> int:
        return max(self.decode_lens, default=0)

    @property
    def sample_rows_are_leading(self) -> bool:
        """Whether the sampled rows are rows 0..n-1 in order (a decode-only step): their
        hidden states or logits are then a slice, not a gather."""
        return all(row == i for i, (_, row) in enumerate(self.sample_rows))


def build_step_batch(sched: SchedulerOutput, requests: Mapping[str, RequestView],
                     block_size: int, verify_as_decode: bool) -> StepBatch:
    """`verify_as_decode`: a verification's k + 1 queries become decode rows, one per position,
    each reading its own context length (the C++ kernel's way: no gather, no causal mask)."""
    spec = sched.spec_token_ids

    def as_decode(rid: str, n: int) -> bool:
        return n == 1 or (verify_as_decode and rid in spec)

    # Single-token requests first, longest context first: they take the batched decode
    # path, in groups of similar context length (kernels.attention.plan_decode_groups).
    order = sorted(
        sched.num_scheduled_tokens.items(),
        key=lambda kv: (not as_decode(*kv),
                        -requests[kv[0]].num_computed_tokens if as_decode(*kv) else 0),
    )
    batch = StepBatch(order=order)
    bs = block_size
    for rid, n in order:
        state = requests[rid]
        start = state.num_computed_tokens
        end = start + n
        row0 = len(batch.input_ids)
        batch.input_ids.extend(state.token_ids[start:end])
        proposals = spec.get(rid) if spec else None
        if proposals:  # speculative verification: [last token, proposals...]
            batch.input_ids.extend(proposals)
        batch.positions.extend(range(start, end))
        blocks = state.block_ids
        batch.slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
        if as_decode(rid, n):
            batch.decode_tables.extend([blocks] * n)
            batch.decode_lens.extend(range(start + 1, end + 1))
        else:
            batch.prefill_seqs.append((row0, n, end))
            batch.prefill_tables.append(blocks)
        if state.prompt_logprobs is not None and start < state.num_prompt_tokens - 1:
            count = min(end, state.num_prompt_tokens - 1) - start
            batch.prompt_rows.append((rid, row0, count))
        elif state.prompt_logprobs is not None and state.num_prompt_tokens == 1 and start == 0:
            # A one-token prompt has no position to score, but its echo ([None]) is due.
            batch.prompt_rows.append((rid, row0, 0))
        if proposals:
            batch.verify_rows.append((rid, row0, n))
        elif end >= len(state.token_ids):
            batch.sample_rows.append((rid, row0 + n - 1))
    return batch
