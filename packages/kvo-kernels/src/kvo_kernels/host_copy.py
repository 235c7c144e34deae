"""``kvo::sparse_copy`` and ``kvo::sparse_copy_gather`` on the host through kvo's C++ ops
(``csrc/sparse_copy.cpp``).

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
from kvo_kernels.reference import primitives as reference


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
        reference.check_sparse_copy_args(src, dst, src_rows, dst_rows, one_device=True)
        raise KernelArgumentError(f"sparse_copy (host op): {error}") from None


def sparse_copy_gather_host(src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor,
                            dst_rows: torch.Tensor, gather_rows: torch.Tensor,
                            out: torch.Tensor) -> None:
    """The copies of :func:`sparse_copy_host`, then ``out[k] = dst[gather_rows[k]]``, in one
    pass (the reference's contract: ``reference.primitives.sparse_copy_gather``).

    A decode step's copied rows are all gathered too; the op reads each from ``src`` once
    and hands it to ``out`` while it is in cache, where copy-then-gather reads it again from
    ``dst``. Refusals as for :func:`sparse_copy_host` (nothing written)."""
    module = load_native_ops()
    try:
        module.sparse_copy_gather(src, dst, src_rows, dst_rows, gather_rows, out)
    except (ValueError, IndexError, RuntimeError) as error:
        reference.check_sparse_copy_gather_args(src, dst, src_rows, dst_rows, gather_rows,
                                                out)
        raise KernelArgumentError(f"sparse_copy_gather (host op): {error}") from None


def copy_residency_misses_host(pool: torch.Tensor, hot: torch.Tensor, block_table: torch.Tensor,
                               miss_counts: torch.Tensor, miss_tokens: torch.Tensor,
                               miss_slots: torch.Tensor, *, rows: int, block_size: int,
                               capacity: int) -> int:
    """A residency update's miss copies, pool -> hot buffer, told straight from its result.

    For batch row ``r < rows`` and ``i < miss_counts[r]``: request-local token
    ``t = miss_tokens[r, i]`` is read from pool row ``block_table[r, t // block_size] *
    block_size + t % block_size`` and written to hot row ``r * capacity + miss_slots[r, i]``
    (what ``sparse_copy`` does once those index arrays are built; building them in Python
    cost more than the copies on the decode path). Returns the rows copied; a refused call
    (an index out of range, a hot row named twice) writes nothing and raises
    ``KernelArgumentError``.
    """
    module = load_native_ops()
    try:
        copied: int = module.copy_residency_misses(pool, hot, block_table, miss_counts,
                                                   miss_tokens, miss_slots, rows, block_size,
                                                   capacity)
    except (ValueError, IndexError, RuntimeError) as error:
        raise KernelArgumentError(f"copy_residency_misses (host op): {error}") from None
    return copied
