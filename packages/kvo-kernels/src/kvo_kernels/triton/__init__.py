"""Triton kernels with the reference primitives' signatures (suffix ``_triton``).

For CUDA GPUs (and Ascend through triton-ascend); on the CPU they run only in Triton's
interpreter, which must be switched on (``TRITON_INTERPRET=1``) before this package is imported.
Top-k stays ``reference.topk_indices`` (torch's stable sort), per the kernel contract.
"""

from __future__ import annotations

try:
    import triton as _triton  # noqa: F401  (fail here, with the fix, not deep in a kernel)
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "kvo_kernels.triton needs Triton: pip install 'kvo-kernels[triton]'") from error

from kvo_kernels.triton._launch import INTERPRETING
from kvo_kernels.triton.indexer_scores import indexer_scores_triton
from kvo_kernels.triton.sparse_copy import sparse_copy_triton
from kvo_kernels.triton.sparse_mla_attention import sparse_mla_attention_triton

__all__ = [
    "INTERPRETING",
    "indexer_scores_triton",
    "sparse_copy_triton",
    "sparse_mla_attention_triton",
]
