"""KVBufferPool: reusable receive buffers, so a payload lands in memory that is already mapped.

A fresh multi-MiB CPU tensor is page-faulted in during the receive and halves gloo throughput;
reusing buffers removes that cost. Reuse is opt-in per buffer: only `release()`d buffers return.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

# release() recognises buffers it lent by address; the record of one that its owner dropped
# without releasing is forgotten after this many newer loans.
_MAX_LENT_RECORDS = 4096


class KVBufferPool:
    """Hands out contiguous payload tensors backed by pooled flat byte buffers.

    Ownership: `acquire()` gives the caller (ultimately on_kv) sole ownership. The owner may
    `release()` the tensor (or any view of it) once nothing reads it any more; a buffer that is
    never released is simply freed by the garbage collector. Releasing while still reading is a
    use-after-free bug: the next transfer overwrites it. Thread-safe (one lock).
    """

    def __init__(self, device: str | torch.device = "cpu", max_idle_bytes: int = 256 << 20):
        self.device = torch.device(device)
        self.max_idle_bytes = max_idle_bytes
        self._lock = threading.Lock()
        self._idle: list[torch.Tensor] = []  # flat uint8 buffers, sorted by capacity
        self._idle_bytes = 0
        # Storage address -> capacity of every buffer lent out and not yet back. No reference
        # is kept, so an owner that never releases lets the buffer be freed as usual.
        self._lent: OrderedDict[int, int] = OrderedDict()

    def acquire(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor of `shape`/`dtype`, contents undefined."""
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        flat = self._take(nbytes)
        if flat is None:
            flat = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        with self._lock:
            self._lent[flat.data_ptr()] = flat.numel()
            if len(self._lent) > _MAX_LENT_RECORDS:
                self._lent.popitem(last=False)
        return flat[:nbytes].view(dtype).view(shape)

    def release(self, tensor: torch.Tensor) -> bool:
        """Return a tensor from `acquire()` (or a view of it) to the pool.

        Returns False, and does nothing, for a tensor this pool did not lend or already has back.
        """
        storage = tensor.untyped_storage()
        with self._lock:
            if self._lent.get(storage.data_ptr()) != storage.nbytes():
                return False
            del self._lent[storage.data_ptr()]
            flat = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
            self._idle.append(flat)
            self._idle.sort(key=lambda t: t.numel())
            self._idle_bytes += flat.numel()
            # Evict the smallest first: a large idle buffer can serve any later payload.
            while self._idle_bytes > self.max_idle_bytes:
                self._idle_bytes -= self._idle.pop(0).numel()
        return True

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return self._idle_bytes

    def _take(self, nbytes: int) -> torch.Tensor | None:
        with self._lock:
            # Best fit, but never pin a buffer more than 4x too big to a small payload.
            for i, flat in enumerate(self._idle):
                if nbytes <= flat.numel() <= max(4 * nbytes, 1 << 20):
                    self._idle_bytes -= flat.numel()
                    return self._idle.pop(i)
        return None
