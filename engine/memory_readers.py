"""Reading a device's memory: the peak a step took above where it started, and what is free
(on CUDA from the allocator's statistics, on a CPU from this process's resident set and
/proc/meminfo). Used by the memory profile at start (engine/memory_profile.py) and by
engine/kernel_choice.py's available_memory."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch


class MemoryReader(ABC):
    """Where the step's peak and the free memory are read: `start` just before the step,
    `peak_above_start` after it, `free_and_total` once the step's temporaries are gone.
    `device_type` picks the sizing rule (kv_budget)."""

    device_type = "cpu"

    @abstractmethod
    def start(self) -> None: ...

    @abstractmethod
    def peak_above_start(self) -> int: ...

    @abstractmethod
    def free_and_total(self) -> tuple[int, int]: ...


class CudaMemory(MemoryReader):
    """torch's caching allocator: its peak of allocated bytes since a reset, and the device's
    free and total memory (cudaMemGetInfo) once the cache is emptied."""

    device_type = "cuda"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._base = 0

    def start(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._base = torch.cuda.memory_allocated(self.device)

    def peak_above_start(self) -> int:
        torch.cuda.synchronize(self.device)
        return max(torch.cuda.max_memory_allocated(self.device) - self._base, 0)

    def free_and_total(self) -> tuple[int, int]:
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(self.device)


class HostMemory(MemoryReader):
    """The process's resident set: the step's peak is its high-water mark (VmHWM, reset through
    /proc/self/clear_refs) above the resident size at the start; where the mark cannot be
    reset, a thread samples VmRSS every millisecond instead. Free is MemAvailable."""

    def __init__(self, proc: str = "/proc", reset_high_water: bool = True) -> None:
        self.proc = proc
        self.reset_high_water = reset_high_water
        self._base = 0
        self._sampler: _RSSSampler | None = None

    def start(self) -> None:
        self._base = self._status_kib("VmRSS") * 1024
        self._sampler = None
        try:
            if not self.reset_high_water:
                raise PermissionError("sampling asked for")
            with open(f"{self.proc}/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        except OSError:
            self._sampler = _RSSSampler(lambda: self._status_kib("VmRSS") * 1024)

    def peak_above_start(self) -> int:
        if self._sampler is not None:
            peak, self._sampler = self._sampler.stop(), None
        else:
            peak = self._status_kib("VmHWM") * 1024
        return max(peak - self._base, 0)

    def free_and_total(self) -> tuple[int, int]:
        info = _read_kib_fields(f"{self.proc}/meminfo")
        return info["MemAvailable"] * 1024, info["MemTotal"] * 1024

    def _status_kib(self, field: str) -> int:
        return _read_kib_fields(f"{self.proc}/self/status")[field]


class _RSSSampler:
    def __init__(self, read: Callable[[], int]) -> None:
        self.read = read
        self.peak = read()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(0.001):
            self.peak = max(self.peak, self.read())

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return max(self.peak, self.read())


def _read_kib_fields(path: str) -> dict[str, int]:
    fields = {}
    with open(path) as f:
        for line in f:
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                fields[name] = int(parts[0])
    return fields


def memory_reader(device: torch.device) -> MemoryReader:
    return CudaMemory(device) if device.type == "cuda" else HostMemory()
