"""Vectorised residency: the run-time implementation, whole-tensor torch ops, no per-row loops.

Next to the state the rules talk about (``slot_tokens``, ``lru_order``, ``row_requests``) it
keeps a dense inverse map ``token -> slot`` per row. With it a step costs lookups at the K
selected positions plus a few passes over the [R, C] state, instead of a sort or a per-row
hash. The map grows with the largest token position seen (int16 while slot ids fit:
R x max position x 2 bytes, e.g. 8 MiB at R=32 and 128K tokens).

Every table keeps a spare column 0 (the "dump"; real entries start at column 1): masked-out
entries of a scatter go there instead of being compacted away, and padding (-1) + 1 lands on it
for free. Only -1 is ever written to the map's dump, so a padding lookup answers "not
resident". The misses (a small share of K once the buffer is warm) are handled compacted; the
rest works on whole [R, K] and [R, C] tensors.

Performance notes (torch 2.13 CPU, measured here): ``torch.where`` on integer tensors is several
times slower than arithmetic with a mask, an implicit int64 ``cumsum`` of a bool tensor is
~15x slower than an int32 one, and ``index_select`` on a flat view beats ``gather`` for lookups
into large tables; the code below is written around these.
"""

from __future__ import annotations

import torch

from kvo_core.residency.inputs import (
    DEFAULT_MAX_SEQ_LEN,
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

_I64 = torch.int64
_I32 = torch.int32
_INITIAL_POSITIONS = 4096
_INT16_MAX = torch.iinfo(torch.int16).max
_PAST_ANY_TOKEN = torch.iinfo(torch.int64).max  # sorts after every token


class ResidencyTable:
    """R decode rows x C hot-buffer slots with LRU replacement; agrees with ReferenceResidency."""

    def __init__(self, rows: int, capacity: int, *, max_seq_len: int = DEFAULT_MAX_SEQ_LEN,
                 device: torch.device | str = "cpu") -> None:
        self._rows, self._capacity, self._max_seq_len = check_dimensions(
            rows, capacity, max_seq_len)
        dev = self._device = torch.device(device)
        self._row_ids = torch.arange(rows, dtype=_I64, device=dev)[:, None]
        self._slot_ids = torch.arange(capacity, dtype=_I64, device=dev)
        # LRU position arithmetic (step 5) in the narrowest type that holds +-2C: less memory
        # traffic over the [R, C] passes.
        self._pos_dtype = torch.int16 if 2 * capacity + 1 <= _INT16_MAX else _I32
        self._sign_shift = torch.iinfo(self._pos_dtype).bits - 1
        self._slot_ids_pos = self._slot_ids.to(self._pos_dtype)
        self._arange = torch.arange(0, dtype=_I64, device=dev)
        self._markers_cache: dict[int, torch.Tensor] = {}
        # [R, 1 + C]: column 1 + s holds slot s's token.
        self._tokens = torch.full((rows, 1 + capacity), EMPTY, dtype=_I64, device=dev)
        # [R, C]: LRU order as flat indices into an [R, 1 + C] table: r * (1 + C) + 1 + slot.
        # Stored as int32 when the flat indices fit (less traffic in the [R, C] passes).
        lru_dtype = _I32 if rows * (1 + capacity) <= torch.iinfo(_I32).max else _I64
        self._lru_base = self._row_ids * (1 + capacity) + 1
        self._fresh_lru = (self._slot_ids + self._lru_base).to(lru_dtype)
        self._lru = self._fresh_lru.clone()
        self._requests = torch.full((rows,), NO_REQUEST, dtype=_I64, device=dev)
        # [R, 1 + P]: column 1 + t holds the slot of token t (-1: not resident). int16 when slot
        # ids fit: half the memory traffic of the random lookups that dominate a step.
        self._map_dtype = torch.int16 if capacity <= _INT16_MAX else torch.int32
        self._token_slot = torch.full((rows, 1), EMPTY, dtype=self._map_dtype, device=dev)
        # [R]: an upper bound of the tokens a row holds, so the drop pass runs only when needed.
        self._max_held = torch.full((rows,), EMPTY, dtype=_I64, device=dev)

    @property
    def rows(self) -> int:
        return self._rows

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def slot_tokens(self) -> torch.Tensor:
        """[R, C] int64 (a copy): the token each slot holds, -1 when empty."""
        return self._tokens[:, 1:].clone()

    @property
    def lru_order(self) -> torch.Tensor:
        """[R, C] int64 (a copy): slot ids, least recently used first."""
        return self._lru.to(_I64) - self._lru_base

    @property
    def row_requests(self) -> torch.Tensor:
        """[R] int64 (a copy): the request each row serves, -1 for none."""
        return self._requests.clone()

    def reset_row(self, row: int) -> None:
        """Forget everything a row holds (all slots empty, LRU order 0..C-1, no request)."""
        if not isinstance(row, int) or not 0 <= row < self._rows:
            raise ResidencyInputError(f"row must be in [0, {self._rows}), got {row!r}")
        self._tokens[row] = EMPTY
        self._lru[row] = self._fresh_lru[row]
        self._requests[row] = NO_REQUEST
        self._token_slot[row] = EMPTY
        self._max_held[row] = EMPTY

    def update(self, topk: torch.Tensor, request_ids: torch.Tensor, stable_lens: torch.Tensor,
               states: torch.Tensor | None = None, *, seq_lens: torch.Tensor | None = None,
               out: ResidencyResult | None = None) -> ResidencyResult:
        """Apply one decode step's top-k selection to every row (rules: docs/design.md section 6).

        With ``out`` (buffers, see ``check_out``) the result is written there and returned.
        """
        checked = check_update_inputs(
            self._rows, self._max_seq_len, topk, request_ids, stable_lens, states, seq_lens,
            self._device)
        topk = topk.to(_I64)  # the arithmetic below is int64; results are int32
        rows, width = topk.shape
        if out is not None:
            check_out(out, rows, width, self._device)
        cap = self._capacity
        active = checked.states != RequestState.NOT_OFFLOADED
        first_offload = checked.states == RequestState.FIRST_OFFLOAD
        all_active = bool(active.all())
        valid = checked.in_range if all_active else checked.in_range & active[:, None]
        self._grow_token_map(checked.max_token)
        markers = self._markers(width)
        col = (topk + 1).clamp_(min=0)  # the token's map column; negative padding -> dump
        if seq_lens is not None or not all_active:
            col.mul_(valid)
        flat_col = (col + self._row_ids * self._token_slot.shape[1]).view(-1)
        token_slot_flat = self._token_slot.view(-1)

        # 1. Classify every position against the state as it will be after reset and drop.
        reset = active & (first_offload | (request_ids != self._requests))
        any_reset = bool(reset.any())
        old_slot = token_slot_flat.index_select(0, flat_col).view(rows, width)
        hit = old_slot >= 0
        slots = old_slot.to(_I64)  # final for hits and padding; misses are written in step 7
        if any_reset or checked.max_token >= int(stable_lens.min()):
            hit &= ~(reset[:, None] | (topk >= stable_lens[:, None]))
            slots.add_(1).mul_(hit).sub_(1)
        miss = valid & ~hit
        missed = miss.view(-1).nonzero().squeeze(1)  # flat [R * K] positions, in order
        missed_cells = flat_col.index_select(0, missed)

        # 2. A missed token counts once, at its first position: every missed position writes
        #    the marker MIN + j (below -1 and any slot id) at its token and reads back which
        #    one stayed. Only if some token repeats, a min-reduction makes the first one win.
        #    The markers are overwritten by the missed tokens' new slots in step 7.
        missed_marks = markers.index_select(0, missed)
        token_slot_flat.scatter_(0, missed_cells, missed_marks)
        seen = token_slot_flat.index_select(0, missed_cells)
        new_missed = missed
        if bool((seen != missed_marks).any()):
            token_slot_flat.scatter_reduce_(0, missed_cells, missed_marks, "amin")
            new_missed = missed[token_slot_flat.index_select(0, missed_cells) == missed_marks]
        new_rows = torch.div(new_missed, width, rounding_mode="floor")
        miss_counts = torch.bincount(new_rows, minlength=rows)
        # evictable_slot[r, 1 + s] = 1: slot s holds no selected token (used as a number).
        evictable_slot = torch.ones((rows, 1 + cap), dtype=self._pos_dtype, device=self._device)
        evictable_slot.scatter_(1, slots + 1, 0)
        if width > cap:  # only then can a row select more distinct tokens than it has slots
            self._check_overflow(evictable_slot, miss_counts, col, old_slot)

        # 3. Reset rows whose request changed (or that start offloading); drop the speculative
        #    suffix (tokens at/after the stable length may have been overwritten on the host).
        if any_reset:
            self._tokens[reset] = EMPTY
            self._lru[reset] = self._fresh_lru[reset]
            self._token_slot[reset] = EMPTY
            self._max_held[reset] = EMPTY
        self._requests = torch.where(active, request_ids, self._requests)
        if bool((active & (self._max_held >= stable_lens)).any()):
            self._drop_speculative(active, stable_lens)

        # 4. Miss lists, only as wide as the most misses of any row: top-k order (the order of
        #    the flat positions), or ascending token order on a first offload.
        most = max(int(miss_counts.max()), 1)
        starts = miss_counts.cumsum(0) - miss_counts
        rank = torch.arange(new_missed.numel(), device=self._device) - starts[new_rows]
        fill_tokens = torch.full((rows, most), EMPTY, dtype=_I64, device=self._device)
        fill_tokens.view(-1)[new_rows * most + rank] = topk.reshape(-1)[new_missed]
        if bool(first_offload.any()):
            fo = first_offload.nonzero().squeeze(1)
            keys = fill_tokens[fo]
            ordered = keys.masked_fill_(keys < 0, _PAST_ANY_TOKEN).sort(dim=1).values
            fill_tokens[fo] = ordered.masked_fill_(ordered == _PAST_ANY_TOKEN, EMPTY)

        # 5. New LRU order. Walking the old one, slots holding no selected token are evictable;
        #    the misses take the first of them. New order: unused evictable slots, the filled
        #    ones (so a rotation of the evictable list by the miss count), then the hit slots,
        #    each group in its old relative order.
        evictable = evictable_slot.view(-1).index_select(0, self._lru.view(-1)).view(rows, cap)
        ev_seen = evictable.cumsum(1, dtype=self._pos_dtype)  # evictable up to here, inclusive
        ev_counts = ev_seen[:, -1:]
        taken = miss_counts.to(self._pos_dtype)[:, None]
        as_evictable = ev_seen - (taken + 1)  # rank among the evictable minus the misses ...
        as_evictable += ev_counts & (as_evictable >> self._sign_shift)  # ... rotated
        as_hit = self._slot_ids_pos - ev_seen
        as_hit += ev_counts  # evictable count + rank among the hits
        new_pos = torch.addcmul(as_hit, evictable, as_evictable.sub_(as_hit)).to(_I64)
        new_lru = torch.empty_like(self._lru).scatter_(1, new_pos, self._lru)

        # 6. The i-th miss took the slot now at LRU position (evictable - misses + i).
        positions = self._positions(most)
        listed = positions < miss_counts[:, None]
        taken_at = ((ev_counts - taken).to(_I64) + positions).clamp_(max=cap - 1)
        fill_col = (new_lru.gather(1, taken_at).to(_I64) - (self._lru_base - 1)).mul_(listed)
        fill_slots = fill_col - 1

        # 7. State: evict, fill, update the inverse map; every missed position (a repeat too)
        #    reads its new slot from the map. (Whatever lands in a dump column here is -1.)
        evicted = self._tokens.gather(1, fill_col)
        self._token_slot.scatter_(1, evicted + 1, EMPTY)
        self._tokens.scatter_(1, fill_col, fill_tokens)
        self._token_slot.scatter_(1, fill_tokens + 1, fill_slots.to(self._map_dtype))
        self._max_held = torch.maximum(self._max_held, fill_tokens.max(1).values)
        self._lru = new_lru
        slots.view(-1)[missed] = token_slot_flat.index_select(0, missed_cells).to(_I64)
        if not all_active:
            slots = torch.where(~active[:, None] & checked.in_range, topk, slots)

        miss_tokens = torch.full((rows, width), EMPTY, dtype=_I32, device=self._device)
        miss_tokens[:, :most] = fill_tokens
        miss_slots = torch.full((rows, width), EMPTY, dtype=_I32, device=self._device)
        miss_slots[:, :most] = fill_slots
        result = ResidencyResult(slots=slots.to(_I32), miss_counts=miss_counts.to(_I32),
                                 miss_tokens=miss_tokens, miss_slots=miss_slots)
        return result if out is None else result.copy_into(out)

    def _markers(self, width: int) -> torch.Tensor:
        """Step 2's marker MIN + j for every flat [R * K] position (map dtype), cached."""
        cached = self._markers_cache.get(width)
        if cached is None:
            if torch.iinfo(self._map_dtype).min + width - 1 >= EMPTY:
                # Too many columns for distinct int16 markers: widen the map for good.
                self._map_dtype = torch.int32
                self._token_slot = self._token_slot.to(torch.int32)
                self._markers_cache.clear()
            lowest = torch.iinfo(self._map_dtype).min
            column = torch.arange(width, dtype=_I64, device=self._device)
            cached = self._markers_cache[width] = (lowest + column).to(self._map_dtype).repeat(
                self._rows)
        return cached

    def _positions(self, count: int) -> torch.Tensor:
        """0..count-1 (int64): a slice of one cached range."""
        if self._arange.numel() < count:
            self._arange = torch.arange(max(count, 2 * self._arange.numel()), dtype=_I64,
                                        device=self._device)
        return self._arange[:count]

    def _drop_speculative(self, active: torch.Tensor, stable_lens: torch.Tensor) -> None:
        """Forget tokens at/after each active row's stable length (rare: only after MTP)."""
        tokens = self._tokens[:, 1:]
        drop = active[:, None] & (tokens >= stable_lens[:, None])
        self._token_slot.scatter_(1, (tokens + 1) * drop, EMPTY)
        tokens.masked_fill_(drop, EMPTY)
        self._max_held = torch.where(
            active, torch.minimum(self._max_held, stable_lens - 1), self._max_held)

    def _check_overflow(self, evictable_slot: torch.Tensor, miss_counts: torch.Tensor,
                        col: torch.Tensor, old_slot: torch.Tensor) -> None:
        """Raise (after undoing step 2's markers) if a row selects more tokens than slots."""
        hit_counts = self._capacity - evictable_slot[:, 1:].sum(1)
        over = hit_counts + miss_counts > self._capacity
        if bool(over.any()):
            self._token_slot.scatter_(1, col, old_slot)  # the dump gets back its -1 too
            r = int(over.nonzero()[0, 0])
            raise ResidencyOverflowError(
                overflow_message(r, int(hit_counts[r] + miss_counts[r]), self._capacity))

    def _grow_token_map(self, max_token: int) -> None:
        """Make the inverse map cover every selected position (doubling, up to max_seq_len)."""
        known = self._token_slot.shape[1] - 1
        need = max_token + 1
        if need <= known:
            return
        size = min(max(need, 2 * known, _INITIAL_POSITIONS), self._max_seq_len)
        grown = torch.full((self._rows, 1 + size), EMPTY, dtype=self._map_dtype,
                           device=self._device)
        grown[:, :1 + known] = self._token_slot
        self._token_slot = grown
