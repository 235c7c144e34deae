"""Reference (plain PyTorch) implementations: the semantics of every kvo kernel."""

from kvo_kernels.reference.primitives import (
    hadamard_matrix,
    hadamard_quant_int8,
    indexer_scores,
    sparse_copy,
    sparse_mla_attention,
    sparse_mla_attention_over_keys,
    topk_indices,
)

__all__ = [
    "hadamard_matrix",
    "hadamard_quant_int8",
    "indexer_scores",
    "sparse_copy",
    "sparse_mla_attention",
    "sparse_mla_attention_over_keys",
    "topk_indices",
]
