"""kvo-core: pure planning, residency and TP-mapping logic for KV-cache offload (no I/O)."""

__version__ = "0.1.0"
