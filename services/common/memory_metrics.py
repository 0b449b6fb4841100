"""The worker's memory at start (engine/memory_profile.py) on /metrics: weight bytes, KV pool
bytes and the profile step's peak. Fixed once the engine is built; read by /metrics threads."""

from __future__ import annotations

from prometheus_client.core import GaugeMetricFamily

from engine.memory_profile import MemoryFigures
from services.common.metrics import LABELS


class MemoryCollector:
    def __init__(self, figures: MemoryFigures, model: str, role: str) -> None:
        self.figures = figures
        self.values = (model, role)

    def describe(self):
        return []

    def collect(self):
        f = self.figures
        gauges = [
            ("splitserve_worker_weight_bytes",
             "Bytes of the model's weights on this worker (rank 0 with tensor parallelism).",
             f.weights_bytes),
            ("splitserve_worker_kv_pool_bytes",
             "Bytes of this worker's KV cache pool (blocks x bytes per block).", f.kv_pool_bytes),
        ]
        if f.peak_step_bytes >= 0:  # not profiled under an explicit --num-kv-blocks
            gauges.append((
                "splitserve_worker_peak_step_bytes",
                "Memory the largest step took at start, above what the worker held before it "
                "(CUDA: torch's allocator peak; CPU: resident-set high-water growth).",
                f.peak_step_bytes))
        for name, doc, value in gauges:
            family = GaugeMetricFamily(name, doc, labels=LABELS)
            family.add_metric(self.values, float(value))
            yield family
