"""What one replica sustains within the SLOs, from a HardwareProfile and a workload shape, and
how many replicas a demand needs. Shared by the planner, `capacity plan` and the simulator.

Prefill is a queue in front of batched steps: a replica may be loaded up to the utilisation at
which the queueing delay (Pollaczek-Khinchine, M/G/1, with `tail_factor` turning the mean wait
into a high percentile) plus the prompt's own prefill still fits the TTFT target. Decode keeps
as many sequences per replica as the ITL target and the KV cache allow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.autoscaler.profile import HardwareProfile


@dataclass(frozen=True)
class SLO:
    ttft_s: float = 2.0  # time to first token, per request
    itl_s: float = 0.2  # mean inter-token latency of a request's decode

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.itl_s <= 0:
            raise ValueError("SLO targets must be > 0")


@dataclass(frozen=True)
class LengthClass:
    prompt_tokens: int
    output_tokens: int
    weight: float = 1.0


@dataclass(frozen=True)
class WorkloadShape:
    """The request length mix: classes of (prompt, output) tokens with weights."""

    classes: tuple[LengthClass, ...]

    @classmethod
    def single(cls, prompt_tokens: float, output_tokens: float) -> WorkloadShape:
        return cls((LengthClass(max(1, round(prompt_tokens)), max(1, round(output_tokens))),))

    @classmethod
    def parse(cls, text: str) -> WorkloadShape:
        """'256:64' or '256:64:0.7,2048:256:0.3' (prompt:output[:weight], comma-separated)."""
        classes = []
        for part in text.split(","):
            fields = part.strip().split(":")
            if len(fields) not in (2, 3):
                raise ValueError(f"length class {part!r} is not prompt:output[:weight]")
            weight = float(fields[2]) if len(fields) == 3 else 1.0
            classes.append(LengthClass(int(fields[0]), int(fields[1]), weight))
        if not classes or any(c.prompt_tokens < 1 or c.output_tokens < 1 or c.weight <= 0
                              for c in classes):
            raise ValueError(f"bad length mix {text!r}")
        return cls(tuple(classes))

    def _mean(self, value) -> float:
        total = sum(c.weight for c in self.classes)
        return sum(c.weight * value(c) for c in self.classes) / total

    @property
    def mean_prompt_tokens(self) -> float:
        return self._mean(lambda c: c.prompt_tokens)

    @property
    def mean_output_tokens(self) -> float:
        return self._mean(lambda c: c.output_tokens)

    @property
    def mean_decode_context(self) -> float:
        """The mean context of a sequence in a decode batch: each request is there for its
        output_tokens steps (long outputs weigh more), at prompt + half its output on average."""
        steps = self._mean(lambda c: c.output_tokens)
        return self._mean(lambda c: c.output_tokens * (c.prompt_tokens + c.output_tokens / 2)) / steps

    def describe(self) -> str:
        return ",".join(f"{c.prompt_tokens}:{c.output_tokens}:{c.weight:g}" for c in self.classes)


@dataclass(frozen=True)
class PrefillCapacity:
    tokens_per_s: float  # prompt tokens/s one replica sustains within the TTFT target
    peak_tokens_per_s: float  # what it computes flat out
    service_s: float  # prefill of a mean prompt on an idle replica
    utilization: float  # tokens_per_s / peak_tokens_per_s
    feasible: bool  # False: even an idle replica misses the TTFT target


@dataclass(frozen=True)
class DecodeCapacity:
    batch_size: int  # sequences per replica
    step_s: float  # decode step at that batch
    tokens_per_s: float  # output tokens/s one replica sustains within the ITL target
    kv_blocks: float  # blocks one replica may fill (kv_blocks x kv_utilization)
    limited_by: str  # itl | kv | max_num_seqs
    feasible: bool  # False: even one sequence misses the ITL target


@dataclass(frozen=True)
class CapacityModel:
    """Knobs of the capacity arithmetic (the defaults are what the simulator was tuned with)."""

    max_utilization: float = 0.85  # never plan a prefill replica busier than this
    tail_factor: float = 3.0  # p95 queueing delay ~ 3x the mean (exponential tail)
    overhead_s: float = 0.02  # per request: RPCs, KV hand-off, scheduling
    # The batch of a replica fluctuates around its mean (arrivals are random; ~Poisson, so by
    # about sqrt(mean)): plan a mean batch b with b + batch_tail_z * sqrt(b) within the ITL.
    batch_tail_z: float = 2.0
    kv_utilization: float = 0.9  # share of KV blocks to plan for

    def prefill(self, profile: HardwareProfile, slo: SLO, shape: WorkloadShape) -> PrefillCapacity:
        total = sum(c.weight for c in shape.classes)
        services = [(c.weight / total, _prompt_seconds(profile, c.prompt_tokens)) for c in shape.classes]
        mean_s = sum(w * s for w, s in services)
        second_moment = sum(w * s * s for w, s in services)
        prompt = shape.mean_prompt_tokens
        # Under load a step holds several prompts: throughput at the batch a queue forms.
        batch = min(profile.max_num_batched_tokens, 2 * prompt)
        peak = profile.prefill_tokens_per_s(batch)
        slack = slo.ttft_s - mean_s - self.overhead_s
        if slack <= 0:
            return PrefillCapacity(0.0, peak, mean_s, 0.0, False)
        # P-K: W = rho * E[S^2] / (2 E[S] (1 - rho)); want tail_factor * W <= slack.
        k = slack * 2 * mean_s / (self.tail_factor * second_moment)
        rho = min(k / (1 + k), self.max_utilization)
        return PrefillCapacity(rho * peak, peak, mean_s, rho, True)

    def decode(self, profile: HardwareProfile, slo: SLO, shape: WorkloadShape,
               context_tokens: float | None = None) -> DecodeCapacity:
        context = context_tokens if context_tokens is not None else shape.mean_decode_context
        itl_batch = _largest_batch(profile, context, slo.itl_s)
        kv_blocks = profile.kv_blocks * self.kv_utilization
        kv_batch = int(kv_blocks // (profile.blocks_for(context) + 1))
        limits = {"itl": itl_batch, "kv": kv_batch, "max_num_seqs": profile.max_num_seqs}
        limited_by = min(limits, key=limits.get)
        batch = max(1, limits[limited_by])
        if limited_by == "itl":
            # b + z sqrt(b) <= limit  <=>  sqrt(b) <= (-z + sqrt(z^2 + 4 limit)) / 2
            root = (-self.batch_tail_z + math.sqrt(self.batch_tail_z ** 2 + 4 * batch)) / 2
            batch = max(1, math.floor(root * root))
        step = profile.decode_step_seconds(batch, context)
        feasible = profile.decode_step_seconds(1, context) <= slo.itl_s
        return DecodeCapacity(batch, step, batch / step, kv_blocks, limited_by, feasible)


def _prompt_seconds(profile: HardwareProfile, prompt_tokens: float) -> float:
    """Prefill of one prompt alone on a prefill worker: nothing decodes there, so the scheduler
    takes it whole up to the token budget (long_prefill_token_threshold cuts only steps that
    carry decoding requests)."""
    chunk = profile.max_num_batched_tokens or prompt_tokens
    full, rest = divmod(prompt_tokens, chunk)
    seconds = full * profile.prefill_seconds(chunk)
    return seconds + (profile.prefill_seconds(rest) if rest else 0.0)


def _largest_batch(profile: HardwareProfile, context: float, itl_s: float) -> int:
    """The largest batch whose decode step fits itl_s (binary search; steps grow with batch)."""
    lo, hi = 0, profile.max_num_seqs
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if profile.decode_step_seconds(mid, context) <= itl_s:
            lo = mid
        else:
            hi = mid - 1
    return lo


def replicas_for(demand: float, per_replica: float) -> int:
    """ceil(demand / per_replica), tolerant of float noise; 0 demand needs 0 replicas."""
    if demand <= 0:
        return 0
    if per_replica <= 0:
        return 1 << 30
    return max(1, math.ceil(demand / per_replica - 1e-9))


@dataclass(frozen=True)
class CapacityPlan:
    rate: float  # requests/s
    shape: WorkloadShape
    slo: SLO
    prefill_replicas: int  # including spare
    decode_replicas: int
    spare: int  # replicas per role kept for failures
    prefill: PrefillCapacity
    decode: DecodeCapacity
    prompt_tokens_per_s: float
    output_tokens_per_s: float
    decode_sequences: float  # concurrent sequences (Little's law)

    def describe(self) -> str:
        p, d = self.prefill, self.decode
        lines = [
            f"{self.rate:g} requests/s, length mix {self.shape.describe()} (prompt:output:weight), "
            f"TTFT <= {self.slo.ttft_s:g}s, ITL <= {self.slo.itl_s * 1e3:g}ms",
            f"prefill: {self.prefill_replicas} workers  ({self.prompt_tokens_per_s:.0f} prompt tokens/s; "
            f"{p.tokens_per_s:.0f}/s each at {p.utilization:.0%} of {p.peak_tokens_per_s:.0f}/s; "
            f"idle prefill of a mean prompt {p.service_s * 1e3:.0f}ms)",
            f"decode:  {self.decode_replicas} workers  ({self.output_tokens_per_s:.0f} output tokens/s, "
            f"{self.decode_sequences:.1f} concurrent sequences; {d.tokens_per_s:.0f}/s each at "
            f"batch {d.batch_size} ({d.limited_by}-limited), step {d.step_s * 1e3:.0f}ms)",
        ]
        if self.spare:
            lines.append(f"both counts include {self.spare} spare worker(s) per role to survive "
                         f"{self.spare} failure(s)")
        for name, ok in (("prefill", p.feasible), ("decode", d.feasible)):
            if not ok:
                lines.append(f"WARNING: {name} cannot meet its target on this hardware at any scale")
        return "\n".join(lines)


def plan_for_rate(profile: HardwareProfile, rate: float, shape: WorkloadShape, slo: SLO,
                  spare: int = 1, model: CapacityModel | None = None) -> CapacityPlan:
    """Workers per role for `rate` requests/s of `shape` within `slo`, plus `spare` per role."""
    model = model or CapacityModel()
    prefill = model.prefill(profile, slo, shape)
    decode = model.decode(profile, slo, shape)
    prompt_tps = rate * shape.mean_prompt_tokens
    output_tps = rate * shape.mean_output_tokens
    sequences = output_tps * decode.step_s
    kv_needed = sequences * (profile.blocks_for(shape.mean_decode_context) + 1)
    n_prefill = max(1, replicas_for(prompt_tps, prefill.tokens_per_s))
    n_decode = max(1, replicas_for(output_tps, decode.tokens_per_s),
                   replicas_for(kv_needed, decode.kv_blocks))
    return CapacityPlan(rate, shape, slo, n_prefill + spare, n_decode + spare, spare, prefill,
                        decode, prompt_tps, output_tps, sequences)
