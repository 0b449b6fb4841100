"""The per-step token masks of constrained requests: llguidance's bitmask, unpacked into an
additive bias (0 or -inf per token), all built on a helper thread while the forward runs (it
needs only the grammar states, not the logits); the step then pays one vectorized add on the
logits. On CUDA the bitmask goes to the device (pinned, without a wait) and is unpacked there:
32 times fewer bytes cross than the bias's. Steps without a constrained request never get
here."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import llguidance
import torch

from engine.sampling_params import StructuredOutput
from engine.step_inputs import to_device
from engine.step_threads import set_team_threads
from engine.structured.grammar import GrammarCompiler
from engine.structured.state import GrammarState

# bit b of byte k of a little-endian int32 word w allows token 32 w + 8 k + b (llguidance's
# layout); one lookup (an embedding of the 256 byte values) turns each byte into 8 biases.
_BYTE_BITS = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool()
_BIAS_TABLES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def bias_from_bitmask(bitmask: torch.Tensor, vocab_size: int, dtype: torch.dtype) -> torch.Tensor:
    """[rows, words] int32 bitmask -> [rows, vocab_size] bias: 0 where allowed, else -inf, on
    the bitmask's device."""
    key = (dtype, bitmask.device)
    table = _BIAS_TABLES.get(key)
    if table is None:  # [256, 8]: the biases of a byte's 8 tokens (a benign race: same value)
        table = _BIAS_TABLES[key] = torch.zeros(_BYTE_BITS.shape, dtype=dtype).masked_fill_(
            ~_BYTE_BITS, float("-inf")).to(bitmask.device)
    bias = torch.nn.functional.embedding(bitmask.view(torch.uint8).long(), table)
    return bias.view(bitmask.shape[0], -1)[:, :vocab_size]


def _signed_bit(bit: int) -> int:
    """1 << bit as an int32 value (bit 31 is the sign)."""
    return (1 << bit) - (1 << 32 if bit == 31 else 0)


@dataclass
class MaskRow:
    """One logit row to constrain: the state, and for a speculative verification the proposals
    already before it in this step (the row after proposal i sees proposals 0..i)."""

    state: GrammarState
    row: int  # the first of its rows in its group's logits
    proposals: Sequence[int] = ()


@dataclass
class MaskGroup:
    """The constrained rows of one logits tensor of the step (verifications, or samples)."""

    num_rows: int  # rows of that logits tensor, constrained or not
    rows: list[MaskRow]


class StepMasks:
    """The masks of one step, being built on the mask thread as additive biases (0 or -inf)
    in the logits' dtype, so the step itself pays one add. `apply` waits for them (normally
    done long before the forward is)."""

    def __init__(self, future: Future) -> None:
        self._future = future

    def apply(self, logits: torch.Tensor, group: str) -> None:
        built = self._future.result().get(group)
        if built is None:
            return
        index, bias = built
        bias = bias if bias.dtype == logits.dtype else bias.to(logits.dtype)
        if index is None:
            logits.add_(bias)
        else:
            logits.index_add_(0, index, bias)


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
        # One thread of its own for torch work too: at its first parallel op a thread takes
        # torch's process-wide count, and a second team of two beside the engine thread's left
        # a 2-core worker with more OpenMP threads than cores, so GNU OpenMP stopped spinning
        # at barriers and every later batch-1 step took 24 ms instead of 13 (set_team_threads).
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask",
                                          initializer=set_team_threads, initargs=(1,))
        self._words = (vocab_size + 31) // 32

    def warm(self, dtype: torch.dtype, device: torch.device) -> None:
        """Builds what the first constrained request would otherwise wait for: the tokenizer
        (about 0.3 s and 54 MiB for a 49k vocabulary), a matcher, the mask and torch threads,
        the bias table; through one mask of a one-character regex."""
        state = self.new_state(StructuredOutput(regex="a"), (), "structured-outputs-warm-up")
        masks = self.start({"sample": MaskGroup(1, [MaskRow(state, 0)])}, dtype, device)
        masks.apply(torch.zeros(1, self.vocab_size, dtype=dtype, device=device), "sample")

    def new_state(self, so: StructuredOutput, output_token_ids: Sequence[int],
                  request_id: str) -> GrammarState:
        return GrammarState(self.compiler, so, output_token_ids, request_id)

    def start_step(self, verify: list[tuple[GrammarState | None, Sequence[int]]],
                   sample: list[GrammarState | None], dtype: torch.dtype,
                   device: torch.device) -> StepMasks | None:
        """Begin the masks of a step's two logits tensors: the verifications' rows (each
        request's [last token, proposals...]) and the samples' (one per request); None
        (unconstrained) states are left alone. None when nothing in the step is constrained."""
        verify_group, at = MaskGroup(sum(len(p) + 1 for _, p in verify), []), 0
        for state, proposals in verify:
            if state is not None:
                verify_group.rows.append(MaskRow(state, at, proposals))
            at += len(proposals) + 1
        sample_group = MaskGroup(len(sample), [MaskRow(state, at) for at, state
                                               in enumerate(sample) if state is not None])
        if not verify_group.rows and not sample_group.rows:
            return None
        return self.start({"verify": verify_group, "sample": sample_group}, dtype, device)

    def start(self, groups: dict[str, MaskGroup], dtype: torch.dtype,
              device: torch.device) -> StepMasks:
        """Begin building the masks of `groups` (call before the forward)."""
        return StepMasks(self._thread.submit(self._build, groups, dtype, device))

    def _build(self, groups: dict[str, MaskGroup], dtype: torch.dtype, device: torch.device):
        built = {}
        for name, group in groups.items():
            if not group.rows:
                continue
            bitmask = self._fill(group.rows)
            # A row with nothing allowed (a failed state's) would be all -inf: offer EOS.
            for row in (bitmask == 0).all(dim=1).nonzero().flatten().tolist():
                for token in self.eos:
                    bitmask[row, token // 32] |= _signed_bit(token % 32)
            if device.type == "cuda":  # the bitmask (1 bit a token) crosses, not the bias
                bitmask = bitmask.pin_memory().to(device, non_blocking=True)
            bias = bias_from_bitmask(bitmask, self.vocab_size, dtype).to(device)
            rows = [r.row + i for r in group.rows for i in range(len(r.proposals) + 1)]
            index = None
            if rows != list(range(group.num_rows)):
                index = to_device(rows, torch.long, device)
            built[name] = (index, bias)
        return built

    def _fill(self, rows: list[MaskRow]) -> torch.Tensor:
        # The executor writes straight into the bitmask (contiguous int32 on the CPU, one row
        # of self._words words per mask). Not through llguidance.torch: importing it imports
        # torch._dynamo, 1.6 s on the engine thread at the first constrained step, which
        # stalled every stream then, and taught the gateway's TTFT line a 2-3 s first token.
        bitmask = torch.full((sum(len(r.proposals) + 1 for r in rows), self._words), -1,
                             dtype=torch.int32)
        live, drafts, at = [], [], 0
        for r in rows:
            if r.state.failed is not None:
                bitmask[at : at + len(r.proposals) + 1] = 0  # EOS only (_build)
            elif r.proposals:
                drafts.append((r.state.matcher, at, list(r.proposals)))
            else:
                live.append((r.state.matcher, at))
            at += len(r.proposals) + 1
        if live:
            self._executor.unsafe_compute_mask_ptr(live, bitmask.data_ptr(), self._words * 4,
                                                   len(bitmask))
        if drafts:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(
                drafts, bitmask.data_ptr(), self._words * 4, len(bitmask))
        return bitmask
