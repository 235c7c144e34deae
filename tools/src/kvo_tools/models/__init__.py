"""Tiny models with the real architectures, built locally for tests and benchmarks."""
