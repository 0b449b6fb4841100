"""splitserve (disaggregated and aggregated) against `transformers serve` on this machine: same
model, same workloads, a sweep of request rates; writes bench/results/<date>/report.md."""
