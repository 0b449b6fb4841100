"""A step's integer inputs (token ids, positions, cache slots, block tables, context lengths)
packed into one buffer and moved to the device in one copy: on CUDA from pinned host memory,
without blocking the host; on CPU the tensors are views of one tensor built from the lists.

Owned by the engine thread (ModelRunner builds one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Table:
    """Rows of ints padded with `fill` to `width` columns, and to `num_rows` rows when that is
    more than the rows given (a CUDA graph's padded batch). Packs to a [rows, width] tensor."""

    rows: Sequence[Sequence[int]]
    width: int
    fill: int = 0
    num_rows: int = 0

    def flatten_into(self, flat: list[int]) -> tuple[int, int]:
        fill, width = self.fill, self.width
        for row in self.rows:
            if len(row) > width:  # blocks reserved past the columns the step reads
                row = row[:width]
            flat.extend(row)
            flat.extend([fill] * (width - len(row)))
        extra = self.num_rows - len(self.rows)
        if extra > 0:
            flat.extend([fill] * (extra * width))
        return max(self.num_rows, len(self.rows)), width


Part = Sequence[int] | Table


class StepInputs:
    """Packs parts (int lists, Tables) into one int64 buffer. On CUDA two pinned host buffers
    take turns, each written again only after the copy that read it has run (an event), so
    the host never waits on the step before."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned = device.type == "cuda"
        self._host: list[torch.Tensor] = []  # pinned staging buffers (CUDA)
        self._copied: list[torch.cuda.Event | None] = []
        self._turn = 0

    def pack(self, parts: Sequence[Part], out: torch.Tensor | None = None) -> list[torch.Tensor]:
        """One tensor on the device per part ([rows, width] for a Table), each a view of one
        buffer: `out` when given (a flat int64 device buffer at least as long, such as a CUDA
        graph's static inputs), else a new one."""
        flat: list[int] = []
        shapes: list[tuple[int, ...]] = []
        for part in parts:
            if isinstance(part, Table):
                shapes.append(part.flatten_into(flat))
            else:
                flat.extend(part)
                shapes.append((len(part),))
        buffer = self._to_device(flat, out)
        views, at = [], 0
        for shape in shapes:
            size = shape[0] * (shape[1] if len(shape) == 2 else 1)
            views.append(buffer[at : at + size].view(shape))
            at += size
        return views

    def _to_device(self, flat: list[int], out: torch.Tensor | None) -> torch.Tensor:
        n = len(flat)
        if out is not None and out.numel() < n:
            raise ValueError(f"{n} inputs do not fit a buffer of {out.numel()}")
        if not self._pinned:  # the CPU: the list's tensor is the buffer
            host = torch.tensor(flat, dtype=torch.long)
            if out is None:
                return host
            out[:n].copy_(host)
            return out
        host = self._staging(n)
        host.numpy()[:n] = flat
        target = out if out is not None else torch.empty(n, dtype=torch.long, device=self.device)
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
            self._host = [torch.empty(0, dtype=torch.long)] * 2
            self._copied = [None, None]
        event = self._copied[self._turn]
        if event is not None:
            event.synchronize()  # the copy two steps back: long done, in practice
        if self._host[self._turn].numel() < n:
            size = max(n, 2 * self._host[self._turn].numel(), 1 << 14)
            self._host[self._turn] = torch.empty(size, dtype=torch.long, pin_memory=True)
        return self._host[self._turn]
