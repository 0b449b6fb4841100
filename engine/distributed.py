"""The tensor-parallel group of this process. Set once at start-up, before the model is
built; every parallel layer reads it then. Size 1 (the default) makes every collective a no-op.

Also which tensor-parallel sizes a model's shapes allow, and how a group is built from a store
(gloo on CPU, NCCL on CUDA) without a global `init_process_group`.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class CollectiveStats:
    """Wall time this rank spent in collectives (read by bench/tp.py). Owned by the engine
    thread. With `synchronize`, CUDA collectives wait for the device before and after, so the
    time is the collective's own and not only its launch (costs overlap; benchmarks only)."""

    seconds: float = 0.0
    calls: int = 0
    synchronize: bool = False


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int = 0
    size: int = 1
    group: object | None = None  # a torch.distributed ProcessGroup when size > 1
    device: torch.device = torch.device("cpu")  # where the group's tensors live (NCCL: CUDA)
    stats: CollectiveStats = field(default_factory=CollectiveStats, compare=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        x = x.contiguous()
        start = self._start(x)
        self.group.allreduce([x]).wait()
        self._stop(x, start)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        x = x.contiguous()
        start = self._start(x)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.group.allgather([parts], [x]).wait()
        self._stop(x, start)
        return torch.cat(parts, dim=-1)

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's `value` (e.g. KV blocks that fit on each device)."""
        if self.size == 1:
            return value
        x = torch.tensor([value], dtype=torch.int64, device=self.device)
        self.group.allreduce([x], _min_options()).wait()
        return int(x.item())

    def _start(self, x: torch.Tensor) -> float:
        if self.stats.synchronize and x.is_cuda:
            torch.cuda.synchronize(x.device)
        return time.perf_counter()

    def _stop(self, x: torch.Tensor, start: float) -> None:
        if self.stats.synchronize and x.is_cuda:
            torch.cuda.synchronize(x.device)
        self.stats.seconds += time.perf_counter() - start
        self.stats.calls += 1


def _min_options() -> dist.AllreduceOptions:
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MIN
    return options


_TP = TensorParallelGroup()


def set_tensor_parallel_group(group: TensorParallelGroup) -> None:
    global _TP
    _TP = group


def get_tp() -> TensorParallelGroup:
    return _TP


def new_process_group(
    store: dist.Store, rank: int, size: int, device: torch.device, timeout_s: float
) -> object:
    """A `size`-rank group under its own prefix of `store`: NCCL on CUDA, gloo on CPU. Every
    collective on it gives up after timeout_s (a peer that died or hangs)."""
    prefix = dist.PrefixStore("tp/group", store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        if not hasattr(dist, "ProcessGroupNCCL"):
            raise RuntimeError("this torch build has no NCCL; tensor parallelism on CUDA needs it")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefix, rank, size, options)
    return dist.ProcessGroupGloo(prefix, rank, size, timeout)


def valid_tensor_parallel_sizes(num_heads: int, num_kv_heads: int, intermediate_size: int) -> list[int]:
    """Sizes that split the attention heads and the MLP evenly; KV heads are either split
    evenly or, when there are fewer of them than ranks, replicated (ranks a multiple of them)."""
    return [
        n for n in range(1, num_heads + 1)
        if num_heads % n == 0 and intermediate_size % n == 0
        and (num_kv_heads % n == 0 or n % num_kv_heads == 0)
    ]


def check_tensor_parallel_size(
    size: int, num_heads: int, num_kv_heads: int, intermediate_size: int, model: str = "the model"
) -> None:
    """Raise ValueError naming why `size` does not fit and which sizes would."""
    valid = valid_tensor_parallel_sizes(num_heads, num_kv_heads, intermediate_size)
    if size in valid:
        return
    if size < 1:
        reason = "it must be at least 1"
    elif num_heads % size:
        reason = f"its {num_heads} attention heads do not divide by {size}"
    elif intermediate_size % size:
        reason = f"its MLP width {intermediate_size} does not divide by {size}"
    else:
        reason = (f"its {num_kv_heads} KV heads neither divide by {size} nor divide {size} "
                  "(to be replicated)")
    raise ValueError(
        f"tensor parallel size {size} does not fit {model}: {reason}; "
        f"valid sizes: {', '.join(map(str, valid))}"
    )


__all__ = [
    "CollectiveStats",
    "TensorParallelGroup",
    "check_tensor_parallel_size",
    "dist",
    "get_tp",
    "new_process_group",
    "set_tensor_parallel_group",
    "valid_tensor_parallel_sizes",
]
