"""The decode host pool of sparse decode offload and what sizes it and picks its tables.

``kvo_vllm.dsa``'s offload mode keeps the full main KV in a ``HostKVStore`` (one shared host
pool per decode DP rank), sized from a ``SparseModelLayout`` by ``plan_pool`` /
``pool_bytes_for``; ``residency_backend`` picks each layer's residency table.
"""

from kvo_vllm.sparse.errors import TensorParallelError
from kvo_vllm.sparse.host_store import HostKVStore, plan_pool, pool_bytes_for
from kvo_vllm.sparse.layout import SparseModelLayout

__all__ = [
    "HostKVStore",
    "SparseModelLayout",
    "TensorParallelError",
    "plan_pool",
    "pool_bytes_for",
]
