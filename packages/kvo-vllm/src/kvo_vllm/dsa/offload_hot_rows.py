"""Which batch rows are NOT_OFFLOADED (their whole sequence sits in their hot row), and what
each such hot row already holds.

A decode row whose request's sequence, this call's tokens included, fits its hot row
(``seq_len <= capacity``) keeps every position ``p`` at hot slot ``p`` (identity mapping): its
top-k is read straight from the hot row, with no residency update and no miss copies. The
rows get there from the pool, once each: a row that held the same request in the previous
call (same serial from :class:`~kvo_vllm.dsa.offload_identity.RowIdentity`, so the pool rows
of its stable prefix are unchanged) copies only positions ``[min(filled, stable), seq_len)``,
i.e. this call's new rows plus any speculative rows past the stable prefix (they may have
been rewritten); any other row (a new request, a prompt written by prefill chunks or pulled
by P/D, a prefix-cache hit, a resumed preemption: all come with a fresh serial) copies
``[0, seq_len)``, at most ``capacity`` rows. The copy is done in ``gather``, where the batch
row of each position is known (``write`` gets slot ids only); on this CPU build pool and hot
buffer are the same RAM, so a device build would rather write a step's new rows into the hot
row from the model's output and copy only the joins.

When the sequence outgrows the hot row the row goes FIRST_OFFLOAD for that one call (the
residency table resets the row and copies the selection, ascending), then STEADY; it is no
longer NOT_OFFLOADED and its hot row belongs to the residency table. A request is never moved
back (its sequence does not shrink). Rows outside the batch and rows that took another path
forget what they held: a later identity use refills them from the pool.
"""

from __future__ import annotations

import attrs
import numpy as np
import torch

_I64 = torch.int64


@attrs.frozen(eq=False)
class IdentityPlan:
    """One call's decision for batch rows ``0..R-1``."""

    identity: torch.Tensor   # bool [R]: NOT_OFFLOADED this call (read at identity slots)
    first: torch.Tensor      # bool [R]: FIRST_OFFLOAD this call (left the identity mapping)
    fill_rows: torch.Tensor  # int64 [F]: batch row of each hot row position to copy from pool
    fill_pos: torch.Tensor   # int64 [F]: its position (= its hot slot)


class IdentityRows:
    """Per layer: for each batch row, the serial whose rows its hot row holds at identity slots
    (-1: none) and how many leading positions are there (module docstring)."""

    def __init__(self, *, max_rows: int, capacity: int) -> None:
        self.capacity = capacity
        self._serials = torch.full((max_rows,), -1, dtype=_I64)
        self._filled = torch.zeros(max_rows, dtype=_I64)
        # NumPy views of the same state, for the per-step fast path (a PyTorch op's dispatch
        # costs more than its arithmetic on a few rows).
        self._serials_np = self._serials.numpy()
        self._filled_np = self._filled.numpy()
        self.any_held = False

    @property
    def held_serials(self) -> torch.Tensor:
        """int64 [max_rows]: the serial each hot row holds at identity slots, -1 none (the
        state itself, for kvo-kernels' ``identity_decode_step``, which advances it)."""
        return self._serials

    @property
    def filled(self) -> torch.Tensor:
        """int64 [max_rows]: how many leading positions each hot row holds (the state)."""
        return self._filled

    def advance_decode_step(self, serials: np.ndarray, lens: np.ndarray) -> bool:
        """The steady state of short requests, in a handful of NumPy ops: if every batch row
        ``0..R-1`` (each decoding one token, ``lens`` its sequence length, all <= capacity)
        holds its request (same serial) with ``[0, len - 1)`` filled, record ``[0, len)``
        filled (the caller copies position ``len - 1`` of each row) and return True; else
        change nothing and return False (the caller then uses :meth:`plan`)."""
        rows = int(lens.shape[0])
        held, filled = self._serials_np, self._filled_np
        if not ((held[:rows] == serials) & (filled[:rows] == lens - 1)).all():
            return False
        filled[:rows] = lens
        if rows < held.shape[0]:
            held[rows:] = -1
        return True

    def plan(self, serials: torch.Tensor, seq_lens: torch.Tensor, query_lens: torch.Tensor,
             decode: torch.Tensor) -> IdentityPlan:
        """Decide rows ``0..R-1`` (``decode``: rows with decode-length queries) and record
        that, once the plan's fill is done, identity rows hold ``[0, seq_len)``."""
        rows = int(seq_lens.shape[0])
        held_serials = self._serials[:rows]
        same = held_serials == serials
        identity = decode & (seq_lens <= self.capacity)
        first = decode & ~identity & same
        stable = seq_lens - query_lens
        start = torch.where(same, torch.minimum(self._filled[:rows], stable),
                            torch.zeros_like(stable))
        counts = torch.where(identity, seq_lens - start, torch.zeros_like(start))
        fill_rows = torch.repeat_interleave(torch.arange(rows, dtype=_I64), counts)
        offsets = torch.arange(fill_rows.numel(), dtype=_I64) - (
            torch.cumsum(counts, 0) - counts)[fill_rows]
        fill_pos = start[fill_rows] + offsets
        self._serials[:rows] = torch.where(identity, serials, torch.full_like(serials, -1))
        self._filled[:rows] = torch.where(identity, seq_lens, torch.zeros_like(seq_lens))
        self._serials[rows:] = -1
        self.any_held = bool(identity.any())
        return IdentityPlan(identity=identity, first=first, fill_rows=fill_rows,
                            fill_pos=fill_pos)
