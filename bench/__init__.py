"""Benchmarks: the load generator, the system comparison, and component benchmarks."""
