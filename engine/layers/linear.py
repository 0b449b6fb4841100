"""Linear layers split across the tensor-parallel group (Megatron style).

Column-parallel layers split output features, row-parallel layers split input features and
all-reduce their output. Each parameter carries a `weight_loader` that takes the full
checkpoint tensor and keeps this rank's shard, so no rank materialises the whole model.
The matmul is kernels.linear.linear: torch's, or on CPU in bf16 from weights packed for the
AMX kernel or oneDNN (use_packed_weights), or the C++ small-M kernel for decode on CPU.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.distributed import get_tp
from kernels.linear import linear
from kernels.packed_weights import amx_packable, pack_weight


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) is not divisible by tensor parallel size {parts}")
    return total // parts


def use_small_m_linear(model: nn.Module, max_rows: int) -> int:
    """Send the model's linear layers' inputs of at most `max_rows` rows to the C++ small-M
    kernel (0: none); the caller has checked it suits the weights (kernels/linear.py).
    Returns the number of layers set."""
    layers = [m for m in model.modules() if hasattr(m, "small_m_max_rows")]
    for layer in layers:
        layer.small_m_max_rows = max_rows
    return len(layers)


def use_packed_weights(model: nn.Module, layout: str) -> int:
    """Give every linear layer (and the LM head) a copy of its weight packed in `layout`
    ("amx" or "packed": kernels/packed_weights.py), which its matmuls then read past the
    small-M kernel's rows; the caller has checked the weights are CPU bfloat16 and suit the
    layout (amx_layout_fits). Returns the bytes the copies take."""
    total = 0
    for layer in packable_layers(model):
        layer.packed_weight = pack_weight(layer.weight, layout)
        total += layer.packed_weight.numel() * layer.packed_weight.element_size()
    return total


def packable_layers(model: nn.Module) -> list[nn.Module]:
    """The linear layers (and the LM head) use_packed_weights gives a packed copy."""
    return [layer for layer in model.modules()
            if hasattr(layer, "small_m_max_rows") and layer.packed_weight is None]


def packable_bytes(model: nn.Module) -> int:
    """About what use_packed_weights would add: the bytes of the weights it packs (the AMX
    layout pads each weight's rows to a multiple of 32)."""
    return sum(layer.weight.numel() * layer.weight.element_size() for layer in packable_layers(model))


def amx_layout_fits(model: nn.Module) -> bool:
    """Whether the AMX kernel takes every weight use_packed_weights would pack."""
    return all(amx_packable(layer.weight) for layer in packable_layers(model))


class ColumnParallelLinear(nn.Module):
    small_m_max_rows = 0  # see use_small_m_linear
    packed_weight: torch.Tensor | None = None  # see use_packed_weights

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        tp = get_tp()
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.in_features = in_features
        self.out_per_rank = _divide(out_features, tp.size, "output features")
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_per_rank), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        shard = loaded.narrow(0, self.tp_rank * self.out_per_rank, self.out_per_rank)
        param.data.copy_(shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.small_m_max_rows, self.packed_weight)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input fused into one matmul (gate + up)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V in one matmul. Heads are split across ranks; when there are fewer KV heads
    than ranks, each KV head is replicated on the ranks whose query heads use it."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool
    ) -> None:
        tp_size = get_tp().size
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp_size, "attention heads")
        if num_kv_heads >= tp_size:
            self.num_kv_heads = _divide(num_kv_heads, tp_size, "KV heads")
            self.kv_replicas = 1
        else:
            self.num_kv_heads = 1
            self.kv_replicas = _divide(tp_size, num_kv_heads, "ranks per KV head")
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, out, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, start = 0, q_size, self.tp_rank * q_size
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size = kv_size
            start = (self.tp_rank // self.kv_replicas) * kv_size
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, start, size))


class RowParallelLinear(nn.Module):
    small_m_max_rows = 0  # see use_small_m_linear
    packed_weight: torch.Tensor | None = None  # see use_packed_weights

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        tp = get_tp()
        self.tp = tp
        self.in_per_rank = _divide(in_features, tp.size, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self._bias_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(loaded.narrow(1, self.tp.rank * self.in_per_rank, self.in_per_rank))

    def _bias_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(linear(x, self.weight, None, self.small_m_max_rows,
                                        self.packed_weight))
        # The bias is added once, after the reduction.
        return out if self.bias is None else out + self.bias
