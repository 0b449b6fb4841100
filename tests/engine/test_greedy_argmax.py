"""The C++ greedy pick (kernels/cpu/greedy_argmax.cpp) against torch's max(dim).indices, and the
sampler's all-greedy path, which picks from the logits as computed (bf16) without a float copy."""

from __future__ import annotations

import pytest
import torch
from kernel_build import require_cpu_kernels

from engine.sampler import Sampler, SamplingRow, greedy_tokens
from engine.sampling_params import SamplingParams
from kernels import cpu_kernels

pytestmark = require_cpu_kernels()


@pytest.fixture(autouse=True)
def _kernels():
    assert cpu_kernels.load()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,vocab", [(1, 1), (3, 15), (5, 16), (7, 17), (64, 49152), (2, 1000)])
def test_greedy_argmax_picks_what_torch_picks(dtype, rows, vocab):
    generator = torch.Generator().manual_seed(rows * vocab)
    pick = torch.ops.splitserve_cpu.greedy_argmax
    logits = torch.randn(rows, vocab, generator=generator).to(dtype)
    assert torch.equal(pick(logits), logits.max(dim=-1).indices)
    # Ties (the first of equal maxima), a row of -inf, NaN (the first NaN), a strided view.
    ties = torch.randint(0, 3, (rows, vocab), generator=generator).to(dtype)
    assert torch.equal(pick(ties), ties.max(dim=-1).indices)
    nothing = torch.full((rows, vocab), float("-inf"), dtype=dtype)
    assert torch.equal(pick(nothing), torch.zeros(rows, dtype=torch.long))
    if vocab > 5:
        nan = logits.clone()
        nan[:, 4] = nan[:, -1] = float("nan")
        assert torch.equal(pick(nan), torch.full((rows,), 4))
        wide = torch.randn(rows, 2 * vocab, generator=generator).to(dtype)[:, ::2]
        assert torch.equal(pick(wide), wide.max(dim=-1).indices)


def test_greedy_argmax_rejects_what_it_cannot_take():
    pick = torch.ops.splitserve_cpu.greedy_argmax
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        pick(torch.zeros(2, 8, dtype=torch.float16))
    with pytest.raises(RuntimeError, match=r"\[rows, vocab\]"):
        pick(torch.zeros(8))


def test_the_all_greedy_sampler_picks_from_bf16_logits_as_from_float32():
    """A batch of greedy rows without logprobs or penalties goes straight to the kernel on the
    bf16 logits; the picks are those of the float32 path (the conversion is exact), and a
    batch that asks for logprobs still gets them."""
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(12, 3000, generator=generator) * 4).bfloat16()
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1  # a tie: the first wins
    rows = [SamplingRow(SamplingParams(max_tokens=4, temperature=0), 0, 5, [1, 2], 2)
            for _ in range(12)]
    tokens, logprobs = Sampler()(logits, rows)
    assert tokens == logits.float().max(dim=-1).indices.tolist() and tokens[3] == 10
    assert logprobs == [None] * 12
    assert greedy_tokens(logits).tolist() == tokens
    asking = [SamplingRow(SamplingParams(max_tokens=4, temperature=0, logprobs=1), 0, 5, [1, 2], 2)
              for _ in range(12)]
    tokens_again, logprobs = Sampler()(logits, asking)
    assert tokens_again == tokens and all(lp is not None for lp in logprobs)
