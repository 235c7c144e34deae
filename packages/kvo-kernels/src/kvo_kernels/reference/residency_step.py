"""One request's residency update through kvo-core, with its state read from / for the pool.

kvo-core owns the residency rules (docs/design.md section 6); the fused op keeps the state in
``cache_slots_pool`` between calls. This module moves one pool entry's state into a one-row
kvo-core table, applies the step, and hands back the result and the new state.
"""

from __future__ import annotations

import attrs
import torch

from kvo_core.residency import ReferenceResidency, RequestState, ResidencyResult

_REQUEST = 0
"""The ABI carries no request id: every entry serves "request 0"; state -2 resets it."""


@attrs.frozen(eq=False)
class ResidencyStep:
    result: ResidencyResult        # one row: the request's query rows' top-k concatenated
    slot_tokens: torch.Tensor      # [capacity] int64, the entry's new state
    lru_order: torch.Tensor        # [capacity] int64


def residency_step(saved: tuple[torch.Tensor, torch.Tensor] | None, capacity: int,
                   selected: torch.Tensor, stable_length: int, state: RequestState,
                   max_seq_len: int) -> ResidencyStep:
    """Apply one step to one pool entry of ``capacity`` slots.

    ``saved`` is the entry's (slot tokens, LRU order), read only for STEADY (FIRST_OFFLOAD
    resets the entry; NOT_OFFLOADED maps token -> slot identically and changes nothing).
    ``selected`` is [Q*K] int64 with -1 padding.
    """
    table = ReferenceResidency(1, max(1, capacity), max_seq_len=max(1, max_seq_len))
    if state == RequestState.STEADY:
        if saved is None:
            raise ValueError("a STEADY step needs the entry's saved state")
        table.load_row(0, *saved, _REQUEST)
    result = table.update(
        selected.to(device="cpu", dtype=torch.int64)[None, :],
        request_ids=torch.tensor([_REQUEST]),
        stable_lens=torch.tensor([stable_length]),
        states=torch.tensor([int(state)]))
    return ResidencyStep(result=result, slot_tokens=table.slot_tokens[0],
                         lru_order=table.lru_order[0])
