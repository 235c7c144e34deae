"""``kvo::sparse_copy`` on the host through kvo's C++ op (``csrc/sparse_copy.cpp``).

The offload path copies a few hundred rows per layer and step; the reference spends more on
its index checks (bounds, a ``torch.unique`` of the destinations) and advanced indexing than on
the copy. The C++ op checks the same things in one pass and copies each row with ``memcpy``.
Selected with ``implementation="native"`` for CPU tensors (``dispatch.select``); its first use
in a process may compile kvo's native ops (``native_build``).
"""

from __future__ import annotations

import torch

from kvo_kernels.errors import KernelArgumentError
from kvo_kernels.native_build import load_native_ops
from kvo_kernels.reference.primitives import check_sparse_copy_args


def sparse_copy_host(src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor,
                     dst_rows: torch.Tensor) -> None:
    """``dst[dst_rows[i]] = src[src_rows[i]]`` (the reference's contract), all on the CPU.

    A refused call writes nothing; its error names the argument in the reference's words
    (the Python checks run only then, so a valid call pays for none of them).
    """
    module = load_native_ops()
    try:
        module.sparse_copy(src, dst, src_rows, dst_rows)
    except (ValueError, IndexError, RuntimeError) as error:
        check_sparse_copy_args(src, dst, src_rows, dst_rows, one_device=True)
        raise KernelArgumentError(f"sparse_copy (host op): {error}") from None
