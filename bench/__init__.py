"""Benchmarks: workloads, the HF baseline, end-to-end and kernel benchmarks (run from the repository root)."""
