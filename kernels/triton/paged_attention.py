"""One layer's attention over a packed step in Triton: the decode rows through the paged
decode kernel, the other sequences (prefill chunks, prefix hits, verification) through the
varlen prefill kernel, both reading K/V in place from the paged cache.

kernels/attention.py paged_attention calls this after store_kv when the step's backend is
triton; it takes plain tensors and lists, so this package never imports kernels.attention.
"""

from __future__ import annotations

import torch

from kernels.triton.decode_attention import triton_paged_decode_attention
from kernels.triton.prefill_attention import triton_prefill_attention


def triton_paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_decode_tokens: int,
    decode_block_tables: torch.Tensor | None,
    decode_seq_lens: torch.Tensor | None,
    decode_max_seq_len: int,
    prefill_seqs: list[tuple[int, int, int]],
    prefill_block_tables: torch.Tensor | list[torch.Tensor],
    scale: float,
    window: int = 0,
    prefill_seq_info: torch.Tensor | None = None,
) -> torch.Tensor:
    """query: [tokens, heads, D], decode rows first (as AttentionMetadata packs them), this
    step's K/V already stored -> [tokens, heads, D]. prefill_block_tables: one padded
    [sequences, blocks] tensor, or one tensor per sequence."""
    out = torch.empty_like(query)
    if num_decode_tokens:
        triton_paged_decode_attention(
            query[:num_decode_tokens], k_cache, v_cache, decode_block_tables, decode_seq_lens,
            decode_max_seq_len, scale, window, out=out[:num_decode_tokens],
        )
    if prefill_seqs:
        tables = prefill_block_tables
        if not isinstance(tables, torch.Tensor):
            tables = torch.nn.utils.rnn.pad_sequence(list(tables), batch_first=True)
        triton_prefill_attention(query, k_cache, v_cache, prefill_seqs, tables, scale, window,
                                 out=out, seq_info=prefill_seq_info)
    return out
