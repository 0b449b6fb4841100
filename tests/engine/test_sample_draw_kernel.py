"""The C++ draw (kernels/cpu/sample_draw.cpp, torch.ops.splitserve_cpu.sample_draw) against its
torch reference, engine/sampling_draw.draw: the same token for the same uniform, except where
two tokens' probabilities are equal to float rounding (its sums run in another order, and exact
ties may be ordered either way); the filtered distribution on a grid of uniforms; bfloat16 rows
read as their float32 values; the Sampler taking it on a CPU; bad input refused."""

from __future__ import annotations

import pytest
import torch
from kernel_build import require_cpu_kernels

from engine import sampler as sampler_module
from engine.sampler import Sampler, SamplingRow, _filter, draw_kernel
from engine.sampling_draw import draw
from engine.sampling_params import SamplingParams
from tests.engine.test_sampling_draw import CASES, GRID, _logits

pytestmark = require_cpu_kernels()


def _kernel(logits: torch.Tensor, params: list[SamplingParams], uniforms: list[float],
            index: list[int] | None = None) -> list[int]:
    rows = torch.tensor(index if index is not None else list(range(len(params))))
    return draw_kernel(logits, rows, params, uniforms).tolist()


@pytest.mark.parametrize(("kind", "params"), CASES, ids=[f"{k}-{p}" for k, p in CASES])
def test_the_kernel_picks_the_torch_draws_token(kind, params):
    vocab = 3000
    sampling = SamplingParams(max_tokens=1, **params)
    logits = _logits(kind, vocab)[None].expand(GRID, vocab)
    uniforms = [(j + 0.5) / GRID for j in range(GRID)]
    ours = _kernel(logits, [sampling] * GRID, uniforms)
    theirs = draw(logits / sampling.temperature, [sampling] * GRID, uniforms)
    probs = (logits[0] / sampling.temperature).softmax(-1)
    differ = [(a, b) for a, b in zip(ours, theirs, strict=True) if a != b]
    ties = [(a, b) for a, b in differ if abs(float(probs[a] - probs[b])) <= 1e-5 * float(probs[b])]
    assert len(differ) - len(ties) <= 1, differ[:10]  # a uniform on a rounded boundary, at most
    if kind != "ties":
        assert len(differ) <= GRID // 200, differ[:10]
    if not (kind == "ties" and "top_p" in params):  # which tied tokens top-p keeps is free
        expected = _filter((logits[:1] / sampling.temperature).clone(),
                           [SamplingRow(sampling, 0, 0, [], 0)])[0].double()
        assert set(ours) <= set(torch.nonzero(expected).flatten().tolist())
        counts = torch.bincount(torch.tensor(ours), minlength=vocab).double() / GRID
        assert float((counts - expected).abs().max()) <= 1.0 / GRID + 1e-9


def test_a_vocabulary_sized_batch_of_mixed_rows_draws_each_as_the_torch_draw():
    """SmolLM2's vocabulary (49,152: whole blocks of the search and a row long enough that a
    top-p span is widened), rows of every kind in one call, a row index that skips and repeats."""
    vocab = 49152
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(6, vocab, generator=generator) * 2
    logits[0, :5] += 12.0  # peaked
    logits[3] *= 0.05  # flat: top-p reaches far down
    logits[4, 1000:] = float("-inf")  # a grammar's mask
    settings = [dict(temperature=1.0), dict(temperature=0.8, top_p=0.95), dict(temperature=0.7, top_k=50),
                dict(temperature=1.0, top_p=0.9), dict(temperature=1.0, min_p=0.1),
                dict(temperature=1.3, top_k=40, top_p=0.9, min_p=0.01)]
    params = [SamplingParams(max_tokens=1, **s) for s in settings]
    index = [5, 0, 1, 2, 3, 4, 0]
    picked = [params[i] for i in index]
    differ = 0
    for u in torch.linspace(0.001, 0.999, 60).tolist():
        ours = _kernel(logits, picked, [u] * len(index), index)
        temps = torch.tensor([p.temperature for p in picked]).unsqueeze(1)
        theirs = draw(logits[index] / temps, picked, [u] * len(index))
        differ += sum(a != b for a, b in zip(ours, theirs, strict=True))
        assert all(logits[4, t] > float("-inf") for t, i in zip(ours, index, strict=True) if i == 4)
    assert differ <= 2


@pytest.mark.parametrize("params", [dict(temperature=0.8, top_p=0.95), dict(temperature=1.0, min_p=0.02),
                                    dict(temperature=1.0, top_p=0.9, min_p=0.001),
                                    dict(temperature=1.0, top_p=0.7, min_p=0.01)])
@pytest.mark.parametrize("shape", ["gaussian", "tied"])
def test_a_cut_over_thousands_of_tokens_draws_as_the_ordered_walk(shape, params):
    """Rows whose kept set runs to thousands of tokens (Gaussian logits over SmolLM2's
    vocabulary: random prompts give such rows; or 600 tokens tied at the top) take the binned
    walk, which sorts only the bin where the cut falls and the one the draw falls in: the torch
    draw's token for every uniform of a grid (but a tie or a rounded boundary), only kept
    tokens, each drawn at its share."""
    vocab, grid = 49152, 400
    generator = torch.Generator().manual_seed(13)
    logits = torch.randn(vocab, generator=generator) * 2
    if shape == "tied":
        logits[1000:1600] = 9.0
    sampling = SamplingParams(max_tokens=1, **params)
    uniforms = [(j + 0.5) / grid for j in range(grid)]
    ours = _kernel(logits[None].expand(grid, vocab), [sampling] * grid, uniforms)
    theirs = draw(logits[None].expand(grid, vocab) / sampling.temperature, [sampling] * grid,
                  uniforms)
    probs = (logits / sampling.temperature).softmax(-1)
    differ = [(a, b) for a, b in zip(ours, theirs, strict=True) if a != b]
    ties = [(a, b) for a, b in differ if abs(float(probs[a] - probs[b])) <= 1e-5 * float(probs[b])]
    assert len(differ) - len(ties) <= 1, differ[:10]
    expected = _filter((logits[None] / sampling.temperature).clone(),
                       [SamplingRow(sampling, 0, 0, [], 0)])[0]
    kept = torch.nonzero(expected).flatten()
    assert len(kept) > 128
    # Which of the tied tokens a cut through them keeps is free; none below the kept ones is.
    assert min(float(probs[t]) for t in ours) >= float(probs[kept].min()) * (1 - 1e-5)
    if shape == "gaussian":  # no ties: every uniform lands where the ordered walk says
        assert ours == theirs


@pytest.mark.parametrize("params", [dict(temperature=0.7, top_k=50),
                                    dict(temperature=1.0, top_k=50, top_p=0.95),
                                    dict(temperature=1.0, top_k=3000, min_p=0.05)])
def test_a_top_k_over_a_flat_row_keeps_the_k_most_likely_and_draws_as_the_torch_draw(params):
    """A row with tens of thousands of tokens within its first span (N(0, 1) logits over
    SmolLM2's vocabulary) finds its top-k set by bins of its exponentials, not by an
    nth_element over all of them: the same k tokens as torch's topk, each uniform of a grid
    drawing the torch draw's token."""
    vocab, grid = 49152, 400
    generator = torch.Generator().manual_seed(17)
    logits = torch.randn(vocab, generator=generator)
    sampling = SamplingParams(max_tokens=1, **params)
    uniforms = [(j + 0.5) / grid for j in range(grid)]
    ours = _kernel(logits[None].expand(grid, vocab), [sampling] * grid, uniforms)
    theirs = draw(logits[None].expand(grid, vocab) / sampling.temperature, [sampling] * grid,
                  uniforms)
    assert ours == theirs
    top = set(torch.topk(logits, sampling.top_k).indices.tolist())
    assert set(ours) <= top and len(set(ours)) > min(sampling.top_k, 40) // 2


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.8, top_p=0.95),
                                    dict(temperature=0.7, top_k=20, min_p=0.02)])
def test_bfloat16_rows_are_drawn_as_their_float32_values(params):
    generator = torch.Generator().manual_seed(5)
    logits = (torch.randn(64, 4096, generator=generator) * 3).bfloat16()
    sampling = [SamplingParams(max_tokens=1, **params)] * 64
    uniforms = torch.rand(64, generator=generator, dtype=torch.float64).tolist()
    assert _kernel(logits, sampling, uniforms) == _kernel(logits.float(), sampling, uniforms)


def test_a_row_with_no_finite_logit_takes_its_first_token_and_nan_is_never_drawn():
    logits = torch.full((3, 300), float("-inf"))
    logits[1, 7] = float("nan")
    logits[1, 9] = 0.5
    logits[2, 100:110] = 1.0
    logits[2, 105] = float("nan")
    params = [SamplingParams(max_tokens=1, temperature=1.0)] * 3
    for u in (0.0, 0.5, 0.999999):
        tokens = _kernel(logits, params, [u] * 3)
        assert tokens[0] == 0 and tokens[1] == 9
        assert 100 <= tokens[2] < 110 and tokens[2] != 105


@pytest.mark.parametrize(("change", "message"), [
    (dict(temperatures=torch.tensor([0.0])), "temperature above 0"),
    (dict(rows=torch.tensor([4])), "out of range"),
    (dict(uniforms=torch.tensor([0.5], dtype=torch.float32)), "float64"),
    (dict(logits=torch.zeros(4, 10, dtype=torch.float16)), "bfloat16 or float32"),
])
def test_bad_input_is_refused_with_a_clear_error(change, message):
    args = dict(logits=torch.zeros(4, 10), rows=torch.tensor([1]), temperatures=torch.tensor([1.0]),
                top_k=torch.tensor([0]), top_p=torch.tensor([1.0]), min_p=torch.tensor([0.0]),
                uniforms=torch.tensor([0.5], dtype=torch.float64))
    args.update(change)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.splitserve_cpu.sample_draw(*args.values())


def test_the_sampler_takes_the_kernel_on_a_cpu_and_draws_the_torch_paths_tokens(monkeypatch):
    """The Sampler on bfloat16 logits with greedy, plain, cut, penalised and logprob rows: the
    kernel's tokens against the same Sampler with the kernel turned off."""
    generator = torch.Generator().manual_seed(11)
    logits = (torch.randn(8, 2000, generator=generator) * 2).bfloat16()
    settings = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.8, top_p=0.95),
                dict(temperature=0.7, top_k=30), dict(temperature=1.0, presence_penalty=0.5),
                dict(temperature=1.0, logprobs=3), dict(temperature=1.0, min_p=0.05),
                dict(temperature=0.0, logprobs=1)]
    rows = [SamplingRow(SamplingParams(max_tokens=4, **s), seed=40 + i, position=9,
                        token_ids=list(range(9)), num_prompt_tokens=5)
            for i, s in enumerate(settings)]
    calls = []
    real = sampler_module.draw_kernel
    monkeypatch.setattr(sampler_module, "draw_kernel", lambda *a: calls.append(1) or real(*a))
    with_kernel = Sampler(batched=False)(logits, rows)
    assert calls, "the kernel was not taken"
    monkeypatch.setattr(sampler_module, "draw_kernel_takes", lambda logits: False)
    without = Sampler(batched=False)(logits, rows)
    assert with_kernel[0] == without[0]
    assert with_kernel[1] == without[1]
