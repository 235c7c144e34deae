"""The building blocks a fused-op implementation is made of, swappable as one set.

The fused ops (manage, Copy-SFA) are written once, in ``kvo_kernels.reference``, in terms of
these primitives; the reference set is plain PyTorch, the Triton set replaces the heavy ones
with kernels. So the Triton ops share the reference's metadata handling and residency rules
by construction, and differ only where the kernels do.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

from kvo_kernels.reference import primitives as ref


@attrs.frozen
class Primitives:
    name: str
    indexer_scores: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    topk_indices: Callable[[torch.Tensor, int, torch.Tensor], torch.Tensor]
    sparse_copy: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
    sparse_mla_attention: Callable[..., torch.Tensor]


REFERENCE = Primitives(name="reference", indexer_scores=ref.indexer_scores,
                       topk_indices=ref.topk_indices, sparse_copy=ref.sparse_copy,
                       sparse_mla_attention=ref.sparse_mla_attention)


def triton_primitives() -> Primitives:
    """The Triton set (imports ``kvo_kernels.triton`` now, not at package import).

    Top-k stays the reference's stable sort (a device-generic torch op with the documented
    tie rule). A copy between two devices (registered host view -> device) goes through the
    reference, since a Triton program addresses one device.
    """
    from kvo_kernels import triton as kernels

    def sparse_copy(src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor,
                    dst_rows: torch.Tensor) -> None:
        if src.device != dst.device:
            ref.sparse_copy(src, dst, src_rows, dst_rows)
        else:
            kernels.sparse_copy_triton(src, dst, src_rows, dst_rows)

    return Primitives(name="triton", indexer_scores=kernels.indexer_scores_triton,
                      topk_indices=ref.topk_indices, sparse_copy=sparse_copy,
                      sparse_mla_attention=kernels.sparse_mla_attention_triton)
