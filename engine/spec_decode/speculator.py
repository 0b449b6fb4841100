"""Speculative decoding in the engine loop: before each schedule() it asks the proposer for
tokens (k per request from the policy), and after each step it records what was accepted.

Owned by the engine thread, like the LLMEngine that holds it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from engine.config import EngineConfig, ModelConfig
from engine.outputs import ModelRunnerOutput, RequestOutput, SchedulerOutput
from engine.request import Request
from engine.scheduler import Scheduler
from engine.spec_decode.adaptive_k import AdaptiveK
from engine.spec_decode.batch_gate import BatchGate
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.proposer import Proposals, Proposer


def build_proposer(config: SpeculativeConfig, engine: EngineConfig, target: ModelConfig,
                   runner, num_blocks: int) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config.ngram_min, config.ngram_max)
    if engine.tensor_parallel_size > 1:  # ranks 1..N-1 would need the draft's distributions
        raise ValueError("a draft model is not supported with tensor parallelism yet; "
                         "use --speculative-method ngram")
    from engine.spec_decode.draft import DraftModelProposer

    return DraftModelProposer(config.draft_model, target, runner.dtype, runner.device,
                              num_blocks, engine.block_size)


class Speculator:
    """The proposer, the policy (k per request, the batch gate) and the counters that
    engine.stats() exports as spec_*; LLMEngine.step calls propose, then observe."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer,
                 grammar_prefix: Callable[[str, Sequence[int]], int | None] | None = None) -> None:
        """`grammar_prefix(request_id, tokens)`: how many of a constrained request's proposed
        tokens its grammar accepts (None: unconstrained); ModelRunner.grammar_prefix."""
        self.config = config
        self.proposer = proposer
        self.grammar_prefix = grammar_prefix
        self.k = AdaptiveK(config.num_speculative_tokens, config.adaptive_k)
        self.gate = BatchGate(config.max_batch_size, config.adaptive_batch)
        self.num_proposed_tokens = 0  # scheduled for verification
        self.num_accepted_tokens = 0
        self.num_verifications = 0  # (request, step) pairs verified
        self.num_gated_steps = 0  # steps with decoding requests the batch gate kept plain
        self._step_batch = 0  # decoding requests when this step's proposals were made
        self._step_speculated = False

    def propose(self, scheduler: Scheduler) -> Proposals | None:
        running = scheduler.running
        live = {r.request_id for r in running}
        self.proposer.retain(live)
        self.k.retain(live)
        decoding = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        self._step_batch = len(decoding)
        self._step_speculated = self.gate.allow(len(decoding))
        if not self._step_speculated:
            self.num_gated_steps += bool(decoding)
            return None
        wanted = {}
        self.k.start_step()
        for request in decoding:
            k = self._budget(request)
            if k > 0:
                wanted[request.request_id] = k
        if not wanted:
            return None
        proposals = self.proposer.propose([r for r in decoding if r.request_id in wanted], wanted)
        if self.grammar_prefix is not None:
            self._cut_at_the_grammar(proposals)
        return proposals

    def _cut_at_the_grammar(self, proposals: Proposals) -> None:
        """A proposal its request's grammar rejects would be rejected in verification anyway
        (the target's logits are masked there): cut it, and what follows, before it takes a
        slot in the forward."""
        for rid, tokens in list(proposals.token_ids.items()):
            keep = self.grammar_prefix(rid, tokens)
            if keep is None or keep >= len(tokens):
                continue
            if keep == 0:
                del proposals.token_ids[rid]
                proposals.draft_probs.pop(rid, None)
                continue
            proposals.token_ids[rid] = tokens[:keep]
            if rid in proposals.draft_probs:
                proposals.draft_probs[rid] = proposals.draft_probs[rid][:keep]

    def _budget(self, request: Request) -> int:
        params = request.sampling_params
        if params.disable_speculation or params.needs_logit_processing:
            return 0  # verification applies no logit processing: such requests never speculate
        # Never propose past max_tokens (the step adds one token of its own) or the context.
        left = params.max_tokens - request.num_output_tokens - 1
        if request.max_model_len is not None:
            left = min(left, request.max_model_len - request.num_tokens)
        return min(self.k.num_tokens(request.request_id), left)

    def observe(self, sched: SchedulerOutput, result: ModelRunnerOutput,
                outputs: list[RequestOutput], seconds: float) -> None:
        for rid, proposed in sched.spec_token_ids.items():
            tokens = result.sampled_token_ids.get(rid)
            if not tokens:
                continue
            accepted = len(tokens) - 1
            self.num_proposed_tokens += len(proposed)
            self.num_accepted_tokens += accepted
            self.num_verifications += 1
            self.k.record(rid, len(proposed), accepted)
        self.release(out.request_id for out in outputs if out.finished)
        num_requests = len(sched.num_scheduled_tokens)
        num_spec = sum(len(t) for t in sched.spec_token_ids.values())
        if num_requests and sched.total_num_scheduled_tokens == num_requests + num_spec:
            produced = sum(len(t) for t in result.sampled_token_ids.values())
            self.gate.observe(self._step_batch, self._step_speculated, produced, seconds,
                              num_spec)

    def release(self, request_ids: Iterable[str]) -> None:
        self.proposer.release(list(request_ids))

    def stats(self) -> dict[str, float]:
        return {
            "spec_proposed_tokens": self.num_proposed_tokens,
            "spec_accepted_tokens": self.num_accepted_tokens,
            "spec_verifications": self.num_verifications,
            "spec_gated_steps": self.num_gated_steps,
        }
