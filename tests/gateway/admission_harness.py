"""An Admission over a scripted worker pool (no processes, no gRPC), for the admission unit
tests: the decode workers' Health stats are plain protobufs a test sets."""

from __future__ import annotations

from splitserve.v1 import common_pb2

from engine.sampling_params import SamplingParams
from services.gateway.admission.admission import Admission
from services.gateway.admission.capacity import CapacityRule, ClusterRoom
from services.gateway.admission.fair_queue import FairQueue
from services.gateway.admission.quota import Quotas
from services.gateway.admission.tenants import Tenant, TenantDirectory
from services.gateway.admission.ttft_estimator import TTFTEstimator
from services.gateway.generation_spec import GenerationSpec


class FakeEndpoint:
    def __init__(self, role: str = "both", kv_free: int = 1000, kv_total: int = 1000,
                 queued_prefill_tokens: int = 0) -> None:
        self.role = role
        self.up = True
        self.set_stats(kv_free, kv_total, queued_prefill_tokens)

    def set_stats(self, kv_free: int, kv_total: int = 1000, queued_prefill_tokens: int = 0):
        """A new poll answer (a new object, as the real pool stores)."""
        self.health = common_pb2.HealthResponse(stats=common_pb2.WorkerStats(
            kv_blocks_free=kv_free, kv_blocks_total=kv_total,
            queued_prefill_tokens=queued_prefill_tokens))

    @property
    def stats(self) -> common_pb2.WorkerStats:
        return self.health.stats

    def available(self) -> bool:
        return self.up


class FakePool:
    def __init__(self, *endpoints: FakeEndpoint) -> None:
        self.endpoints = list(endpoints) or [FakeEndpoint()]

    @property
    def disaggregated(self) -> bool:
        return any(e.role == "prefill" for e in self.endpoints)

    def decoders(self):
        return [e for e in self.endpoints if e.role in ("decode", "both")]

    def prefillers(self):
        return [e for e in self.endpoints if e.role == "prefill"]

    def block_size(self) -> int:
        return 16


def make_admission(*tenants: Tenant, rule: CapacityRule = CapacityRule(max_inflight=1),
                   pool: FakePool | None = None, ttft_target_s: float = 0.0,
                   policy: str = "vtc") -> Admission:
    directory = TenantDirectory(tenants, {f"{t.name}-digest": t.name for t in tenants})
    return Admission(directory, Quotas(), FairQueue(policy), ClusterRoom(rule, pool or FakePool()),
                     TTFTEstimator(), ttft_target_s)


def spec(prompt_tokens: int = 10, max_tokens: int = 6, index: int = 0) -> GenerationSpec:
    return GenerationSpec(f"req-{index}", index, tuple(range(5, 5 + prompt_tokens)),
                          SamplingParams(max_tokens=max_tokens, seed=1))
