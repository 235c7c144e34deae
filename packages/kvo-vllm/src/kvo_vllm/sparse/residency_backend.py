"""Picks the per-layer residency table: the native C++/OpenMP op if it builds, else torch.

Both implement kvo-core's rules slot for slot, so the choice changes speed, never results.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Protocol

import torch

from kvo_core.residency import ResidencyResult, ResidencyTable


class ResidencyTableLike(Protocol):
    def update(self, topk: torch.Tensor, request_ids: torch.Tensor, stable_lens: torch.Tensor,
               states: torch.Tensor | None = None, *, seq_lens: torch.Tensor | None = None,
               out: ResidencyResult | None = None) -> ResidencyResult: ...

    def reset_row(self, row: int) -> None: ...


def make_residency_table(backend: str, rows: int, capacity: int) -> ResidencyTableLike:
    """A table for ``rows`` decode rows of ``capacity`` slots (backend "torch" or "native").

    "native" falls back to the torch table, with a warning that says why, when the C++ op is
    not available (no compiler, or a kvo-kernels without it).
    """
    if backend == "native":
        try:
            from kvo_kernels.native_residency import NativeResidencyTable

            table: ResidencyTableLike = NativeResidencyTable(rows, capacity)
            return table
        except Exception as error:  # ImportError, NativeBuildError: both mean "not here"
            warnings.warn(f"native residency table unavailable ({error}); using kvo-core's "
                          "torch ResidencyTable (same results, slower)", stacklevel=2)
    return ResidencyTable(rows, capacity)


def native_host_tables(tables: Sequence[ResidencyTableLike], device: torch.device) -> bool:
    """Whether ``tables`` all run kvo-kernels' native op (so its library is loaded) and the
    hot buffers are host memory: then the miss copies can take kvo's C++ host copy too."""
    if device.type != "cpu" or not tables:
        return False
    try:
        from kvo_kernels.native_residency import NativeResidencyTable
    except ImportError:
        return False
    return all(isinstance(table, NativeResidencyTable) for table in tables)
