"""kvo-transport: the READY/ACK control plane, transfer-engine and KV-store backends, and the
shared host pool."""

__version__ = "0.1.0"
