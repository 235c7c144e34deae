"""kvo's own tooling: the demo, the soak, benchmarks, P/D cluster helpers, tiny models."""
