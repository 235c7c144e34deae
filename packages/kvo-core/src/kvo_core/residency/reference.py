"""Pure-Python residency: the rules of docs/design.md section 6, written to be read, not to be fast.

Per row and step: a new request identity (or a first offload) resets the row; resident tokens at
or beyond the stable length are forgotten; negative or out-of-range top-k entries are padding
and a repeated token counts once, at its first position; hits keep their slots; walking the LRU
order, every slot not holding a selected token is evictable and the misses (top-k order, or
ascending on a first offload) take them in that order; the new LRU order is [unused evictable,
filled, hits], each group in its old relative order. A not-offloaded row maps each entry to
itself and is left alone.

Every other implementation (the vectorised table, the native op) is tested slot for slot
against this one.
"""

from __future__ import annotations

import torch

from kvo_core.residency.inputs import (
    DEFAULT_MAX_SEQ_LEN,
    RESULT_DTYPE,
    check_dimensions,
    check_out,
    check_update_inputs,
    overflow_message,
)
from kvo_core.residency.state import (
    EMPTY,
    NO_REQUEST,
    RequestState,
    ResidencyInputError,
    ResidencyOverflowError,
    ResidencyResult,
)


class ReferenceResidency:
    """Per row: ``capacity`` slots, the token each holds, and the slots' LRU order."""

    def __init__(self, rows: int, capacity: int, *,
                 max_seq_len: int = DEFAULT_MAX_SEQ_LEN) -> None:
        self._rows, self._capacity, self._max_seq_len = check_dimensions(
            rows, capacity, max_seq_len)
        self._slot_tokens = [[EMPTY] * capacity for _ in range(rows)]
        self._lru = [list(range(capacity)) for _ in range(rows)]
        self._requests = [NO_REQUEST] * rows

    @property
    def rows(self) -> int:
        return self._rows

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def slot_tokens(self) -> torch.Tensor:
        """[R, C] int64: the token each slot holds, -1 when empty."""
        return torch.tensor(self._slot_tokens, dtype=torch.int64)

    @property
    def lru_order(self) -> torch.Tensor:
        """[R, C] int64: slot ids, least recently used first."""
        return torch.tensor(self._lru, dtype=torch.int64)

    @property
    def row_requests(self) -> torch.Tensor:
        """[R] int64: the request each row serves, -1 for none."""
        return torch.tensor(self._requests, dtype=torch.int64)

    def reset_row(self, row: int) -> None:
        """Forget everything a row holds (all slots empty, LRU order 0..C-1, no request)."""
        if not isinstance(row, int) or not 0 <= row < self._rows:
            raise ResidencyInputError(f"row must be in [0, {self._rows}), got {row!r}")
        self._slot_tokens[row] = [EMPTY] * self._capacity
        self._lru[row] = list(range(self._capacity))
        self._requests[row] = NO_REQUEST

    def load_row(self, row: int, slot_tokens: torch.Tensor, lru_order: torch.Tensor,
                 request: int) -> None:
        """Set one row's whole state, e.g. from a fused op's pool entry between steps.

        ``slot_tokens`` [C] (-1 = empty, each token at most once), ``lru_order`` [C] (a
        permutation of the slot ids, least recent first). Checked first: a bad state would
        make later updates follow it silently.
        """
        if not isinstance(row, int) or not 0 <= row < self._rows:
            raise ResidencyInputError(f"row must be in [0, {self._rows}), got {row!r}")
        capacity = self._capacity
        for name, value in (("slot_tokens", slot_tokens), ("lru_order", lru_order)):
            if not isinstance(value, torch.Tensor) or value.shape != (capacity,):
                shape = list(value.shape) if isinstance(value, torch.Tensor) else type(value)
                raise ResidencyInputError(
                    f"{name} must be a tensor of shape [{capacity}], got {shape}")
        tokens = [int(t) for t in slot_tokens.tolist()]
        order = [int(s) for s in lru_order.tolist()]
        if sorted(order) != list(range(capacity)):
            raise ResidencyInputError(
                f"lru_order must be a permutation of the slot ids 0..{capacity - 1}")
        held = [t for t in tokens if t != EMPTY]
        if min(tokens) < EMPTY or len(set(held)) != len(held):
            raise ResidencyInputError(
                "slot_tokens must hold tokens >= 0 (or -1 for empty), each at most once")
        self._slot_tokens[row] = tokens
        self._lru[row] = order
        self._requests[row] = int(request)

    def update(self, topk: torch.Tensor, request_ids: torch.Tensor, stable_lens: torch.Tensor,
               states: torch.Tensor | None = None, *, seq_lens: torch.Tensor | None = None,
               out: ResidencyResult | None = None) -> ResidencyResult:
        """Apply one decode step's top-k selection to every row (rules: module docstring).

        With ``out`` (buffers, see ``check_out``) the result is written there and returned.
        """
        checked = check_update_inputs(
            self._rows, self._max_seq_len, topk, request_ids, stable_lens, states, seq_lens)
        if out is not None:
            check_out(out, self._rows, topk.shape[1], torch.device("cpu"))
        rows = topk.tolist()
        in_range = checked.in_range.tolist()
        row_states = [RequestState(s) for s in checked.states.tolist()]
        selections = [_distinct([t for t, ok in zip(row, oks, strict=True) if ok])
                      for row, oks in zip(rows, in_range, strict=True)]
        # Check every row before changing any, so an overflow leaves the table as it was.
        for r, selected in enumerate(selections):
            if row_states[r] != RequestState.NOT_OFFLOADED and len(selected) > self._capacity:
                raise ResidencyOverflowError(overflow_message(r, len(selected), self._capacity))

        width = len(rows[0])
        slots, miss_counts, miss_tokens, miss_slots = [], [], [], []
        for r, (row, oks) in enumerate(zip(rows, in_range, strict=True)):
            misses: list[int]
            filled: list[int]
            if row_states[r] == RequestState.NOT_OFFLOADED:
                slots.append([t if ok else EMPTY for t, ok in zip(row, oks, strict=True)])
                misses, filled = [], []
            else:
                slot_of, misses, filled = self._update_row(
                    r, selections[r], int(request_ids[r]), int(stable_lens[r]),
                    first_offload=row_states[r] == RequestState.FIRST_OFFLOAD)
                slots.append([slot_of[t] if ok else EMPTY for t, ok in zip(row, oks, strict=True)])
            miss_counts.append(len(misses))
            miss_tokens.append(misses + [EMPTY] * (width - len(misses)))
            miss_slots.append(filled + [EMPTY] * (width - len(filled)))
        result = ResidencyResult(
            slots=torch.tensor(slots, dtype=RESULT_DTYPE),
            miss_counts=torch.tensor(miss_counts, dtype=RESULT_DTYPE),
            miss_tokens=torch.tensor(miss_tokens, dtype=RESULT_DTYPE),
            miss_slots=torch.tensor(miss_slots, dtype=RESULT_DTYPE))
        return result if out is None else result.copy_into(out)

    def _update_row(self, r: int, selected: list[int], request: int, stable_len: int,
                    first_offload: bool) -> tuple[dict[int, int], list[int], list[int]]:
        """One row's rules. Returns token -> slot, the miss tokens and the slots they took."""
        if first_offload or request != self._requests[r]:
            self.reset_row(r)
        self._requests[r] = request
        tokens, lru = self._slot_tokens[r], self._lru[r]

        # A speculative suffix may have been overwritten in the host pool: forget it.
        for s, t in enumerate(tokens):
            if t >= stable_len:
                tokens[s] = EMPTY

        slot_of = {t: s for s, t in enumerate(tokens) if t != EMPTY}
        misses = [t for t in selected if t not in slot_of]
        if first_offload:
            misses.sort()
        hit_slots = {slot_of[t] for t in selected if t in slot_of}

        # Hits keep their slots; misses take the other slots, least recently used first.
        evictable = [s for s in lru if s not in hit_slots]
        filled = evictable[:len(misses)]
        for t, s in zip(misses, filled, strict=True):
            slot_of.pop(tokens[s], None)
            tokens[s] = t
            slot_of[t] = s

        # Unused evictable slots stay least recent, then the new fills, then the hits.
        self._lru[r] = evictable[len(misses):] + filled + [s for s in lru if s in hit_slots]
        return slot_of, misses, filled


def _distinct(tokens: list[int]) -> list[int]:
    """Each token once, at its first position."""
    return list(dict.fromkeys(tokens))
