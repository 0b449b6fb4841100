"""The per-step token bitmask of constrained requests: filled by llguidance on a helper thread
while the forward runs (it needs only the grammar states, not the logits), then applied to the
logits in one vectorized masked_fill. Steps without a constrained request never get here."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import llguidance
import llguidance.torch
import torch

from engine.sampling_params import StructuredOutput
from engine.structured.grammar import GrammarCompiler
from engine.structured.state import GrammarState

# bit b of byte k of a little-endian int32 word w allows token 32 w + 8 k + b (llguidance's
# layout); one lookup turns each mask byte into its 8 booleans.
_BYTE_BITS = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool()


@dataclass
class MaskRow:
    """One logit row to constrain: the state, and for a speculative verification the proposals
    already before it in this step (the row after proposal i sees proposals 0..i)."""

    state: GrammarState
    row: int  # index among the step's constrained-candidate logit rows
    proposals: Sequence[int] = ()


class StepMasks:
    """The bitmask of one step, being filled. `apply` waits for it (normally done long before
    the forward is)."""

    def __init__(self, future: Future, rows: list[int], eos: Sequence[int], vocab: int) -> None:
        self._future = future
        self.rows = rows  # every logit row the bitmask covers, in bitmask order
        self._eos = list(eos)
        self._vocab = vocab

    def apply(self, logits: torch.Tensor, first_row: int) -> None:
        """Mask `logits`, which hold the step's candidate rows [first_row, first_row + len)."""
        bitmask = self._future.result()
        last = first_row + logits.shape[0]
        picked = [i for i, r in enumerate(self.rows) if first_row <= r < last]
        if not picked:
            return
        index = [self.rows[i] - first_row for i in picked]
        words = bitmask[picked] if len(picked) < len(self.rows) else bitmask
        allowed = _BYTE_BITS[words.view(torch.uint8).long()].view(len(picked), -1)
        allowed = allowed[:, : logits.shape[1]].to(logits.device, non_blocking=True)
        # A row with nothing allowed (a failed state's mask) would be all -inf: offer EOS.
        empty = ~allowed.any(dim=1)
        if empty.any():
            allowed[empty.nonzero().squeeze(1).unsqueeze(1), torch.tensor(self._eos)] = True
        if len(index) == logits.shape[0]:
            logits.masked_fill_(~allowed, float("-inf"))
        else:
            at = torch.tensor(index, device=logits.device)
            logits[at] = logits[at].masked_fill(~allowed, float("-inf"))


class GrammarMasks:
    """The grammar side of a ModelRunner: compiles constraints against the model's tokenizer,
    builds each request's GrammarState and fills step bitmasks. Owned by the engine thread;
    its one mask thread only runs between `start` and the `apply` that waits for it."""

    def __init__(self, model_path: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        tokenizer_file = Path(model_path) / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(f"structured output needs the model's tokenizer.json "
                             f"({tokenizer_file} is missing)")
        self.compiler = GrammarCompiler(tokenizer_file.read_text(), vocab_size, eos_token_ids)
        self.vocab_size = vocab_size
        self.eos = [t for t in eos_token_ids if t < vocab_size]
        self._executor = llguidance.LLExecutor(num_threads=1)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        self._words = (vocab_size + 31) // 32

    def new_state(self, so: StructuredOutput, output_token_ids: Sequence[int],
                  request_id: str) -> GrammarState:
        return GrammarState(self.compiler, so, output_token_ids, request_id)

    def start(self, rows: list[MaskRow]) -> StepMasks:
        """Begin filling the masks of `rows` (call before the forward)."""
        logit_rows = [r.row + i for r in rows for i in range(len(r.proposals) + 1)]
        future = self._thread.submit(self._fill, rows)
        return StepMasks(future, logit_rows, self.eos, self.vocab_size)

    def _fill(self, rows: list[MaskRow]) -> torch.Tensor:
        bitmask = torch.full((sum(len(r.proposals) + 1 for r in rows), self._words), -1,
                             dtype=torch.int32)
        live, drafts, at = [], [], 0
        for r in rows:
            if r.state.failed is not None:
                bitmask[at : at + len(r.proposals) + 1] = 0  # apply() offers EOS only
            elif r.proposals:
                drafts.append((r.state.matcher, at, list(r.proposals)))
            else:
                live.append((r.state.matcher, at))
            at += len(r.proposals) + 1
        if live:
            llguidance.torch.fill_next_token_bitmask_par(self._executor, live, bitmask)
        if drafts:
            llguidance.torch.fill_next_token_bitmask_par_with_draft_tokens(
                self._executor, drafts, bitmask)
        return bitmask

    def close(self) -> None:
        self._thread.shutdown(wait=False)
