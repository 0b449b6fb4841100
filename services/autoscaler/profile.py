"""A HardwareProfile: what one worker of a model does per second on one kind of hardware,
measured by `splitserve profile` and read by the planner, `capacity plan` and the simulator.

The measured points are kept as measured; the planner reads timings from small cost models
fitted to them (non-negative least squares on relative error): a prefill step costs
a + b * tokens, a decode step a + b * batch + c * batch * context. Fitting, rather than joining
the points, keeps the curves monotonic when a shared machine makes single points noisy, and
extrapolates sensibly past the largest measurement.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

PROFILE_VERSION = 1


@dataclass(frozen=True)
class PrefillPoint:
    batch_tokens: int
    seconds: float  # one engine step that computes batch_tokens prompt tokens


@dataclass(frozen=True)
class DecodePoint:
    batch_size: int
    context_len: int
    seconds: float  # one decode step: one token for each of batch_size sequences


@dataclass(frozen=True)
class HardwareProfile:
    model: str
    device: str
    dtype: str
    num_threads: int
    block_size: int
    kv_blocks: int  # KV blocks one worker holds at the measured --kv-cache-memory
    kv_bytes_per_block: int
    max_num_batched_tokens: int
    max_num_seqs: int
    long_prefill_token_threshold: int
    model_load_s: float  # building the engine (weights + KV cache) in a running process
    worker_start_s: float  # process spawn to READY; 0 when not measured
    prefill: tuple[PrefillPoint, ...]
    decode: tuple[DecodePoint, ...]
    host: str = ""
    measured_at: str = ""
    notes: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ValueError("a profile needs at least one prefill and one decode point")
        object.__setattr__(self, "prefill", tuple(sorted(self.prefill, key=lambda p: p.batch_tokens)))
        object.__setattr__(self, "decode", tuple(sorted(
            self.decode, key=lambda p: (p.context_len, p.batch_size))))

    # -- reading the measurements ----------------------------------------------------------

    @property
    def startup_s(self) -> float:
        """Seconds from asking for a worker to its taking traffic (what headroom must cover)."""
        return self.worker_start_s or self.model_load_s

    @functools.cached_property
    def prefill_fit(self) -> tuple[float, ...]:
        """(a, b): seconds = a + b * batch_tokens."""
        return _nonnegative_fit([(1.0, p.batch_tokens) for p in self.prefill],
                                [p.seconds for p in self.prefill])

    @functools.cached_property
    def decode_fit(self) -> tuple[float, ...]:
        """(a, b, c): seconds = a + b * batch + c * batch * context."""
        return _nonnegative_fit(
            [(1.0, p.batch_size, p.batch_size * p.context_len) for p in self.decode],
            [p.seconds for p in self.decode])

    def prefill_seconds(self, batch_tokens: float) -> float:
        """One prefill step of batch_tokens tokens."""
        a, b = self.prefill_fit
        return max(a + b * batch_tokens, 1e-6)

    def prefill_tokens_per_s(self, batch_tokens: float) -> float:
        return batch_tokens / self.prefill_seconds(batch_tokens)

    def decode_step_seconds(self, batch_size: float, context_len: float) -> float:
        """One decode step for batch_size sequences of mean context context_len."""
        a, b, c = self.decode_fit
        return max(a + b * batch_size + c * batch_size * context_len, 1e-6)

    def without_contention(self) -> HardwareProfile:
        """The profile as if it had had a CPU to itself: each point divided by the slowdown
        the profiler's thread suffered from other processes while timing it (recorded by
        `splitserve profile` on Linux). A shared CPU host varies by several times within a
        minute; a replica with its own cores does not."""
        factors = self.notes.get("point_slowdown")
        if not factors or self.notes.get("without_contention"):
            return self
        points = [*self.prefill, *self.decode]
        fixed = [dataclasses.replace(p, seconds=round(p.seconds / f, 6))
                 for p, f in zip(points, factors, strict=True)]
        n = len(self.prefill)
        return dataclasses.replace(
            self, prefill=tuple(fixed[:n]), decode=tuple(fixed[n:]),
            notes={**self.notes, "without_contention": True,
                   "as_measured": {"prefill": [asdict(p) for p in self.prefill],
                                   "decode": [asdict(p) for p in self.decode]}})

    def blocks_for(self, tokens: float) -> int:
        return max(1, math.ceil(tokens / self.block_size))

    # -- files ---------------------------------------------------------------------------

    def to_json(self) -> str:
        return json.dumps({"version": PROFILE_VERSION, **asdict(self)}, indent=2)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def from_dict(cls, raw: dict) -> HardwareProfile:
        raw = dict(raw)
        version = raw.pop("version", PROFILE_VERSION)
        if version != PROFILE_VERSION:
            raise ValueError(f"profile version {version} is not {PROFILE_VERSION}; re-run "
                             "`splitserve profile`")
        raw["prefill"] = tuple(PrefillPoint(**p) for p in raw["prefill"])
        raw["decode"] = tuple(DecodePoint(**p) for p in raw["decode"])
        return cls(**raw)

    @classmethod
    def load(cls, path: str | Path) -> HardwareProfile:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read profile {path}: {exc}") from None


def _nonnegative_fit(rows: list[tuple[float, ...]], ys: list[float]) -> tuple[float, ...]:
    """Least squares on relative error with every coefficient >= 0 (an active-set loop:
    a term that wants to be negative is dropped and the rest refitted)."""
    x = np.asarray(rows, dtype=float)
    y = np.asarray(ys, dtype=float)
    weights = 1.0 / np.maximum(y, 1e-9)
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active] * weights[:, None], y * weights, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0.0
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return tuple(float(c) for c in coef)
