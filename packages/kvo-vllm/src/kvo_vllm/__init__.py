"""kvo-vllm: vLLM KV connectors, the sparse decode offload engine and the P/D proxy."""

__version__ = "0.1.0"
