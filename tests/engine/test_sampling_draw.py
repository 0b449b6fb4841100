"""The sampler's draw (engine/sampling_draw.py) against the filtered distribution of
sampler._filter: on a grid of uniforms, each token is drawn as often as its probability says,
including rows whose kept set reaches past the first candidates (flat logits, ties at the top-k
threshold), and no filtered token is ever drawn."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from engine.sampler import SamplingRow, _filter
from engine.sampling_draw import draw, uniform_for
from engine.sampling_params import SamplingParams

GRID = 2000  # uniforms (j + 0.5) / GRID: each token's share is within 1 / GRID of its mass


def _logits(kind: str, vocab: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(7)
    if kind == "peaked":  # a language model's usual shape: a few likely tokens, a long tail
        logits = torch.randn(vocab, generator=generator)
        logits[:5] += torch.tensor([9.0, 8.0, 7.5, 6.0, 5.0])
        return logits
    if kind == "flat":  # the kept set reaches past every candidate count but the last
        return torch.randn(vocab, generator=generator) * 0.05
    if kind == "ties":  # 100 tokens tied at the top: a top-k below 100 keeps all of them
        logits = torch.randn(vocab, generator=generator) - 5
        logits[200:300] = 3.0
        return logits
    if kind == "masked":  # a grammar's mask: 10 tokens allowed, the rest -inf
        logits = torch.full((vocab,), float("-inf"))
        logits[100:110] = torch.randn(10, generator=generator)
        return logits
    raise ValueError(kind)


CASES = [
    ("peaked", dict(temperature=0.8, top_p=0.95)),
    ("peaked", dict(temperature=1.0)),
    ("peaked", dict(temperature=0.7, top_k=50)),
    ("peaked", dict(temperature=1.0, min_p=0.05)),
    ("peaked", dict(temperature=1.2, top_k=40, top_p=0.9, min_p=0.01)),
    ("flat", dict(temperature=1.0, top_p=0.99)),
    ("flat", dict(temperature=1.0, top_k=2000)),
    ("flat", dict(temperature=1.0, min_p=0.9)),
    ("flat", dict(temperature=1.0, top_p=0.5, min_p=0.9)),  # top-p on min-p's mass: past 64
    ("ties", dict(temperature=1.0, top_k=10)),
    ("ties", dict(temperature=1.0, top_k=10, top_p=0.5)),
    ("masked", dict(temperature=1.0, top_k=50)),
    ("masked", dict(temperature=0.8, top_p=0.95)),
    ("masked", dict(temperature=1.0)),
]


@pytest.mark.parametrize(("kind", "params"), CASES, ids=[f"{k}-{p}" for k, p in CASES])
def test_draws_follow_the_filtered_distribution(kind, params):
    vocab = 3000
    logits = _logits(kind, vocab)
    sampling = SamplingParams(max_tokens=1, **params)
    scaled = logits / sampling.temperature
    expected = _filter(scaled[None].clone(), [SamplingRow(sampling, 0, 0, [], 0)])[0].double()
    uniforms = [(j + 0.5) / GRID for j in range(GRID)]
    tokens = draw(scaled[None].expand(GRID, vocab), [sampling] * GRID, uniforms)
    counts = torch.bincount(torch.tensor(tokens), minlength=vocab).double() / GRID
    if kind == "ties" and "top_p" in params:
        # Which 50 of the 100 tied tokens top-p keeps depends on the order ties are sorted in,
        # which draw (topk) and _filter (sort) need not share: only the shares are compared.
        assert set(tokens) <= set(range(200, 300)) and len(set(tokens)) == 50
        assert float((counts[counts > 0] - 1 / 50).abs().max()) <= 1.0 / GRID + 1e-9
        return
    assert set(tokens) <= set(torch.nonzero(expected).flatten().tolist()), "a filtered token was drawn"
    worst = float((counts - expected).abs().max())
    assert worst <= 1.0 / GRID + 1e-9, (kind, params, worst)
    if kind == "ties" and "top_p" not in params:
        assert len(set(tokens)) == 100, "ties at the top-k threshold are kept"


def test_a_batch_mixing_truncated_and_full_rows_draws_each_as_alone():
    vocab = 3000
    rows = [
        (_logits("peaked", vocab), SamplingParams(max_tokens=1, temperature=0.8, top_p=0.95)),
        (_logits("flat", vocab), SamplingParams(max_tokens=1, temperature=1.0, top_p=0.99)),
        (_logits("ties", vocab), SamplingParams(max_tokens=1, top_k=10)),
        (_logits("peaked", vocab), SamplingParams(max_tokens=1, temperature=1.0)),
    ]
    for u in (0.01, 0.37, 0.5, 0.93, 0.999):
        together = draw(torch.stack([r[0] for r in rows]), [r[1] for r in rows], [u] * len(rows))
        alone = [draw(logits[None], [params], [u])[0] for logits, params in rows]
        assert together == alone, u


def test_the_uniform_is_in_range_and_the_same_in_another_process():
    values = [uniform_for(seed, position) for seed in range(50) for position in range(50)]
    assert all(0.0 <= v < 1.0 for v in values)
    assert len(set(values)) == len(values)
    assert 0.45 < sum(values) / len(values) < 0.55
    code = "from engine.sampling_draw import uniform_for; print(repr(uniform_for(2024, 17)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert float(out.stdout) == uniform_for(2024, 17)


class TopkWidths(TorchFunctionMode):
    """Records the width of every topk call made inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.widths: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") == "topk":
            self.widths.append(args[1] if len(args) > 1 else kwargs["k"])
        return func(*args, **(kwargs or {}))


def test_a_masked_row_is_drawn_from_its_first_candidates_not_a_sort_of_the_vocabulary():
    vocab = 3000
    with TopkWidths() as recorded:
        draw(_logits("masked", vocab)[None], [SamplingParams(max_tokens=1, top_k=50)], [0.5])
    assert recorded.widths == [64]


def test_a_flat_top_p_row_is_drawn_from_bins_not_a_sort_of_the_vocabulary():
    vocab = 3000
    with TopkWidths() as recorded:
        draw(_logits("flat", vocab)[None], [SamplingParams(max_tokens=1, top_p=0.99)], [0.5])
    assert recorded.widths == [64]


@pytest.mark.parametrize("params", [dict(top_p=0.99), dict(top_p=0.9, min_p=0.5),
                                    dict(top_p=0.5, min_p=0.05),
                                    dict(min_p=0.95), dict(temperature=0.7, top_p=0.95)])
def test_the_binned_draw_picks_the_token_the_sorted_draw_picks(params):
    """The same token as inverting over the whole vocabulary sorted by probability, on a grid
    of uniforms, except where two tokens' probabilities agree to float rounding (the two
    paths compute them in another order, and then may sort them the other way round)."""
    from engine.sampling_draw import _draw_binned, _draw_truncated

    vocab = 3000
    sampling = SamplingParams(max_tokens=1, **params)
    scaled = (_logits("flat", vocab) * 20 / sampling.temperature)[None].expand(GRID, vocab)
    uniforms = [(j + 0.5) / GRID for j in range(GRID)]
    sorted_tokens = [0] * GRID
    _draw_truncated(scaled, [sampling] * GRID, uniforms, list(range(GRID)), vocab, sorted_tokens)
    binned = _draw_binned(scaled, [sampling] * GRID, uniforms, list(range(GRID)))
    probs = scaled[0].softmax(-1)
    differ = [(a, b) for a, b in zip(binned, sorted_tokens, strict=True) if a != b]
    assert len(differ) <= GRID // 200, differ
    assert all(abs(float(probs[a] - probs[b])) <= 1e-5 * float(probs[b]) for a, b in differ)
