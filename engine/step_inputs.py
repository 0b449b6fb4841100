"""Small tensors between host and device with as few waits as possible. StepInputs packs a
step's inputs (token ids, positions, cache slots, block tables, context lengths; the sampler's
per-row settings) into one buffer moved in one copy: on CUDA from pinned host memory, without
blocking the host; on CPU the tensors are views of one tensor built from the lists. fetch
brings several results back with one wait.

Owned by the engine thread (ModelRunner and its Sampler build theirs).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Table:
    """Rows of ints padded with `fill` to `width` columns, and to `num_rows` rows when that is
    more than the rows given (a CUDA graph's padded batch). Packs to a [rows, width] tensor."""

    rows: Sequence[Sequence[int]]
    width: int
    fill: int = 0
    num_rows: int = 0

    @property
    def shape(self) -> tuple[int, int]:
        return max(self.num_rows, len(self.rows)), self.width

    def write_into(self, array: np.ndarray) -> None:
        """Fill `array` ([rows, width], this table's shape) in place. Each row's ints are
        converted once; padding is a fill, not a list: a CUDA graph's table at batch 256 is
        131,072 entries, mostly padding."""
        fill, width = self.fill, self.width
        array.fill(fill)
        for i, row in enumerate(self.rows):
            n = min(len(row), width)  # blocks reserved past the columns the step reads: cut
            if n:
                array[i, :n] = row if n == len(row) else row[:n]


Part = Sequence[int] | Table


class StepInputs:
    """Packs parts (number lists, Tables) into one buffer of `dtype` (int64 unless told). On
    CUDA two pinned host buffers take turns, each written again only after the copy that read
    it has run (an event), so the host never waits on the step before."""

    def __init__(self, device: torch.device, dtype: torch.dtype = torch.long) -> None:
        self.device = device
        self.dtype = dtype
        self._pinned = device.type == "cuda"
        self._host: list[torch.Tensor] = []  # pinned staging buffers (CUDA)
        self._copied: list[torch.cuda.Event | None] = []
        self._turn = 0

    def pack(self, parts: Sequence[Part], out: torch.Tensor | None = None) -> list[torch.Tensor]:
        """One tensor on the device per part ([rows, width] for a Table), each a view of one
        buffer: `out` when given (a flat device buffer of this dtype at least as long, such as
        a CUDA graph's static inputs), else a new one."""
        shapes = [part.shape if isinstance(part, Table) else (len(part),) for part in parts]
        sizes = [math.prod(shape) for shape in shapes]
        n = sum(sizes)
        if out is not None and out.numel() < n:
            raise ValueError(f"{n} inputs do not fit a buffer of {out.numel()}")
        # The host side: this turn's pinned buffer on CUDA, a new tensor on the CPU.
        host = self._staging(n) if self._pinned else torch.empty(n, dtype=self.dtype)
        array, at = host.numpy(), 0
        for part, shape, size in zip(parts, shapes, sizes, strict=True):
            if isinstance(part, Table):
                part.write_into(array[at : at + size].reshape(shape))
            elif size:
                array[at : at + size] = part
            at += size
        buffer = self._to_device(host, n, out)
        views, at = [], 0
        for shape, size in zip(shapes, sizes, strict=True):
            views.append(buffer[at : at + size].view(shape))
            at += size
        return views

    def _to_device(self, host: torch.Tensor, n: int, out: torch.Tensor | None) -> torch.Tensor:
        if not self._pinned:  # the CPU: the host tensor is the buffer
            if out is None:
                return host
            out[:n].copy_(host)
            return out
        target = out if out is not None else torch.empty(n, dtype=self.dtype, device=self.device)
        target[:n].copy_(host[:n], non_blocking=True)
        event = self._copied[self._turn]
        if event is None:
            event = self._copied[self._turn] = torch.cuda.Event()
        event.record()
        self._turn ^= 1
        return target

    def _staging(self, n: int) -> torch.Tensor:
        """This turn's pinned buffer with room for n, once its last copy has been read."""
        if not self._host:
            self._host = [torch.empty(0, dtype=self.dtype)] * 2
            self._copied = [None, None]
        event = self._copied[self._turn]
        if event is not None:
            event.synchronize()  # the copy two steps back: long done, in practice
        if self._host[self._turn].numel() < n:
            size = max(n, 2 * self._host[self._turn].numel(), 1 << 14)
            self._host[self._turn] = torch.empty(size, dtype=self.dtype, pin_memory=True)
        return self._host[self._turn]


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A list as a tensor on `device` without waiting for it: on CUDA through pinned memory
    with a non-blocking copy (torch's pinned allocator keeps the host block until the copy has
    run), where torch.tensor(values, device=...) copies from pageable memory and so waits for
    every kernel queued before it."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def fetch(*tensors: torch.Tensor) -> list[list]:
    """Each tensor's .tolist(), with one wait for the device: on CUDA every copy to the host is
    queued without blocking and the stream is synchronized once (a .tolist() apiece would
    wait once apiece)."""
    if not tensors or not tensors[0].is_cuda:
        return [t.tolist() for t in tensors]
    host = [t.to("cpu", non_blocking=True) for t in tensors]
    torch.cuda.current_stream(tensors[0].device).synchronize()
    return [h.tolist() for h in host]
