"""The draft model of speculative decoding with its own paged KV cache: runs batches of
(tokens, first position, block table) and returns the logits after each sequence's last token.

Owned by the engine thread. Separate from the target's ModelRunner on purpose: it keeps no
per-request state (the DraftModelProposer does) and never samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import ModelConfig
from engine.models.loader import load_model
from kernels.attention import AttentionMetadata, decode_attention_mask


@dataclass
class DraftSeq:
    token_ids: list[int]  # tokens to run, the first at position `start`
    start: int
    block_ids: list[int]  # covers positions [0, start + len(token_ids))


class DraftRunner:
    def __init__(self, model_config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 num_blocks: int, block_size: int) -> None:
        self.model_config = model_config
        self.device = device
        self.block_size = block_size
        self.model = load_model(model_config, dtype, device)
        kv_heads = self.model.layers[0].self_attn.num_kv_heads
        self.kv_cache = torch.zeros(
            model_config.num_layers, 2, num_blocks, block_size, kv_heads, model_config.head_dim,
            dtype=dtype, device=device,
        )
        self.kv_caches = list(self.kv_cache.unbind(0))

    @torch.inference_mode()
    def forward(self, seqs: list[DraftSeq]) -> torch.Tensor:
        """Write the sequences' KV and return float32 logits [len(seqs), vocab], in order."""
        bs = self.block_size
        # One-token sequences first: the batched decode path takes them.
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].token_ids) != 1)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefill_seqs: list[tuple[int, int, int]] = []
        prefill_tables: list[torch.Tensor] = []
        last_rows = [0] * len(seqs)
        for i in order:
            seq = seqs[i]
            n, start = len(seq.token_ids), seq.start
            end = start + n
            row0 = len(input_ids)
            input_ids.extend(seq.token_ids)
            positions.extend(range(start, end))
            blocks = seq.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            if n == 1:
                decode_tables.append(blocks)
                decode_lens.append(end)
            else:
                prefill_seqs.append((row0, n, end))
                prefill_tables.append(torch.tensor(blocks, dtype=torch.long, device=self.device))
            last_rows[i] = row0 + n - 1
        dev = self.device
        max_len = max(decode_lens, default=0)
        seq_lens = mask = None
        if decode_lens and min(decode_lens) < max_len:
            seq_lens = torch.tensor(decode_lens, dtype=torch.long, device=dev)
            mask = decode_attention_mask(seq_lens, max_len)
        tables = None
        if decode_tables:
            width = max(len(t) for t in decode_tables)
            tables = torch.tensor([t + [0] * (width - len(t)) for t in decode_tables],
                                  dtype=torch.long, device=dev)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            num_decode_tokens=len(decode_lens),
            decode_block_tables=tables,
            decode_seq_lens=seq_lens,
            decode_max_seq_len=max_len,
            prefill_seqs=prefill_seqs,
            prefill_block_tables=prefill_tables,
            decode_attn_mask=mask,
        )
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            self.kv_caches,
            meta,
        )
        return self.model.compute_logits(hidden[last_rows]).float()
