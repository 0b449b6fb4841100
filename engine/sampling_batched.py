"""The draw of sampled rows as tensor ops over the whole batch, for the GPU: per-row settings
arrive as one tensor and the tokens stay on the device, so no host round trip happens before
the step's one fetch. Truncated rows (top-k, top-p, min-p) are drawn from a sort of the
vocabulary rather than from sampling_draw's candidates and bins, which save device work at
the price of host decisions, each a sync on a GPU.

The same uniforms keyed by (seed, position) and the same inversion as sampling_draw, so the
same token as the CPU path, except where a uniform falls within float rounding of a boundary
of the cumulative distribution (the sums run in another order) or two tokens' probabilities
are exactly equal (a sort may order them either way).
"""

from __future__ import annotations

import torch

from engine.sampling_draw import invert_index
from engine.step_inputs import to_device


def draw_batched(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor, uniforms: torch.Tensor, *, any_truncated: bool,
                 any_full: bool) -> torch.Tensor:
    """Tokens [rows] (long, on the device) for temperature-scaled, penalised logits [rows,
    vocab] (float32). top_k [rows] long (0: off), top_p and min_p [rows] float32, uniforms
    [rows] float64. any_truncated / any_full: whether some row uses top-k, top-p or min-p /
    whether some row uses none (the caller knows from the requests' settings: the path no row
    takes is skipped)."""
    truncates = (top_k > 0) | (top_p < 1.0) | (min_p > 0)
    full = truncated = None
    if any_full:
        probs = scaled.softmax(-1)
        full = kept_index(probs, invert_index(probs, uniforms))
    if any_truncated:
        truncated = _draw_sorted(scaled, top_k, top_p, min_p, uniforms)
    if full is None or truncated is None:
        return full if truncated is None else truncated
    return torch.where(truncates, truncated, full)


def _draw_sorted(scaled, top_k, top_p, min_p, uniforms) -> torch.Tensor:
    """sampling_draw._draw_truncated over the whole vocabulary (its widest pass, which needs
    no second try), with each row's settings as tensors."""
    vocab = scaled.shape[-1]
    values, ids = scaled.sort(dim=-1, descending=True)
    limited = ((top_k > 0) & (top_k < vocab)).unsqueeze(1)
    k = torch.where(limited.squeeze(1), top_k, vocab)
    # Top-k keeps every token tied with the k-th, as sampler._filter does.
    in_top_k = (values >= values.gather(1, (k - 1).unsqueeze(1))) | ~limited
    lse = torch.where(limited, values.masked_fill(~in_top_k, float("-inf")).logsumexp(-1, True),
                      scaled.logsumexp(-1, keepdim=True))
    probs = (values - lse).exp().masked_fill(~in_top_k, 0.0)
    top_p, min_p = top_p.unsqueeze(1), min_p.unsqueeze(1)
    by_min_p = probs >= min_p * probs[:, :1]
    # Top-p runs on the mass min-p and top-k left (vLLM's order), renormalised over it.
    kept_by_min_p = probs.masked_fill(~by_min_p, 0.0).sum(-1, keepdim=True)
    top_p = torch.where((min_p > 0) & (top_p < 1.0), top_p * kept_by_min_p, top_p)
    before = probs.cumsum(-1) - probs  # mass strictly ahead of each token
    keep = (probs > 0) & ((before < top_p) | (top_p >= 1.0)) & by_min_p
    kept = probs.masked_fill(~keep, 0.0)
    chosen = kept_index(kept, invert_index(kept, uniforms))
    return ids.gather(1, chosen.unsqueeze(1)).squeeze(1)


def draw_from(probs: torch.Tensor, uniforms: list[float]) -> torch.Tensor:
    """Each row's token from a given distribution ([rows, vocab], any scale) at its uniform, on
    the distribution's device: the speculative paths' draws (a draft's sample, a residual, a
    bonus token), the same on every device for the same uniforms."""
    u = to_device(uniforms, torch.float64, probs.device)
    return kept_index(probs, invert_index(probs, u))


def kept_index(probs: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """sampling_draw._kept without a host loop: an index on a zero-probability entry becomes
    the last kept entry before it (the first kept entry if none is before it)."""
    width = probs.shape[-1]
    cols = torch.arange(width, device=probs.device)
    nonzero = probs > 0
    last_before = torch.where(nonzero & (cols <= index.unsqueeze(1)), cols, -1).amax(-1)
    # A row with no mass at all (never, from finite logits) still gets an id in the vocabulary.
    first = torch.where(nonzero, cols, width).amin(-1).clamp(max=width - 1)
    moved = torch.where(last_before >= 0, last_before, first)
    return torch.where(probs.gather(1, index.unsqueeze(1)).squeeze(1) > 0, index, moved)
