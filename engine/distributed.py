"""The tensor-parallel group of this process. Set once at start-up, before the model is
built; every parallel layer reads it then. Size 1 (the default) makes every collective a no-op."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int = 0
    size: int = 1
    group: object | None = None  # a torch.distributed ProcessGroup when size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        x = x.contiguous()
        self.group.allreduce([x]).wait()
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.group.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)


_TP = TensorParallelGroup()


def set_tensor_parallel_group(group: TensorParallelGroup) -> None:
    global _TP
    _TP = group


def get_tp() -> TensorParallelGroup:
    return _TP


__all__ = ["TensorParallelGroup", "get_tp", "set_tensor_parallel_group", "dist"]
