"""The residency vocabulary shared by every implementation: request states, results, errors.

Kept apart from the implementations so the reference, the vectorised table and the native op
(in kvo-kernels) return the same result type and raise the same errors.
"""

from __future__ import annotations

import enum

import attrs
import torch

from kvo_core.errors import KvoError

EMPTY = -1
"""``slot_tokens`` value of a slot that holds no token; also the padding value of every output."""

NO_REQUEST = -1
"""``row_requests`` value of a row that has not served a request yet (or was reset)."""


class RequestState(enum.IntEnum):
    """Per-row request state, with the integer codes the fused upstream op uses."""

    NOT_OFFLOADED = -3
    """The whole cache is on the device: slot = token position, no misses, row state untouched."""
    FIRST_OFFLOAD = -2
    """First step after the cache moved to the host: reset, lay the selection into slots 0..n-1."""
    STEADY = -1
    """Normal decode step: hits keep their slots, misses replace least recently used entries."""


class ResidencyOverflowError(KvoError):
    """A row selected more distinct tokens than the hot buffer has slots; nothing was changed."""


class ResidencyInputError(KvoError, ValueError):
    """An argument of a residency update has the wrong type, dtype, shape or value."""


@attrs.frozen(eq=False)
class ResidencyResult:
    """What one update tells the copy and attention steps, per row (all int32, -1 = padding).

    int32 like upstream's contract: half the bytes of int64 for the largest outputs of a decode
    step, and every supported table fits (slots < 2**20, tokens < 2**31, checked when a
    table is built).

    ``slots[r, j]`` is the hot-buffer slot of top-k position ``j``; ``miss_tokens[r, :n]`` and
    ``miss_slots[r, :n]`` with ``n = miss_counts[r]`` list the host -> device copies, each
    distinct token once, in the order the rules assign slots.
    """

    slots: torch.Tensor
    miss_counts: torch.Tensor
    miss_tokens: torch.Tensor
    miss_slots: torch.Tensor

    def copy_into(self, out: ResidencyResult) -> ResidencyResult:
        """Write this result into the caller's buffers (checked by ``check_out``); ``out``."""
        for name in RESULT_FIELDS:
            getattr(out, name).copy_(getattr(self, name))
        return out


RESULT_FIELDS = ("slots", "miss_counts", "miss_tokens", "miss_slots")
