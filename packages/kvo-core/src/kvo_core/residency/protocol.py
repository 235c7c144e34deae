"""What a residency table offers its caller: one update per decode step, and row resets.

``ReferenceResidency`` and ``ResidencyTable`` here and kvo-kernels' ``NativeResidencyTable``
implement it, slot for slot the same; a caller that holds any of them types it as this.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvo_core.residency.state import ResidencyResult


class ResidencyTableLike(Protocol):
    """A per-layer residency table of R decode rows x C slots (rules: docs/design.md section 6)."""

    def update(self, topk: torch.Tensor, request_ids: torch.Tensor, stable_lens: torch.Tensor,
               states: torch.Tensor | None = None, *, seq_lens: torch.Tensor | None = None,
               out: ResidencyResult | None = None) -> ResidencyResult: ...

    def reset_row(self, row: int) -> None: ...
