"""The draw of sampled rows without a sort of the vocabulary or noise for every token.

A row's token is found by inverting its filtered distribution's CDF at one uniform number
keyed by (seed, position): exact, and independent of the batch around it like the sampler's
other randomness. Top-k, top-p and min-p keep only the head of a distribution, so a row that
uses one is cut to its `topk` candidates first: a few dozen usually hold the kept set, and a
row whose set reaches past them is tried again with more (up to the whole vocabulary, which is
the full sort). The kept tokens and their probabilities are those of sampler._filter; only the
order of tokens with exactly equal probability may differ.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
DRAW_STREAM = 0xC0F  # separates this uniform from the other streams of one (seed, position)
# Candidate counts tried in turn for a truncated row; the last is the whole vocabulary.
_CANDIDATES = (64,)
_BLOCK = 256  # entries per block of the two-level search over a long row
# Bins of log probability for rows whose kept set is past the candidates (_draw_binned).
_BINS_PER_NAT = 32
_NUM_BINS = 2048  # 64 nats: the last bin holds everything below


def _mix64(z: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit integers that spreads every input bit."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def uniform_for(seed: int, position: int, stream: int = DRAW_STREAM) -> float:
    """A uniform in [0, 1) from (seed, position), the same in every process. `stream`
    separates independent uniforms of one (seed, position) (the rejection sampler's accept
    test has its own). For one (position, stream), distinct 64-bit seeds get distinct
    uniforms' bits: the seed is xored with a mix of (position, stream) and mixed again, both
    bijections. (Until December 7 it was splitmix64 of Python's int-tuple hash, which is
    modulo 2^61 - 1: seeds s and s + 2^61 - 1 drew the same text.)"""
    key = _mix64(((position & _MASK64) * 0xD1B54A32D192ED03 + stream) & _MASK64)
    z = _mix64((seed & _MASK64) ^ key)
    return (z >> 11) * (1.0 / (1 << 53))


def truncates(params: SamplingParams) -> bool:
    """Whether a row keeps only the head of its distribution (top-k, top-p or min-p)."""
    return params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0


def draw(scaled: torch.Tensor, params: Sequence[SamplingParams], uniforms: Sequence[float]) -> list[int]:
    """Tokens for rows of temperature-scaled (and penalised) logits [rows, vocab], one per
    row, each from its filtered distribution at its uniform. Host-guided, so a device's rows
    come over first, in one copy (on CUDA the Sampler draws batched unless told otherwise)."""
    scaled = scaled.cpu()
    tokens = [0] * len(params)
    full = [i for i, p in enumerate(params) if not truncates(p)]
    if full:
        index = torch.tensor(full)
        tokens_full = _invert(scaled[index].softmax(-1), [uniforms[i] for i in full])
        for i, token in zip(full, tokens_full, strict=True):
            tokens[i] = token
    pending = [i for i, p in enumerate(params) if truncates(p)]
    vocab = scaled.shape[-1]
    for count in _CANDIDATES:
        if not pending:
            break
        pending = _draw_truncated(scaled, params, uniforms, pending, min(count, vocab), tokens)
    # Rows whose kept set reaches past the candidates (a flat distribution under top-p): by
    # bins of probability rather than a sort of the vocabulary, unless they have a top-k.
    binned = [i for i in pending if not 0 < params[i].top_k < vocab]
    if binned:
        for i, token in zip(binned, _draw_binned(scaled, params, uniforms, binned), strict=True):
            tokens[i] = token
        pending = [i for i in pending if 0 < params[i].top_k < vocab]
    if pending:
        _draw_truncated(scaled, params, uniforms, pending, vocab, tokens)
    return tokens


def _draw_truncated(scaled, params, uniforms, rows: list[int], count: int,
                    tokens: list[int]) -> list[int]:
    """Draws the rows whose kept set lies within their `count` most likely tokens (or their
    top-k, if larger); returns the rows that need more candidates."""
    vocab = scaled.shape[-1]
    logits = scaled if len(rows) == scaled.shape[0] else scaled[torch.tensor(rows)]
    top_ks = [params[i].top_k if 0 < params[i].top_k < vocab else vocab for i in rows]
    limited = [k for k in top_ks if k < vocab]
    width = min(vocab, max(count, max(limited, default=0)))
    values, ids = logits.topk(width, dim=-1)
    unlimited = torch.tensor([k == vocab for k in top_ks])
    # Each row without a top-k normalises over its whole row.
    whole_lse = logits.logsumexp(-1, keepdim=True) if len(limited) < len(rows) else None
    if limited:
        # Top-k keeps every token tied with the k-th (as _filter does): its set ends among the
        # candidates unless the last candidate ties the k-th, and then more are needed.
        ks = torch.tensor([min(k, width) for k in top_ks])
        kth = values.gather(1, (ks - 1).unsqueeze(1))
        in_top_k = (values >= kth) | unlimited.unsqueeze(1)
        top_k_inside = (values[:, -1:] < kth).squeeze(1) & ~unlimited
        lse = values.masked_fill(~in_top_k, float("-inf")).logsumexp(-1, keepdim=True)
        if whole_lse is not None:
            lse = torch.where(unlimited.unsqueeze(1), whole_lse, lse)
        probs = (values - lse).exp().masked_fill(~in_top_k, 0.0)
    else:
        top_k_inside = torch.zeros(len(rows), dtype=torch.bool)
        probs = (values - whole_lse).exp()
    min_ps = torch.tensor([params[i].min_p for i in rows], dtype=probs.dtype).unsqueeze(1)
    by_min_p = probs >= min_ps * probs[:, :1]
    top_ps = torch.tensor([params[i].top_p for i in rows], dtype=probs.dtype).unsqueeze(1)
    top_ps = _top_p_after_min_p(top_ps, min_ps, probs.masked_fill(~by_min_p, 0.0), logits,
                                whole_lse, unlimited)
    before = probs.cumsum(-1) - probs  # mass strictly ahead of each candidate
    keep = (probs > 0) & ((before < top_ps) | (top_ps >= 1.0)) & by_min_p
    # The kept set lies within the candidates when the whole top-k set does, or (without a
    # top-k) when the last candidate is dropped: every token after it is too, with more mass
    # ahead and a smaller probability.
    # A candidate list that reaches masked tokens (-inf: a grammar's mask) holds every token
    # with a probability.
    covered = (top_k_inside | (unlimited & ~keep[:, -1]) | values[:, -1].isneginf()).tolist()
    if width == vocab:
        covered = [True] * len(rows)
    done = [at for at, ok in enumerate(covered) if ok]
    if done:
        at = torch.tensor(done)
        chosen = _invert(probs[at].masked_fill(~keep[at], 0.0), [uniforms[rows[a]] for a in done])
        picked = ids[at].gather(1, torch.tensor(chosen).unsqueeze(1)).squeeze(1).tolist()
        for a, token in zip(done, picked, strict=True):
            tokens[rows[a]] = token
    return [rows[at] for at, ok in enumerate(covered) if not ok]


def _top_p_after_min_p(top_ps, min_ps, kept_by_min_p, logits, whole_lse,
                       unlimited) -> torch.Tensor:
    """Top-p as it applies to candidates' probabilities once min-p has cut (vLLM's order: top-p
    runs on the mass min-p and top-k left, renormalised): top_p times that mass, for the rows
    with both. `kept_by_min_p`: the candidates' probabilities, zero where min-p drops them; a
    row without a top-k (`unlimited`, normalised by `whole_lse`) has min-p's set counted over
    its whole vocabulary, as it may reach past its candidates."""
    both = ((top_ps < 1.0) & (min_ps > 0)).squeeze(1)
    if not bool(both.any()):
        return top_ps
    mass = kept_by_min_p.sum(-1, keepdim=True)
    whole = both & unlimited
    if bool(whole.any()):
        at = torch.nonzero(whole).squeeze(1)
        full = (logits[at] - whole_lse[at]).exp()
        floor = min_ps[at] * full.amax(-1, keepdim=True)
        mass[at] = full.masked_fill(full < floor, 0.0).sum(-1, keepdim=True)
    return torch.where(both.unsqueeze(1), top_ps * mass, top_ps)


def _draw_binned(scaled, params, uniforms, rows: list[int]) -> list[int]:
    """The draw of rows without a top-k, as _draw_truncated would make it over the whole
    vocabulary sorted by probability, without the sort. Tokens are put in bins of log
    probability (_BINS_PER_NAT to a nat below the row's most likely token), each bin's mass is
    summed, and then only two bins of a row are sorted: the one where the top-p mass runs out
    (which of its tokens are kept) and the one the draw falls in (which token it is)."""
    n = len(rows)
    logits = scaled if n == scaled.shape[0] else scaled[torch.tensor(rows)]
    probs = logits.softmax(-1)
    # Nats below the most likely token (masked tokens, -inf, land in the last bin).
    bins = (logits.amax(-1, keepdim=True) - logits).mul_(_BINS_PER_NAT).clamp_(
        max=_NUM_BINS - 1).long()
    mass = torch.zeros(n, _NUM_BINS, dtype=probs.dtype).scatter_add_(1, bins, probs).double()
    ahead = mass.cumsum(-1) - mass  # mass in the bins before each bin
    min_ps = torch.tensor([params[i].min_p for i in rows], dtype=probs.dtype).unsqueeze(1)
    keep = (probs > 0) & (probs >= min_ps * probs.amax(-1, keepdim=True))
    # Top-p: the last bin whose mass ahead is below top_p holds the edge; the bins before it
    # are kept, those after dropped, and its own tokens kept while the mass ahead of them is.
    # Its mass is what min-p left (min-p drops a suffix of the order: the bins ahead of any
    # kept token hold only kept tokens, but for the bin where min-p's floor falls).
    top_ps = torch.tensor([params[i].top_p for i in rows], dtype=torch.float64).unsqueeze(1)
    top_ps = torch.where((top_ps < 1.0) & (min_ps > 0),
                         top_ps * (probs * keep).sum(-1, keepdim=True, dtype=torch.float64), top_ps)
    edge = (torch.searchsorted(ahead, top_ps, right=False) - 1).clamp(min=0)
    truncated = (top_ps < 1.0).squeeze(1)
    edge = torch.where(truncated.unsqueeze(1), edge, _NUM_BINS - 1)
    keep &= bins <= edge
    at_edge = torch.nonzero((bins == edge) & truncated.unsqueeze(1))
    if len(at_edge):
        counts = torch.bincount(at_edge[:, 0], minlength=n).tolist()
        edge_ahead = ahead.gather(1, edge).squeeze(1).tolist()
        for r, cols in zip(range(n), at_edge[:, 1].split(counts), strict=True):
            if not len(cols):
                continue
            p_sorted, order = probs[r, cols].sort(descending=True, stable=True)
            before = edge_ahead[r] + p_sorted.double().cumsum(0) - p_sorted.double()
            keep[r, cols[order[before >= float(top_ps[r])]]] = False
    # The draw: the bin where the kept mass passes u times the total, then the token in it.
    kept = probs * keep
    kept_mass = torch.zeros(n, _NUM_BINS, dtype=kept.dtype).scatter_add_(1, bins, kept).double()
    kept_cdf = kept_mass.cumsum(-1)
    target = torch.tensor(uniforms, dtype=torch.float64)[torch.tensor(rows)].unsqueeze(1) \
        * kept_cdf[:, -1:]
    chosen_bin = torch.searchsorted(kept_cdf, target, right=True).clamp(max=_NUM_BINS - 1)
    chosen_bin = chosen_bin.squeeze(1).tolist()
    for r in range(n):
        while float(kept_mass[r, chosen_bin[r]]) <= 0:  # the target rounded to or past the total
            chosen_bin[r] -= 1
    chosen = torch.tensor(chosen_bin).unsqueeze(1)
    in_bin = torch.nonzero((bins == chosen) & keep)
    counts = torch.bincount(in_bin[:, 0], minlength=n).tolist()
    bin_ahead = (kept_cdf.gather(1, chosen) - kept_mass.gather(1, chosen)).squeeze(1).tolist()
    tokens = []
    for r, cols in zip(range(n), in_bin[:, 1].split(counts), strict=True):
        p_sorted, order = kept[r, cols].sort(descending=True, stable=True)
        cdf = bin_ahead[r] + p_sorted.double().cumsum(0)
        at = min(int(torch.searchsorted(cdf, target[r], right=True)), len(cols) - 1)
        tokens.append(int(cols[order[at]]))
    return tokens


def _invert(probs: torch.Tensor, uniforms: Sequence[float]) -> list[int]:
    """Index of each row's draw (invert_index), as a list."""
    u = torch.tensor(uniforms, dtype=torch.float64, device=probs.device)
    return _kept(probs, invert_index(probs, u).tolist())


def invert_index(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index of each row's draw: the first whose cumulative mass passes u (float64 [rows])
    times the row's total; an index may land on a zero-probability entry when the target
    rounds to or past a total (_kept and sampling_batched.kept_index move it). A long row is
    searched in two levels, blocks of _BLOCK entries and then one block, so no cumulative sum
    runs over the whole vocabulary."""
    rows, width = probs.shape
    if width <= _BLOCK:
        cdf = probs.double().cumsum(-1)
        index = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
        return index.clamp(max=width - 1)
    pad = -width % _BLOCK
    blocks = torch.nn.functional.pad(probs, (0, pad)).view(rows, -1, _BLOCK)
    block_cdf = blocks.sum(-1, dtype=torch.float64).cumsum(-1)
    target = (u * block_cdf[:, -1]).unsqueeze(1)
    block = torch.searchsorted(block_cdf, target, right=True).clamp(max=blocks.shape[1] - 1)
    ahead = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    inner = blocks[torch.arange(rows, device=probs.device), block.squeeze(1)].double().cumsum(-1)
    within = torch.searchsorted(inner, target - ahead, right=True).clamp(max=_BLOCK - 1)
    return (block * _BLOCK + within).squeeze(1).clamp(max=width - 1)


def _kept(probs: torch.Tensor, index: list[int]) -> list[int]:
    """`index`, except that an entry of zero probability (the target rounded to or past a
    total) becomes the last kept entry before it."""
    for row, i in enumerate(index):
        if probs[row, i] <= 0:
            kept = torch.nonzero(probs[row, : i + 1])
            index[row] = int(kept.max()) if len(kept) else int(torch.nonzero(probs[row]).min())
    return index
