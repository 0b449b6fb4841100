"""Helpers for the speculative decoding tests: speculating engines, a scripted proposer whose
proposals are right or wrong exactly where a test says, and the per-step invariants that
rejected proposals must leave behind (no block beyond the computed KV, runner and scheduler
agreeing on every block table)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from engine_harness import Collected, absorb, make_engine

from engine.kv_cache_manager import cdiv
from engine.llm_engine import LLMEngine
from engine.request import Request, RequestStatus
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.proposer import Proposals, Proposer


def spec_engine(model_dir: Path, method: str = "ngram", k: int = 4, draft: Path | None = None,
                adaptive_k: bool = False, ngram_min: int = 2, **engine_kw) -> LLMEngine:
    """A float32 CPU engine that speculates on every decode step (the batch gate off, and by
    default a fixed k) so a test knows what was proposed."""
    config = SpeculativeConfig(
        method=method, num_speculative_tokens=k, draft_model=str(draft) if draft else None,
        adaptive_k=adaptive_k, adaptive_batch=False, ngram_min=ngram_min,
    )
    return make_engine(model_dir, speculative=config, **engine_kw)


class ScriptedProposer(Proposer):
    """Proposes each request's known continuation (`reference[rid]`, its output tokens
    without speculation), except that the proposal for output index i is wrong when
    `wrong(rid, i)` says so."""

    def __init__(self, reference: dict[str, list[int]], wrong: Callable[[str, int], bool],
                 vocab: int) -> None:
        self.reference = reference
        self.wrong = wrong
        self.vocab = vocab

    def propose(self, requests: list[Request], num_tokens: dict[str, int]) -> Proposals:
        proposals = Proposals()
        for request in requests:
            rid = request.request_id
            start = request.num_output_tokens
            ref = self.reference[rid]
            tokens = []
            for i in range(start, min(start + num_tokens[rid], len(ref))):
                tokens.append((ref[i] + 1) % self.vocab if self.wrong(rid, i) else ref[i])
            if tokens:
                proposals.token_ids[rid] = tokens
        return proposals


def check_invariants(engine: LLMEngine) -> None:
    """After a step: every running request holds exactly the blocks its computed KV needs,
    and the model runner's view (tokens, KV count, block table) equals the scheduler's."""
    bs = engine.config.block_size
    for request in engine.scheduler.running:
        rid = request.request_id
        blocks = engine.kv.block_ids(rid)
        assert len(blocks) == cdiv(request.num_computed_tokens, bs), (request, blocks)
        state = engine.runner.requests.get(rid)
        if state is None:
            continue  # preempted: the runner forgets it until it returns
        # The runner's table may still end in slots of proposals this step's update
        # released: the next CachedRequestData cuts them (checked at every forward).
        assert state.block_ids[: len(blocks)] == blocks, (rid, state.block_ids, blocks)
        assert state.num_computed_tokens == request.num_computed_tokens, (rid, state, request)
        assert state.token_ids == request.all_token_ids, rid
    used = sum(1 for b in engine.kv.pool.blocks if b.ref_cnt > 0)
    assert used == engine.kv.num_blocks - engine.kv.num_free_blocks


def drive_checked(engine: LLMEngine, max_steps: int = 5000,
                  before_step: Callable[[LLMEngine, int], None] | None = None) -> dict[str, Collected]:
    """Step to completion like engine_harness.drive, checking the invariants every step and,
    at every forward, that the runner's block tables are exactly the scheduler's."""
    collected: dict[str, Collected] = {}
    run = engine.runner.execute_model

    def forward_checked(sched, *args):
        result = run(sched, *args)
        for rid in sched.num_scheduled_tokens:
            request = engine.scheduler.requests.get(rid)
            if request is not None and request.status == RequestStatus.RUNNING:
                assert engine.runner.requests[rid].block_ids == engine.kv.block_ids(rid), rid
        return result

    engine.runner.execute_model = forward_checked
    try:
        for step in range(max_steps):
            if not engine.has_unfinished():
                return collected
            if before_step is not None:
                before_step(engine, step)
            for out in engine.step():
                absorb(collected, out)
            check_invariants(engine)
    finally:
        engine.runner.execute_model = run
    raise AssertionError(f"engine did not finish in {max_steps} steps: {engine.stats()}")


def draft_pool_is_free(engine: LLMEngine) -> bool:
    pool = engine.speculator.proposer.pool
    return pool.num_free_blocks == pool.num_blocks and not engine.speculator.proposer._states


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson's goodness of fit of observed `counts` to `probs`; cells expected to hold
    fewer than `min_expected` samples are pooled into one, as the test requires."""
    counts = counts.double()
    expected = probs.double() * counts.sum()
    big = expected >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    if exp[-1] < min_expected:  # too little pooled mass to be a cell of its own: fold it in
        obs[-2] += obs[-1]
        exp[-2] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))
