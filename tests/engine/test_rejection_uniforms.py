"""The rejection sampler's accept test draws its uniform from engine/sampling_draw.py's
counter-based uniform_for (keyed by seed, position and its own stream), the one the sampler
uses: no torch.Generator per call, the same number on any device and in any process, and a
request's verification does not depend on the requests verified beside it."""

from __future__ import annotations

import torch

from engine.sampling_draw import DRAW_STREAM, uniform_for
from engine.sampling_params import SamplingParams
from engine.spec_decode.rejection_sampler import ACCEPT_STREAM, RejectionSampler, VerifyItem

VOCAB = 8
HISTORY = [5, 1, 4]  # the first proposal sits at position 3


def _distribution(seed: int) -> torch.Tensor:
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return logits.softmax(-1).float()


def test_accept_test_uses_the_counter_based_uniform_of_its_own_stream():
    """One proposal x with p(x) / q(x) = 0.5: it is accepted exactly when the ACCEPT_STREAM
    uniform of (seed, 3) is below 0.5, seed by seed."""
    q = _distribution(0)
    x = int(q.argmax())
    p = q.clone()
    p[x] = q[x] / 2
    p[(x + 1) % VOCAB] += q[x] / 2
    target = torch.stack([p, p]).log()  # [proposal position, bonus position]
    sampler = RejectionSampler()
    params = SamplingParams(temperature=1.0)
    accepted, predicted = [], []
    for seed in range(200):
        item = VerifyItem(params, seed, HISTORY, len(HISTORY), [x], draft_probs=q[None])
        ((tokens, _),) = sampler(target, [item])
        accepted.append(len(tokens) == 2)
        u = uniform_for(seed, len(HISTORY), ACCEPT_STREAM)
        predicted.append(u * float(q[x]) < float(p[x]))
    assert accepted == predicted
    assert 60 < sum(accepted) < 140  # both outcomes are exercised
    # its own stream: not the draw's uniform at the same (seed, position)
    assert uniform_for(7, 3, ACCEPT_STREAM) != uniform_for(7, 3, DRAW_STREAM) == uniform_for(7, 3)


def test_a_requests_verification_does_not_depend_on_its_batch():
    """The same request verified alone, and between other requests (sampled drafts, a greedy
    one, other seeds and lengths), gets the same tokens."""
    sampler = RejectionSampler()
    sampled = SamplingParams(temperature=0.8)

    def item(seed, k, params=sampled):
        q = torch.stack([_distribution(seed * 10 + i) for i in range(k)])
        return VerifyItem(params, seed, HISTORY, len(HISTORY), q.argmax(-1).tolist(),
                          draft_probs=q)

    def logits(seed, k):
        return torch.stack([_distribution(seed * 10 + 5 + i) for i in range(k + 1)]).log()

    for seed in range(40):
        alone = sampler(logits(seed, 3), [item(seed, 3)])[0]
        others = [(seed + 1000, 2, sampled), (seed + 2000, 1, SamplingParams(temperature=0.0)),
                  (seed + 3000, 4, sampled)]
        batch = [item(s, k, params) for s, k, params in others]
        batch.insert(1, item(seed, 3))
        rows = torch.cat([logits(s, k) for s, k, _ in others[:1]] + [logits(seed, 3)]
                         + [logits(s, k) for s, k, _ in others[1:]])
        assert sampler(rows, batch)[1] == alone
