"""The residency state that ``cache_slots_pool`` carries between decode steps.

Layout (kvo's reference and Triton implementations): ``[POOL, 2, C]`` int32 or int64, one row
per pool entry (a request's ``req_pool_entries[b]``):

- ``pool[e, 0, :c]`` — the token held by each of the request's ``c = num_cache_tokens[b]`` hot
  slots, -1 for an empty slot (kvo_core ``slot_tokens``);
- ``pool[e, 1, :c]`` — the slot ids in LRU order, least recent first, a permutation of
  ``0..c-1`` (kvo_core ``lru_order``);
- columns ``c..C-1`` are not used by that request.

The ABI carries no request id: a new request on a reused entry is announced by request state
-2 (first offload), which resets the entry. ``new_cache_slots_pool`` returns every entry
reset. The native Ascend ops keep their own layout (upstream's); a pool is only valid for the
implementation family it was created for.
"""

from __future__ import annotations

import torch

from kvo_kernels import _checks as check
from kvo_kernels.errors import KernelArgumentError

TOKENS = 0
LRU = 1


def new_cache_slots_pool(entries: int, capacity: int, dtype: torch.dtype = torch.int32,
                         device: torch.device | str | None = None) -> torch.Tensor:
    """A ``[entries, 2, capacity]`` pool with every entry reset (no tokens, LRU 0..C-1)."""
    check.positive("entries", entries)
    check.positive("capacity", capacity)
    if dtype not in check.INDEX_DTYPES:
        raise KernelArgumentError(f"dtype must be int32 or int64, got {dtype}")
    pool = torch.empty(entries, 2, capacity, dtype=dtype, device=device)
    pool[:, TOKENS].fill_(-1)
    pool[:, LRU].copy_(torch.arange(capacity, dtype=dtype, device=device).expand(entries, -1))
    return pool


def entry_state(pool: torch.Tensor, entry: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies (int64) of one entry's slot tokens and LRU order over its first ``capacity`` slots."""
    row = pool[entry, :, :capacity].to(torch.int64)
    return row[TOKENS].clone(), row[LRU].clone()


def store_entry_state(pool: torch.Tensor, entry: int, slot_tokens: torch.Tensor,
                      lru_order: torch.Tensor) -> None:
    capacity = slot_tokens.shape[0]
    pool[entry, TOKENS, :capacity].copy_(slot_tokens)
    pool[entry, LRU, :capacity].copy_(lru_order)
