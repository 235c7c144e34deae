"""Benchmarks (``python -m kvo_tools.bench.NAME``; ``nox -s bench -- NAME``)."""
