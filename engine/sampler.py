"""Turns logits into tokens: penalties, temperature, top-k/top-p/min-p, seeded sampling,
logprobs. Randomness belongs to the request: a sampled token inverts its filtered distribution
at a uniform keyed by (seed, position) (sampling_draw), so batch composition and the worker that
samples do not change the draw (the logits, in bfloat16, can move with the batch's shape)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.outputs import Logprobs
from engine.sampling_batched import draw_batched
from engine.sampling_draw import draw, truncates, uniform_for
from engine.sampling_params import SamplingParams
from engine.step_inputs import StepInputs, fetch, to_device
from engine.token_counts import TokenCounts, with_output_tokens
from kernels import cpu_kernels


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
    """Penalties of one row, in place on its logits [vocab]."""
    _apply_penalties_to_rows(logits[None], [row], [0])

def _penalty_counts(row: SamplingRow, vocab: int, device: torch.device):
    counts = row.counts if row.counts is not None else TokenCounts()
    counts.update(row.token_ids, row.num_prompt_tokens, vocab, device)
    output, seen = counts.output, counts.seen
    if row.pending_token_ids:
        output, seen = with_output_tokens(output, seen, row.pending_token_ids)
    return output, seen


def _apply_penalties_to_rows(logits: torch.Tensor, rows: Sequence[SamplingRow],
                             index: Sequence[int]) -> None:
    """Penalties of rows[j] on logits[index[j]], in place, for all of them in a few batched ops
    (no per-row lookup of the seen ids). A row's neutral penalty (1.0 or 0) leaves its logits
    bit for bit as they were: x / 1.0, x * 1.0 and x - 0.0 are x."""
    vocab, device = logits.shape[-1], logits.device
    counted = [_penalty_counts(row, vocab, device) for row in rows]
    output = torch.stack([c[0] for c in counted])
    seen = torch.stack([c[1] for c in counted])
    at = to_device(list(index), torch.long, device)
    sub = logits[at]

    def column(values):
        return to_device(values, sub.dtype, device).unsqueeze(1)

    rep = column([r.params.repetition_penalty for r in rows])
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    frequency = column([r.params.frequency_penalty for r in rows])
    presence = column([r.params.presence_penalty for r in rows])
    sub -= frequency * output + presence * (output > 0)
    logits[at] = sub


class LogitProcessing:
    """The logit processing of SamplingParams (allowed_token_ids, then logit_bias, then the
    min_tokens ban of EOS and stop_token_ids, then bad words), row by row in place: few requests ask for it,
    and those that do are not batched with each other. A row that the bans would leave without
    a single token (an allowed set of stop tokens only, under min_tokens) keeps the allowed set
    and the bias without the bans, as vLLM does: the request ends, where it used to take a token
    outside its allowed set. A row left with none even so (a bias of -inf on every allowed
    token) keeps its logits as they were: the grammar (or the model) picks."""

    _CACHE_LIMIT = 256

    def __init__(self, eos_token_ids: Sequence[int] = ()) -> None:
        self.eos_token_ids = tuple(eos_token_ids)
        # id(params) -> (params, allowed ids, bias ids, bias values): one conversion a request.
        self._tensors: dict[int, tuple] = {}

    def apply(self, logits: torch.Tensor, rows: Sequence[SamplingRow],
              index: Sequence[int]) -> None:
        for i in index:
            self._apply_row(logits[i], rows[i])

    def _apply_row(self, x: torch.Tensor, row: SamplingRow) -> None:
        params = row.params
        allowed, bias_ids, bias = self._of(params, x.device, x.dtype)
        before = x.clone()
        if allowed is not None:
            kept = x[allowed]
            x.fill_(float("-inf"))
            x[allowed] = kept
        if bias_ids is not None:
            x[bias_ids] += bias
        banned = []
        if params.min_tokens and row.position - row.num_prompt_tokens < params.min_tokens:
            banned += [*params.stop_token_ids, *(() if params.ignore_eos else self.eos_token_ids)]
        if params.bad_words_token_ids:
            banned += _bad_word_ends(params.bad_words_token_ids, row)
        if banned:
            banned_ids = torch.tensor(banned, device=x.device)
            shaped = x[banned_ids]  # what the bans take, given back if they take everything
            x[banned_ids] = float("-inf")
        if not torch.isfinite(x.max()):
            if banned:
                x[banned_ids] = shaped
            if not torch.isfinite(x.max()):
                x.copy_(before)

    def _of(self, params: SamplingParams, device: torch.device, dtype: torch.dtype):
        cached = self._tensors.get(id(params))
        if cached is None or cached[0] is not params or cached[3].dtype != dtype:
            if len(self._tensors) >= self._CACHE_LIMIT:
                self._tensors.clear()
            allowed = (torch.tensor(params.allowed_token_ids, device=device)
                       if params.allowed_token_ids else None)
            ids = (torch.tensor([t for t, _ in params.logit_bias], device=device)
                   if params.logit_bias else None)
            values = torch.tensor([b for _, b in params.logit_bias], dtype=dtype, device=device)
            cached = self._tensors[id(params)] = (params, allowed, ids, values)
        return cached[1], cached[2], cached[3]


def _bad_word_ends(sequences: Sequence[tuple[int, ...]], row: SamplingRow) -> list[int]:
    """The last token of every sequence whose other tokens end the row's output so far."""
    out = row.token_ids[row.num_prompt_tokens:]
    if row.pending_token_ids:
        out = [*out, *row.pending_token_ids]
    banned = []
    for sequence in sequences:
        before = len(sequence) - 1
        if before == 0 or (before <= len(out) and tuple(out[len(out) - before:]) == sequence[:-1]):
            banned.append(sequence[-1])
    return banned


def _filter(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Min-p, top-k, then top-p on temperature-scaled logits, in vLLM's order: min-p against
    the most likely token, top-k, then top-p on the mass left by the two (renormalised over
    it). Returns probabilities that sum to 1 over the kept tokens (the rejection sampler uses
    them as p and q, not only as weights for a draw)."""
    device = logits.device
    min_ps = [r.params.min_p for r in rows]
    if any(m > 0 for m in min_ps):
        probs = logits.softmax(dim=-1)
        ms = to_device(min_ps, probs.dtype, device).unsqueeze(1)
        logits = logits.masked_fill(probs < ms * probs.max(dim=-1, keepdim=True).values,
                                    float("-inf"))
    top_ks = [r.params.top_k for r in rows]
    if any(k > 0 for k in top_ks):
        vocab = logits.shape[-1]
        ks_list = [k if 0 < k < vocab else vocab for k in top_ks]
        ks, kmax = to_device(ks_list, torch.long, device), max(ks_list)
        top = logits.topk(kmax, dim=-1).values
        threshold = top.gather(1, (ks - 1).unsqueeze(1))
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    probs = logits.softmax(dim=-1)
    top_ps = [r.params.top_p for r in rows]
    if any(p < 1.0 for p in top_ps):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly ahead of each token
        ps = to_device(top_ps, probs.dtype, device).unsqueeze(1)
        # Rows with top_p == 1 are exempt: their float32 cumsum can reach 1.0 before the tail,
        # which would drop tail tokens only when a neighbour in the batch uses top_p.
        sorted_probs = sorted_probs.masked_fill((before >= ps) & (ps < 1.0), 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)  # the top token always survives: sum > 0
    return probs


def sampling_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The distribution each (non-greedy) row's token is drawn from: penalties, temperature,
    then top-k/top-p/min-p, as float32 [rows, vocab]. Speculative verification needs it whole."""
    logits = logits.float().clone()
    penalised = [i for i, r in enumerate(rows) if r.params.needs_penalties]
    if penalised:
        _apply_penalties_to_rows(logits, [rows[i] for i in penalised], penalised)
    temps = to_device([r.params.temperature for r in rows], torch.float32, logits.device)
    return _filter(logits / temps.unsqueeze(1), rows)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first of equal maxima, as argmax picks): on a CPU with the C++
    kernels loaded, torch.ops.splitserve_cpu.greedy_argmax (kernels/cpu/greedy_argmax.cpp),
    about 9x faster than max(dim).indices on SmolLM2's rows; elsewhere max(dim).indices, which
    takes about a third of argmax's time (`python bench/greedy_pick.py` measures all three)."""
    if (logits.device.type == "cpu" and logits.dim() == 2 and logits.shape[1] > 0
            and logits.dtype in (torch.bfloat16, torch.float32) and cpu_kernels.loaded()):
        return torch.ops.splitserve_cpu.greedy_argmax(logits)
    return logits.max(dim=-1).indices


def draw_kernel_takes(logits: torch.Tensor) -> bool:
    """Whether the C++ draw (kernels/cpu/sample_draw.cpp) takes these logits: on a CPU with
    the kernels loaded, [rows, vocab] bf16 or float32."""
    return (logits.device.type == "cpu" and logits.dim() == 2 and logits.shape[1] > 0
            and logits.dtype in (torch.bfloat16, torch.float32) and cpu_kernels.loaded())


def draw_kernel(logits: torch.Tensor, index: torch.Tensor, params: Sequence[SamplingParams],
                uniforms: Sequence[float]) -> torch.Tensor:
    """sampling_draw.draw of logits[index] / temperature as one C++ op: the same tokens but
    for float rounding and the order of exactly equal probabilities. On SmolLM2's rows, 8-256
    of them, 4-14x faster without a cut, 4-9x with a top-p or min-p, 2-3x with a top-k
    (`python bench/sample_draw.py`)."""
    def column(values, dtype):
        return torch.tensor(values, dtype=dtype)

    return torch.ops.splitserve_cpu.sample_draw(
        logits, index, column([p.temperature for p in params], torch.float32),
        column([p.top_k for p in params], torch.long),
        column([p.top_p for p in params], torch.float32),
        column([p.min_p for p in params], torch.float32), column(uniforms, torch.float64))


class Sampler:
    """Owned by the engine thread. `batched`: draw every row in tensor ops and fetch the step's
    results with one wait (sampling_batched; None: on CUDA, where each host round trip is a
    sync), else the host-guided draw (sampling_draw), cheaper on a CPU."""

    def __init__(self, batched: bool | None = None, eos_token_ids: Sequence[int] = ()) -> None:
        self.batched = batched
        self._settings: StepInputs | None = None  # per-row settings for the batched draw
        self.processing = LogitProcessing(eos_token_ids)

    def __call__(
        self, logits: torch.Tensor, rows: list[SamplingRow]
    ) -> tuple[list[int], list[Logprobs | None]]:
        batched = logits.is_cuda if self.batched is None else self.batched
        if not batched and all(r.params.greedy and r.params.logprobs is None
                               and not r.params.needs_penalties
                               and not r.params.needs_logit_processing for r in rows):
            # Argmaxes only: of the logits as computed (bf16 on such a CPU; the float32 copy
            # would change no pick), with no other pass over them.
            return greedy_tokens(logits).tolist(), [None] * len(rows)
        # Logprobs are of the model's distribution (before penalties), for the rows that ask.
        asked = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        penalised = [i for i, r in enumerate(rows) if r.params.needs_penalties]
        processed = [i for i, r in enumerate(rows) if r.params.needs_logit_processing]
        kernel = not batched and draw_kernel_takes(logits)
        if not kernel or asked or penalised or processed:
            # The kernel reads the logits as computed (bf16 here), as float32 values.
            logits = logits.float()
        raw_logprobs = None
        if asked:
            whole = batched or len(asked) == len(rows)  # a gather's index would cost a copy
            raw_logprobs = (logits if whole else logits[asked]).log_softmax(-1)
        if penalised or processed:
            logits = logits.clone()
        if processed:  # before the penalties, as vLLM applies them
            self.processing.apply(logits, rows, processed)
        if penalised:
            _apply_penalties_to_rows(logits, [rows[i] for i in penalised], penalised)
        if batched:
            return self._sample_batched(logits, rows, asked, raw_logprobs)
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if len(random_rows) < len(rows):
            tokens = greedy_tokens(logits)
        else:  # no greedy row: skip a pass over the logits
            tokens = torch.zeros(len(rows), dtype=torch.long, device=logits.device)
        if random_rows:
            subset = [rows[i] for i in random_rows]
            index = torch.tensor(random_rows, device=logits.device)
            uniforms = [uniform_for(r.seed, r.position) for r in subset]
            if kernel:
                tokens[index] = draw_kernel(logits, index, [r.params for r in subset], uniforms)
            else:
                temps = torch.tensor([r.params.temperature for r in subset], device=logits.device)
                scaled = logits if len(subset) == len(rows) else logits[index]
                drawn = draw(scaled / temps.unsqueeze(1), [r.params for r in subset], uniforms)
                tokens[index] = torch.tensor(drawn, device=logits.device)
        token_list = tokens.tolist()
        logprobs: list[Logprobs | None] = [None] * len(rows)
        if asked:
            found = batch_logprobs(raw_logprobs, [token_list[i] for i in asked],
                                   [rows[i].params.logprobs for i in asked])
            for i, one in zip(asked, found, strict=True):
                logprobs[i] = one
        return token_list, logprobs

    def _sample_batched(self, logits, rows, asked, raw_logprobs):
        """Every row drawn in tensor ops (greedy rows take the argmax); the tokens and the
        asked logprobs of all rows come back in one fetch."""
        greedy = [r.params.greedy for r in rows]
        if self._settings is None or self._settings.device != logits.device:
            self._settings = StepInputs(logits.device, torch.float64)
        temps, top_k, top_p, min_p, uniforms, is_greedy = self._settings.pack([
            [1.0 if g else r.params.temperature for g, r in zip(greedy, rows, strict=True)],
            [r.params.top_k for r in rows], [r.params.top_p for r in rows],
            [r.params.min_p for r in rows],
            [0.0 if g else uniform_for(r.seed, r.position) for g, r in zip(greedy, rows, strict=True)],
            [float(g) for g in greedy],
        ])
        tokens = logits.argmax(dim=-1) if any(greedy) else None
        sampled = [r.params for g, r in zip(greedy, rows, strict=True) if not g]
        if sampled:
            truncating = [truncates(p) for p in sampled]
            drawn = draw_batched(logits / temps.float().unsqueeze(1), top_k.long(), top_p.float(),
                                 min_p.float(), uniforms, any_truncated=any(truncating),
                                 any_full=not all(truncating))
            tokens = drawn if tokens is None else torch.where(is_greedy > 0, tokens, drawn)
        if not asked:
            return fetch(tokens)[0], [None] * len(rows)
        most = max(rows[i].params.logprobs for i in asked)
        host = fetch(tokens, *logprob_tensors(raw_logprobs, tokens, most))
        found = assemble_logprobs([[part[i] for i in asked] for part in host[1:]],
                                  [rows[i].params.logprobs for i in asked])
        logprobs: list[Logprobs | None] = [None] * len(rows)
        for i, one in zip(asked, found, strict=True):
            logprobs[i] = one
        return host[0], logprobs


def batch_logprobs(row_logprobs: torch.Tensor, tokens: Sequence[int],
                   ns: Sequence[int]) -> list[Logprobs]:
    """Each row's chosen token's logprob, its rank (1 = the most likely) and the row's n most
    likely alternatives, for all rows of [rows, vocab] logprobs at once: one gather, one count
    of the better tokens, one topk for the largest n asked, and one wait for the device."""
    if not ns:
        return []
    chosen = to_device(list(tokens), torch.long, row_logprobs.device)
    return assemble_logprobs(fetch(*logprob_tensors(row_logprobs, chosen, max(ns))), ns)


def logprob_tensors(row_logprobs: torch.Tensor, tokens: torch.Tensor,
                    most: int) -> list[torch.Tensor]:
    """[chosen logprob, rank] per row, then [top `most` values, their ids] when most > 0."""
    chosen = row_logprobs.gather(1, tokens.unsqueeze(1))
    parts = [chosen.squeeze(1), (row_logprobs > chosen).sum(-1) + 1]
    if most:
        parts += list(row_logprobs.topk(most, dim=-1))
    return parts


def assemble_logprobs(host: list[list], ns: Sequence[int]) -> list[Logprobs]:
    """Logprobs from logprob_tensors' results as lists (row j keeps its ns[j] alternatives)."""
    chosen, ranks = host[0], host[1]
    top_values, top_ids = (host[2], host[3]) if len(host) > 2 else (None, None)
    out = []
    for j, (logprob, rank, n) in enumerate(zip(chosen, ranks, ns, strict=True)):
        top = dict(zip(top_ids[j][:n], top_values[j][:n], strict=True)) if n else {}
        out.append(Logprobs(logprob=logprob, rank=rank, top=top))
    return out


def top_logprobs(row_logprobs: torch.Tensor, token: int, n: int) -> Logprobs:
    """batch_logprobs of one row [vocab]."""
    return batch_logprobs(row_logprobs[None], [token], [n])[0]
