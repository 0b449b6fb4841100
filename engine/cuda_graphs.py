"""CUDA graphs for steps of decode rows only: the forward pass and every row's logits, captured
at start for bucketed batch sizes and replayed with the step's inputs copied into the graph's
static buffer (one host-to-device copy). A step of n rows replays the smallest graph of at
least n; its padding rows store no KV (slot -1) and attend over one cached token, so they cost
a little work and change nothing.

Built and replayed on the engine thread (ModelRunner). Needs the Triton attention path, which
reads block tables and context lengths from device tensors (the torch reference shapes its
work by them on the host), and one tensor-parallel rank.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.config import EngineConfig, ModelConfig
from engine.distributed import get_tp
from engine.step_batch import StepBatch
from engine.step_inputs import StepInputs, Table
from kernels.attention import AttentionMetadata

log = logging.getLogger(__name__)

# A capture: takes the forward (inputs read from the static buffer), returns its output tensor
# and the replay that rewrites that tensor from the buffer's current contents.
Capture = Callable[[Callable[[], torch.Tensor]], tuple[torch.Tensor, Callable[[], None]]]

# Default longest context a decode graph covers (--cuda-graph-max-context); each replay copies
# its batch's block tables at this width (8192 tokens: 4 KiB a row in blocks of 16).
CUDA_GRAPH_MAX_CONTEXT = 8192
PAD_SLOT = -1  # kernels/triton/rotary_kv.py stores nothing for it
PAD_SEQ_LEN = 1  # a padding row reads one cached token (block 0 of its zero table row)


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_batch, which is always included."""
    if max_batch < 1:
        raise ValueError(f"the largest CUDA graph batch must be at least 1, not {max_batch}")
    small = [b for b in (1, 2, 4, 8) if b < max_batch]
    return small + list(range(16, max_batch, 16)) + [max_batch]


def cuda_capture(device: torch.device) -> Capture:
    """Real CUDA graphs sharing one memory pool (captured largest first, so the smaller ones
    reuse its blocks). Each forward runs once before its capture, so Triton compiles and
    cuBLAS chooses its kernels outside the graph."""
    pool = torch.cuda.graph_pool_handle()

    def capture(forward: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, Callable[[], None]]:
        forward()
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = forward()
        return out, graph.replay

    return capture


def eager_replay(forward: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, Callable[[], None]]:
    """A stand-in for cuda_capture where no GPU is (tests): each replay runs the forward again
    on the static buffer and writes into the same output tensor, as a graph's replay does."""
    out = forward()

    def replay() -> None:
        out.copy_(forward())

    return out, replay


@dataclass
class DecodeGraph:
    batch: int
    inputs: torch.Tensor  # flat int64 [batch * (4 + width)]: ids, positions, slots, lens, table
    logits: torch.Tensor  # [batch, vocab]: a view shared by all graphs, rewritten by each replay
    replay: Callable[[], None]


class DecodeGraphs:
    """One captured decode step per batch size, for contexts of at most `max_context` tokens."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], *,
                 block_size: int, max_context: int, max_batch: int, capture: Capture) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.width = -(-max_context // block_size)  # block-table columns of every graph
        self.max_context = max_context
        self.sizes = graph_batch_sizes(max_batch)
        self._capture = capture
        self.graphs: dict[int, DecodeGraph] = {}
        # Every graph writes its logits into the head of this one buffer (only one replays at
        # a time): [max_batch, vocab] once, not per graph (1.1 GB of fp32 for a 128k
        # vocabulary's 17 graphs up to batch 256, against 131 MB shared).
        self._logits: torch.Tensor | None = None
        self.replays = 0  # steps served by a graph (tests and logs read it)
        self.capture_seconds = 0.0
        self.memory_bytes = 0  # what the capture reserved on the device (CUDA)

    @torch.inference_mode()
    def capture_all(self) -> None:
        start = time.monotonic()
        for batch in reversed(self.sizes):
            self.graphs[batch] = self._capture_one(batch)
        self.capture_seconds = time.monotonic() - start

    def _capture_one(self, batch: int) -> DecodeGraph:
        device = self.kv_caches[0].device
        inputs = torch.zeros(batch * (4 + self.width), dtype=torch.long, device=device)
        ids, positions, slots, seq_lens, table = self._views(inputs, batch)
        slots.fill_(PAD_SLOT)  # captured on padding rows only: no KV is written
        seq_lens.fill_(PAD_SEQ_LEN)
        meta = AttentionMetadata(
            slot_mapping=slots, num_decode_tokens=batch, decode_block_tables=table,
            decode_seq_lens=seq_lens, decode_max_seq_len=self.width * self.block_size,
            prefill_seqs=[], prefill_block_tables=[], attention_backend="triton",
        )

        def forward() -> torch.Tensor:
            hidden = self.model(ids, positions, self.kv_caches, meta)
            logits = self.model.compute_logits(hidden)
            if self._logits is None:  # the first (largest) graph's warm-up run: not captured
                self._logits = torch.empty(self.sizes[-1], logits.shape[1], dtype=logits.dtype,
                                           device=logits.device)
            out = self._logits[:batch]
            out.copy_(logits)
            return out

        logits, replay = self._capture(forward)
        return DecodeGraph(batch, inputs, logits, replay)

    def _views(self, inputs: torch.Tensor, batch: int) -> list[torch.Tensor]:
        """The regions of a graph's flat buffer, in the order replay() packs them."""
        rows = list(inputs[: 4 * batch].view(4, batch).unbind(0))
        return rows + [inputs[4 * batch :].view(batch, self.width)]

    def graph_for(self, num_rows: int, max_seq_len: int) -> DecodeGraph | None:
        """The graph a decode step of num_rows rows replays, or None (too many rows, or a
        context past the graphs' block tables: the step runs eagerly)."""
        if not self.graphs or max_seq_len > self.max_context or num_rows > self.sizes[-1]:
            return None
        return self.graphs[self.sizes[bisect.bisect_left(self.sizes, num_rows)]]

    def replay(self, graph: DecodeGraph, inputs: StepInputs, batch: StepBatch) -> torch.Tensor:
        """Run a decode step through `graph`: the step's inputs, padded to the graph's batch,
        go into its static buffer in one copy; returns the logits of every row (the first
        len(batch.decode_lens) are the step's), valid until the next replay of any graph."""
        pad = graph.batch - len(batch.input_ids)
        inputs.pack([
            [*batch.input_ids, *[0] * pad], [*batch.positions, *[0] * pad],
            [*batch.slots, *[PAD_SLOT] * pad], [*batch.decode_lens, *[PAD_SEQ_LEN] * pad],
            Table(batch.decode_tables, self.width, num_rows=graph.batch),
        ], out=graph.inputs)
        graph.replay()
        self.replays += 1
        return graph.logits

    def describe(self) -> str:
        return (f"CUDA graphs for decode steps: batch sizes {self.sizes[0]}..{self.sizes[-1]} "
                f"({len(self.sizes)} graphs), contexts up to {self.max_context} tokens, captured "
                f"in {self.capture_seconds:.2f}s, {self.memory_bytes / 2**20:.0f} MiB")


def capture_decode_graphs(config: EngineConfig, model_config: ModelConfig,
                          model: torch.nn.Module, kv_caches: list[torch.Tensor], *,
                          triton: bool) -> DecodeGraphs | None:
    """A ModelRunner's decode graphs where they apply: CUDA, the Triton attention path
    (`triton`), one rank, not --enforce-eager. A capture that fails leaves the worker eager,
    with the reason in its log."""
    device = kv_caches[0].device
    if device.type != "cuda" or config.enforce_eager or not triton or get_tp().size > 1:
        return None
    limit = model_config.max_position_embeddings
    max_model_len = min(config.max_model_len or limit, limit)
    max_num_seqs = config.scheduler.max_num_seqs
    graphs = DecodeGraphs(
        model, kv_caches, block_size=config.block_size,
        max_context=min(config.cuda_graph_max_context or CUDA_GRAPH_MAX_CONTEXT, max_model_len),
        max_batch=min(config.cuda_graph_max_batch or max_num_seqs, max_num_seqs),
        capture=cuda_capture(device))
    # Capturing empties the allocator's cache first; so must the reading before it, or the
    # cached blocks it frees would be counted against the graphs.
    torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved(device)
    try:
        graphs.capture_all()
        # Outside the KV pool's sizing: it comes out of what --gpu-memory-utilization leaves.
        graphs.memory_bytes = torch.cuda.memory_reserved(device) - reserved
    except Exception:  # eager still serves; the reason goes to the log
        log.exception("CUDA graph capture failed; decode steps run eagerly")
        return None
    log.info("%s", graphs.describe())
    return graphs
