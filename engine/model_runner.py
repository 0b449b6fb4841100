"""Owns the model and its paged KV cache; turns one SchedulerOutput into one forward pass.

Owned by the engine thread. Keeps its own view of each scheduled request (tokens, blocks),
updated from the scheduler's diffs, so the same code runs on every tensor-parallel rank.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine import kernel_choice
from engine.config import EngineConfig, ModelConfig
from engine.cuda_graphs import DecodeGraph, DecodeGraphs, capture_decode_graphs
from engine.distributed import get_tp
from engine.host_allocator import keep_freed_memory
from engine.kv_tensor import KVPayloads, kv_cache_bytes_per_block, zeroed
from engine.layers.linear import use_packed_weights, use_small_m_linear
from engine.memory_profile import size_kv_pool
from engine.models.loader import load_model
from engine.outputs import Logprobs, ModelRunnerOutput, SchedulerOutput
from engine.sampler import Sampler, SamplingRow, batch_logprobs
from engine.sampling_params import SamplingParams
from engine.spec_decode.rejection_sampler import RejectionSampler, VerifyItem
from engine.step_batch import StepBatch, build_step_batch
from engine.step_inputs import Part, StepInputs, Table
from engine.token_counts import TokenCounts
from kernels import cpu_kernels
from kernels.attention import (
    AttentionMetadata,
    find_shared_prefixes,
    plan_decode_groups,
    uses_triton,
)
from kernels.kernel_paths import KernelPaths

if TYPE_CHECKING:  # engine/structured needs llguidance, imported with the first grammar
    from engine.structured.masks import GrammarMasks, StepMasks
    from engine.structured.state import GrammarState


@dataclass
class CachedRequestState:
    request_id: str
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    num_prompt_tokens: int
    params: SamplingParams
    prompt_logprobs: list[Logprobs | None] | None = None
    penalty_counts: TokenCounts = field(default_factory=TokenCounts)  # over token_ids
    grammar: GrammarState | None = None  # structured output: follows the output tokens


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig) -> None:
        self.config = config
        self.model_config = model_config
        self.device = config.resolve_device()
        self.dtype = config.resolve_dtype(self.device)
        self.block_size = config.block_size
        if self.device.type == "cpu":
            keep_freed_memory()
        # The kernels chosen by timing them at start, and the weights packed for them: a
        # start-up phase of its own (it was booked under kv_allocation: 6 of its 6.0 s).
        choosing, kernels_loaded = time.perf_counter(), cpu_kernels.load_seconds()
        self.native_decode = kernel_choice.native_decode(config, self.device)
        # Decode rows behind a shared prefix attend it once (kernels/attention.py).
        self.shared_prefixes = self.native_decode and config.cpu_shared_prefix_attention
        self.native_prefill = kernel_choice.native_prefill(config, model_config, self.dtype,
                                                           self.native_decode)
        # Prompts after a cached prefix: one call per layer reading the paged cache (AMX).
        self.paged_prefill = (self.native_prefill and self.block_size % 16 == 0
                              and torch.ops.splitserve_cpu.has_amx_bf16())
        # Raises now, not at the first step, for a backend this device cannot run.
        self.triton = uses_triton(config.attention_backend, self.device)
        loading = time.perf_counter()
        self.model = load_model(model_config, self.dtype, self.device)
        loading = time.perf_counter() - loading
        self.small_m_linear = kernel_choice.small_m_linear(config, self.device, self.dtype)
        self.weight_layout = kernel_choice.weight_layout(config, self.device, self.dtype, self.model)
        if self.weight_layout != "plain":
            packed_bytes = use_packed_weights(self.model, self.weight_layout)
            logging.getLogger(__name__).info(
                "linear weights packed for %s: %.0f MiB more",
                "the AMX kernel" if self.weight_layout == "amx" else "oneDNN", packed_bytes / 2**20)
        self.small_m_max_rows = (kernel_choice.small_m_max_rows(config, self.model,
                                                                self.weight_layout != "plain")
                                 if self.small_m_linear else 0)
        use_small_m_linear(self.model, self.small_m_max_rows)
        self.fused_decode = kernel_choice.fused_decode(config, self.device, self.dtype,
                                                       self.native_decode, self.model)
        if self.fused_decode:
            self.model.use_fused_decode(self.small_m_max_rows)
        # Less the weights' load and the C++ kernels' (built or loaded on first use here):
        # phases of their own.
        self.kernel_choice_seconds = (time.perf_counter() - choosing - loading
                                      - (cpu_kernels.load_seconds() - kernels_loaded))
        attn = self.model.layers[0].self_attn
        self.num_kv_heads = attn.num_kv_heads  # on this rank
        self.kernel_paths = KernelPaths.of(
            device=self.device, dtype=self.dtype, native_decode=self.native_decode,
            native_prefill=self.native_prefill, small_m_linear=self.small_m_max_rows > 0,
            fused_decode=self.fused_decode, head_dim=model_config.head_dim,
            query_heads_per_kv_head=attn.num_heads // attn.num_kv_heads,
            small_m_max_rows=self.small_m_max_rows, weight_layout=self.weight_layout,
            triton=self.triton, shared_prefixes=self.shared_prefixes,
        )
        logging.getLogger(__name__).info("%s", self.kernel_paths)  # the paths a user gets
        self.sampler = Sampler(eos_token_ids=model_config.eos_token_ids)
        self.rejection_sampler = RejectionSampler(self.sampler)
        self.requests: dict[str, CachedRequestState] = {}
        self.grammar_masks: GrammarMasks | None = None  # built for the first constrained request
        self._constrained: set[str] = set()  # requests with a grammar (empty: no mask work)
        self.inputs = StepInputs(self.device)
        self.graphs: DecodeGraphs | None = None  # captured once the KV pool exists
        # Profiles the largest step first (engine/memory_profile.py), then sizes the pool.
        self.memory = size_kv_pool(
            self, kv_cache_bytes_per_block(model_config, self.block_size, self.dtype,
                                           self.num_kv_heads),
            min_over_ranks=get_tp().min_over_ranks, tp_size=get_tp().size)
        self.num_blocks = self.memory.num_blocks
        # One tensor for all layers, in the layout kv_transfer ships (engine/kv_tensor.py).
        self.kv_cache = zeroed((model_config.num_layers, 2, self.num_blocks, self.block_size,
                                self.num_kv_heads, model_config.head_dim), self.dtype,
                               self.device)
        self.kv_caches = list(self.kv_cache.unbind(0))
        self.kv_payloads = KVPayloads(self.kv_cache)
        self.graphs = capture_decode_graphs(config, model_config, self.model, self.kv_caches,
                                            triton=self.triton)

    # -- KV movement (prefill -> decode) -------------------------------------------------

    # The executor's interface (engine/executor.py has the tensor-parallel one).
    def gather_kv(self, block_ids: list[int]) -> torch.Tensor:
        return self.kv_payloads.gather(block_ids)

    def release_kv(self, kv: torch.Tensor) -> None:
        """A gathered payload back to the pool (thread-safe); see LLMEngine.release_kv."""
        self.kv_payloads.release(kv)

    def scatter_kv(self, block_ids: list[int], payload: torch.Tensor) -> None:
        self.kv_payloads.scatter(block_ids, payload)

    # -- one step -----------------------------------------------------------------------

    def _update_states(self, sched: SchedulerOutput) -> None:
        for rid in sched.finished_request_ids | sched.preempted_request_ids:
            self.requests.pop(rid, None)
            self._constrained.discard(rid)
        for new in sched.new_requests:
            # Prompt logprobs go out with the first sampled token at the latest, so a request
            # back from preemption with output tokens already has them: don't score it again.
            wants_prompt_logprobs = (
                new.sampling_params.prompt_logprobs is not None
                and len(new.token_ids) == new.num_prompt_tokens
            )
            self.requests[new.request_id] = CachedRequestState(
                request_id=new.request_id,
                token_ids=list(new.token_ids),
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                num_prompt_tokens=new.num_prompt_tokens,
                params=new.sampling_params,
                prompt_logprobs=[None] if wants_prompt_logprobs else None,
            )
            if new.sampling_params.structured_output is not None:
                # Replaying the outputs so far restores the grammar after a hand-off from a
                # prefill worker, a preemption's recompute or a migration alike.
                self.requests[new.request_id].grammar = self._grammar_masks().new_state(
                    new.sampling_params.structured_output,
                    new.token_ids[new.num_prompt_tokens :], new.request_id)
                self._constrained.add(new.request_id)
        for diff in sched.cached_requests:
            state = self.requests[diff.request_id]
            del state.block_ids[diff.num_kept_blocks :]  # the scheduler's trim, if any
            state.block_ids.extend(diff.new_block_ids)
            state.num_computed_tokens = diff.num_computed_tokens

    @torch.inference_mode()
    def execute_model(
        self, sched: SchedulerOutput, draft_probs: dict[str, torch.Tensor] | None = None
    ) -> ModelRunnerOutput:
        """`draft_probs`: a draft model's distributions for its sampled proposals (see
        engine/spec_decode); scheduled proposals without one are verified as deterministic."""
        self._update_states(sched)
        if sched.is_empty:
            return ModelRunnerOutput(sampled_token_ids={})
        spec = sched.spec_token_ids
        # With the C++ kernel a verification's k + 1 queries are decode rows too.
        batch = build_step_batch(sched, self.requests, self.block_size,
                                 verify_as_decode=self.native_decode and bool(spec))
        sample_rows, verify_rows = batch.sample_rows, batch.verify_rows
        # Masks are computed from the grammar states alone: fill them while the forward runs.
        masks = self.grammar_masks.start_step(
            [(self.requests[rid].grammar, spec[rid]) for rid, _, _ in verify_rows],
            [self.requests[rid].grammar for rid, _ in sample_rows], self.dtype, self.device,
        ) if self._constrained else None
        graph = self._decode_graph(batch)
        graph_logits = self.graphs.replay(graph, self.inputs, batch) if graph is not None else None
        hidden = self._forward(batch) if graph is None else None
        for rid, n in batch.order:
            self.requests[rid].num_computed_tokens += n
        prompt_lps = self._prompt_logprobs(hidden, batch.prompt_rows) if batch.prompt_rows else {}
        verified = (self._verify(hidden, verify_rows, spec, draft_probs, masks) if verify_rows
                    else ({}, {}))
        if not sample_rows:
            return ModelRunnerOutput(
                sampled_token_ids=verified[0], logprobs=verified[1], prompt_logprobs=prompt_lps
            )

        # Rows 0..n-1 (every decode-only step) are a slice: no gather, no index to copy over.
        at = (slice(len(sample_rows)) if batch.sample_rows_are_leading
              else [row for _, row in sample_rows])
        logits = (graph_logits[at] if graph_logits is not None
                  else self.model.compute_logits(hidden[at]))
        if masks is not None:
            masks.apply(logits, "sample")
        rows = []
        for rid, _ in sample_rows:
            state = self.requests[rid]
            rows.append(
                SamplingRow(
                    params=state.params,
                    seed=state.params.seed,
                    position=len(state.token_ids),
                    token_ids=state.token_ids,
                    num_prompt_tokens=state.num_prompt_tokens,
                    counts=state.penalty_counts,
                )
            )
        tokens, logprobs = self.sampler(logits, rows)
        sampled: dict[str, list[int]] = verified[0]
        out_logprobs: dict[str, list[Logprobs]] = verified[1]
        for (rid, _), token, lp in zip(sample_rows, tokens, logprobs, strict=False):
            self.requests[rid].token_ids.append(token)
            if self.requests[rid].grammar is not None:
                self.requests[rid].grammar.accept([token])
            sampled[rid] = [token]
            if lp is not None:
                out_logprobs[rid] = [lp]
        return ModelRunnerOutput(
            sampled_token_ids=sampled, logprobs=out_logprobs, prompt_logprobs=prompt_lps
        )

    def _forward(self, batch: StepBatch) -> torch.Tensor:
        """The model over the step's rows, eagerly; returns the hidden states [rows, hidden]."""
        dev = self.device
        decode_lens, decode_tables = batch.decode_lens, batch.decode_tables
        parts: list[Part] = [batch.input_ids, batch.positions, batch.slots]
        shared = (find_shared_prefixes(decode_tables, decode_lens, self.block_size)
                  if self.shared_prefixes and len(decode_lens) > 1 else None)
        if decode_lens:
            parts += [decode_lens, Table(decode_tables, max(map(len, decode_tables)))]
        if batch.prefill_seqs:
            parts.append(Table(batch.prefill_tables, max(map(len, batch.prefill_tables))))
            if self.triton:  # the prefill kernel's (start, q_len, ctx_len) columns
                parts.append(Table(list(zip(*batch.prefill_seqs, strict=True)),
                                   len(batch.prefill_seqs)))
        input_ids, positions, slot_mapping, *rest = self.inputs.pack(parts)
        seq_lens, tables = (rest.pop(0), rest.pop(0)) if decode_lens else (None, None)
        prefill_tables = rest.pop(0) if batch.prefill_seqs else []
        shared_of, shared_lens = (torch.tensor(shared[0]), torch.tensor(shared[1])) if shared else (None, None)
        max_decode_len = batch.max_decode_len
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            num_decode_tokens=len(decode_lens),
            decode_block_tables=tables,
            # The reference needs no lengths when nothing is masked (batch 1); the C++ kernel
            # always takes them, and reads each context at its own length: no groups needed.
            decode_seq_lens=seq_lens if decode_lens and (
                self.native_decode or min(decode_lens) < max_decode_len) else None,
            decode_max_seq_len=max_decode_len,
            prefill_seqs=batch.prefill_seqs,
            prefill_block_tables=prefill_tables,
            prefill_seq_info=rest.pop(0) if rest else None,  # packed for Triton only
            # The torch reference's groups (the C++ and Triton kernels read every length).
            decode_groups=plan_decode_groups(decode_lens, decode_tables, self.block_size, dev)
            if decode_lens and not self.native_decode and not self.triton else None,
            native_decode=self.native_decode,
            native_prefill=self.native_prefill,
            attention_backend=self.config.attention_backend,
            fresh_prefill_spans=self._fresh_prefill_spans(batch.prefill_seqs),
            cached_prefill_spans=self._cached_prefill_spans(batch.prefill_seqs),
            decode_shared_prefix_of=shared_of,
            decode_shared_prefix_lens=shared_lens,
        )
        return self.model(input_ids, positions, self.kv_caches, meta)

    def _fresh_prefill_spans(self, prefill_seqs: list[tuple[int, int, int]]) -> torch.Tensor | None:
        """(start, length) of the step's prompts with nothing cached before them, for the C++
        prefill attention's one call per layer over all of them (AttentionMetadata)."""
        if not self.native_prefill:
            return None
        fresh = [(start, q_len) for start, q_len, ctx_len in prefill_seqs if ctx_len == q_len]
        return torch.tensor(fresh, dtype=torch.long) if fresh else None

    def _cached_prefill_spans(self, prefill_seqs: list[tuple[int, int, int]]) -> torch.Tensor | None:
        """(start, length, context length, table row) of the step's prompts after a cached
        prefix, for the AMX prefill attention's one call per layer over all of them."""
        if not self.paged_prefill:
            return None
        cached = [(start, q_len, ctx_len, row)
                  for row, (start, q_len, ctx_len) in enumerate(prefill_seqs) if ctx_len > q_len]
        return torch.tensor(cached, dtype=torch.long) if cached else None

    def _decode_graph(self, batch: StepBatch) -> DecodeGraph | None:
        """The CUDA graph that runs this step, if it has one: decode rows only, none scored
        for prompt logprobs or verified, within the graphs' batch and context sizes."""
        if (self.graphs is None or batch.prefill_seqs or batch.prompt_rows or batch.verify_rows
                or not batch.decode_lens):
            return None
        return self.graphs.graph_for(len(batch.decode_lens), batch.max_decode_len)

    def _verify(self, hidden, verify_rows, spec, draft_probs, masks: StepMasks | None):
        """Score each verifying request's [last token, proposals...] and keep the accepted
        run plus the target's own next token. Under a grammar each position's logits are
        masked given the proposals before it, so a proposal outside the grammar has target
        probability 0 and is rejected. The block table is left as it is: the
        scheduler releases the rejected proposals' slots and says so in the request's next
        CachedRequestData; until then nothing here reads the table."""
        index = [row for _, row0, n in verify_rows for row in range(row0, row0 + n)]
        logits = self.model.compute_logits(hidden[index])
        if masks is not None:
            masks.apply(logits, "verify")
        items = []
        for rid, _, _ in verify_rows:
            state = self.requests[rid]
            items.append(VerifyItem(
                params=state.params, seed=state.params.seed, token_ids=state.token_ids,
                num_prompt_tokens=state.num_prompt_tokens, proposals=spec[rid],
                draft_probs=draft_probs.get(rid) if draft_probs else None,
                counts=state.penalty_counts,
            ))
        sampled: dict[str, list[int]] = {}
        out_logprobs: dict[str, list[Logprobs]] = {}
        verified = self.rejection_sampler(logits, items)
        for (rid, _, n), (tokens, lps) in zip(verify_rows, verified, strict=True):
            state = self.requests[rid]
            state.num_computed_tokens -= n - len(tokens)
            state.token_ids.extend(tokens)
            if state.grammar is not None:
                state.grammar.accept(tokens)
            sampled[rid] = tokens
            if lps:
                out_logprobs[rid] = lps
        return sampled, out_logprobs

    def grammar_prefix(self, request_id: str, token_ids: list[int]) -> int | None:
        """How many of `token_ids` (proposals after the request's tokens) its grammar accepts;
        None without a grammar here (unconstrained, or not yet seen by this runner)."""
        state = self.requests.get(request_id)
        return None if state is None or state.grammar is None else state.grammar.valid_prefix(token_ids)

    def warm_structured_outputs(self) -> None:
        """GrammarMasks.warm, on the engine thread (the owner of the runner's grammar side)."""
        self._grammar_masks().warm(self.dtype, self.device)

    def _grammar_masks(self) -> GrammarMasks:
        if self.grammar_masks is None:
            from engine.structured.masks import GrammarMasks

            self.grammar_masks = GrammarMasks(self.model_config.path, self.model_config.vocab_size,
                                              self.model_config.eos_token_ids)
        return self.grammar_masks

    def _prompt_logprobs(self, hidden, prompt_rows) -> dict[str, list[Logprobs | None]]:
        """Logprobs of each prompt token given the ones before it (completions' echo)."""
        done: dict[str, list[Logprobs | None]] = {}
        for rid, row0, count in prompt_rows:
            state = self.requests[rid]
            logprobs = self.model.compute_logits(hidden[row0 : row0 + count]).float().log_softmax(-1)
            start = len(state.prompt_logprobs)  # next prompt position to score
            state.prompt_logprobs.extend(batch_logprobs(
                logprobs, state.token_ids[start : start + count],
                [state.params.prompt_logprobs] * count))
            if len(state.prompt_logprobs) >= state.num_prompt_tokens:
                done[rid] = state.prompt_logprobs
        return done

