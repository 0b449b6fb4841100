"""The engine thread's lock-free inter-token histogram writes the same exposition as
prometheus_client's Histogram given the same observations (bucket bounds inclusive, +Inf,
count and sum), under each of its names."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.common.metrics import LATENCY_BUCKETS
from services.common.request_timing import TokenGapHistogram


def series(registry: CollectorRegistry, name: str) -> dict[str, float]:
    text = generate_latest(registry).decode()
    return {f"{s.name.removeprefix(name)}{s.labels.get('le', '')}": s.value
            for family in text_string_to_metric_families(text) if family.name == name
            for s in family.samples if not s.name.endswith("_created")}


def test_same_exposition_as_prometheus_client_histogram() -> None:
    rng = random.Random(0)
    values = [*LATENCY_BUCKETS, 0.0, 11.0, 1e-9] + [rng.expovariate(20) for _ in range(500)]
    reference_registry, ours_registry = CollectorRegistry(), CollectorRegistry()
    reference = Histogram("gap_seconds", "d", ["model", "role"], buckets=LATENCY_BUCKETS,
                          registry=reference_registry).labels("m", "decode")
    ours = TokenGapHistogram(["gap_seconds", "other_gap_seconds"], "d", ["model", "role"],
                             ["m", "decode"], LATENCY_BUCKETS)
    ours_registry.register(ours)
    for value in values:
        reference.observe(value)
        ours.observe(value)
    expected = series(reference_registry, "gap_seconds")
    assert expected["_count"] == len(values)
    assert series(ours_registry, "gap_seconds") == expected
    assert series(ours_registry, "other_gap_seconds") == expected
