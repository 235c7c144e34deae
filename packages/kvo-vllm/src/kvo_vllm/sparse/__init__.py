"""Sparse decode offload: full main KV in a shared host pool, top-k hot buffers on the device.

``SparseDecodeOffload`` runs docs/design.md section 6 for one decode DP rank without vLLM; the
attention integration calls it per layer.
"""

from kvo_vllm.sparse.allocator import RowRange, RowRangeAllocator
from kvo_vllm.sparse.engine import RequestPlacement, SparseDecodeOffload
from kvo_vllm.sparse.errors import (
    AdmissionError,
    DecodeInputError,
    RequestCapacityError,
    SparseOffloadError,
    TensorParallelError,
    UnknownRequestError,
)
from kvo_vllm.sparse.host_store import HostKVStore, plan_pool, pool_bytes_for
from kvo_vllm.sparse.layout import SparseModelLayout
from kvo_vllm.sparse.stats import DeviceBytes, LayerStepStats, StepStats, Totals

__all__ = [
    "AdmissionError",
    "DecodeInputError",
    "DeviceBytes",
    "HostKVStore",
    "LayerStepStats",
    "RequestCapacityError",
    "RequestPlacement",
    "RowRange",
    "RowRangeAllocator",
    "SparseDecodeOffload",
    "SparseModelLayout",
    "SparseOffloadError",
    "StepStats",
    "TensorParallelError",
    "Totals",
    "UnknownRequestError",
    "plan_pool",
    "pool_bytes_for",
]
