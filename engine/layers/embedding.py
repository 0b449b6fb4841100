"""Vocabulary-parallel token embedding and LM head: each rank holds a slice of the vocab."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import get_tp
from kernels.linear import linear


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        tp = get_tp()
        self.tp = tp
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // tp.size)  # the last shard may be padded
        self.start = tp.rank * self.per_rank
        self.weight = nn.Parameter(torch.zeros(self.per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        shard = loaded[self.start : self.start + self.per_rank]
        param.data[: shard.shape[0]].copy_(shard)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to logits; only the rows needed for sampling are passed in,
    and the vocab shards are gathered only then."""

    small_m_max_rows = 0  # see engine.layers.linear.use_small_m_linear
    packed_weight: torch.Tensor | None = None  # see engine.layers.linear.use_packed_weights

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.weight, None, self.small_m_max_rows, self.packed_weight)
        logits = self.tp.all_gather_last_dim(logits)
        return logits[..., : self.vocab_size]
