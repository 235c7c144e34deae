"""kvo-kernels: the fused indexer-manage and Copy-SFA ops, with reference, Triton and native Ascend
implementations."""

__version__ = "0.1.0"
