"""Benchmarks of the engine: a fixed synthetic workload, the runner and its report."""
